"""Learning curves through veRL's and OpenRLHF's own launchers (``--host verl|openrlhf``).

Each run is a whole GRPO run as the end-to-end tests launch it (``tests/verl/test_verl_e2e.py``,
``tests/openrlhf/test_openrlhf_e2e.py``, through :mod:`forkrl.plugins.verl.testing_e2e` and
:mod:`forkrl.plugins.openrlhf.testing_e2e`: the host's entry point, Ray, its trainer and
checkpointing, the Hugging Face rollout with a recorder), longer: ``steps`` steps of ``prompts`` prompts
x G samples, each prompt a shared document then a question, the reward the fraction of digits in the
response (the e2e tests' reward: dense, so a tiny model learns it in about 50 steps). Stock and forkrl
start from the same weights and seeds; the rollout stand-in samples from the weights and prompt alone,
and records every sample (``FORKRL_E2E_ROLLOUT_LOG``), so the two runs' rollouts are compared step by
step. A third run of stock with the same update up to float rounding (veRL: half the micro-batch
size, its loss normalised by the whole step's token count; OpenRLHF: eager attention in place of
sdpa, since its prompt order follows the micro-batch size) measures how far rounding alone moves the
curves. Wall-clock: the host's own step timer summed (veRL's ``timing_s/step``, OpenRLHF's
``timing/step_total``: generation, scoring, update), without the runs' start-up.

Run in the host's environment: ``.venv-verl/bin/python -m benchmarks.learning_curve --host verl``.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import torch

from forkrl.core.testing.launcher import ROLLOUT_LOG

#: Shared by every prompt: long enough that the group's prompt dominates its tokens (byte tokens).
DOCUMENT = (
    "Notes from the harbour office. Ships arrive at dawn and leave before the evening tide; the "
    "pilots count the buoys, the clerks count the crates, and the keeper writes every number in the "
    "ledger by the window. When the fog is thick the bell rings twice a minute, and the boats wait "
    "outside the breakwater until the keeper raises the green flag. Reply with digits only. "
)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _pairs(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randrange(100), rng.randrange(100)) for _ in range(n)]


def _rollouts(path: Path) -> dict[int, list]:
    """The recorded samples by weight load (one load per step), each step's sorted."""
    steps: dict[int, list] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        steps.setdefault(row["load"], []).append((row["prompt"], row["tokens"]))
    return {k: sorted(v) for k, v in steps.items()}


def _greedy(
    state: dict[str, torch.Tensor], prompts: list[list[int]], max_new: int, **config
) -> list[list[int]]:
    """Greedy completions of ``prompts`` by the tiny Llama with ``state`` (float32)."""
    from forkrl.core.testing.models import byte_llama

    model = byte_llama(0, **config)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def run_verl(args, tmp: Path) -> dict:
    """Stock veRL (``main_ppo`` with its own config) and ``forkrl_tree``; per run its rewards,
    seconds and rollouts per step, and greedy completions of its final actor."""
    from forkrl.core.testing.models import byte_tokenizer
    from forkrl.plugins.verl.testing_e2e import build_inputs, main_ppo, metrics, saved_actor

    inputs = build_inputs(tmp / "inputs", DOCUMENT, _pairs(args.prompts * args.steps, args.seed))
    sizes = dict(steps=args.steps, group=args.group, prompts=args.prompts, lr=args.lr, max_prompt=512)
    tokenizer = byte_tokenizer()
    probe = [
        list(tokenizer(DOCUMENT + f"What is {a} + {b}?\n")["input_ids"]) for a, b in _pairs(4, args.seed + 1)
    ]
    runs = {}
    for name, config, micro in (
        ("stock veRL", None, None),
        ("forkrl_tree", "forkrl_tree", None),
        (f"stock veRL, micro-batch {args.group // 2}", None, args.group // 2),
    ):
        out = tmp / _slug(name)
        out.mkdir()
        log = out / "rollouts.jsonl"
        main_ppo(
            inputs, out, config, f"data.seed={args.seed}", f"actor_rollout_ref.rollout.response_length={args.max_new}",
            timeout=3600, extra_env={ROLLOUT_LOG: str(log)}, save_freq=args.steps, micro=micro, **sizes,
        )  # fmt: skip
        logged = metrics(out)
        seconds, total = [], 0.0
        for m in logged:
            total += m["data"]["timing_s/step"]
            seconds.append(total)
        runs[name] = {
            "rewards": [m["data"]["critic/score/mean"] for m in logged],
            "seconds": seconds,
            "rollouts": _rollouts(log),
            "greedy": _greedy(
                saved_actor(out, args.steps), probe, args.max_new, max_position_embeddings=1024
            ),
        }
    return runs


def run_openrlhf(args, tmp: Path) -> dict:
    """Stock OpenRLHF (``openrlhf.cli.train_ppo_ray``) and forkrl's launcher with
    ``--forkrl.tree_packing``, as :func:`run_verl`."""
    from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained
    from forkrl.plugins.openrlhf.cpu_patches import SEED as WORKER_SEED
    from forkrl.plugins.openrlhf.testing_e2e import launch, saved_parameters, scalars

    tokenizer = byte_tokenizer()
    model = save_pretrained(byte_llama(0), tokenizer, tmp / "model")
    prompts = tmp / "prompts.jsonl"
    texts = [DOCUMENT + f"{a}+{b}=" for a, b in _pairs(args.prompts * args.steps, args.seed)]
    prompts.write_text("".join(json.dumps({"input": t}) + "\n" for t in texts))
    data = {"model": model, "prompts": prompts, "hf_home": tmp / "hf"}
    sizes = dict(group=args.group, per_step=args.prompts, max_new=args.max_new, lr=args.lr, max_len=512)
    probe = [list(tokenizer(DOCUMENT + f"{a}+{b}=")["input_ids"]) for a, b in _pairs(4, args.seed + 1)]
    runs = {}
    for name, module, extra, attn in (
        ("stock OpenRLHF", "openrlhf.cli.train_ppo_ray", [], "sdpa"),
        ("forkrl tree_packing", "forkrl.plugins.openrlhf.train_ppo_ray", ["--forkrl.tree_packing"], "sdpa"),
        ("stock OpenRLHF, eager attention", "openrlhf.cli.train_ppo_ray", [], "eager"),
    ):
        out = tmp / _slug(name)
        out.mkdir()
        log = out / "rollouts.jsonl"
        launch(
            module, data, out, "--train.seed", str(args.seed), *extra,
            timeout=3600, extra_env={ROLLOUT_LOG: str(log), WORKER_SEED: str(args.seed)}, attn=attn, **sizes,
            rollout="hf",  # samples from the weights and prompts alone: the runs' rollouts compare one by one
        )  # fmt: skip
        logged = scalars(out / "tb")
        reward = logged["train/reward"]
        steps = sorted(reward)
        runs[name] = {
            "rewards": [reward[s] for s in steps],
            "seconds": list(itertools.accumulate(logged["train/timing/step_total"][s] for s in steps)),
            "rollouts": _rollouts(log),
            "greedy": _greedy(dict(saved_parameters(out / "final")), probe, args.max_new),
        }
    return runs


HOSTS = {"verl": run_verl, "openrlhf": run_openrlhf}
