"""forkrl for OpenRLHF: tree training and prefix-shared scoring in OpenRLHF's PPO/GRPO.

Run OpenRLHF's usual command through forkrl's launcher, with forkrl's flags added::

    python -m forkrl.plugins.openrlhf.train_ppo_ray <OpenRLHF's flags> --forkrl.tree_packing

- :mod:`.train_ppo_ray`: the launcher (OpenRLHF's own ``__main__``, run with forkrl's actors).
- :mod:`.actors`: the policy and reference Ray actors (tree-scored old/reference log-probs).
- :mod:`.trainer`: :class:`~.trainer.TreeActorPPOTrainer`, each optimizer step one forest.
- :mod:`.options`: the ``--forkrl.*`` flags and the OpenRLHF settings they refuse.
- :mod:`.balance`: ``--forkrl.tree_balance``, a window's rows moved between ranks by tree cost.
- :mod:`.rollout`: ``--forkrl.speculative_rollout``, forkrl's drafter in each vLLM engine's arguments.
- :mod:`.compat`: every OpenRLHF name the plugin swaps and private it reads, with its version.
- :mod:`.cpu_run`: a CPU smoke run of the whole launcher for a tiny model
  (``python -m forkrl.plugins.openrlhf.cpu_run``), with its stand-ins for the GPU-only parts:
  :mod:`.cpu_rollout` (a Hugging Face ``generate`` rollout in place of vLLM) and :mod:`.cpu_patches`
  (device patches in every Ray worker). Nothing else imports them.

Importing this package does not import OpenRLHF; the submodules above (except ``options``) do.
"""
