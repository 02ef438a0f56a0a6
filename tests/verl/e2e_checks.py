"""What every end-to-end run of veRL must show (tests/verl/test_verl_e2e*.py): its own logs and
checkpoint, and on vLLM that veRL's weight sync reached the engine."""

from __future__ import annotations

from pathlib import Path

from forkrl.plugins.verl.testing_e2e import STEPS, metrics, saved_actor


def changed_parameters(inputs: dict, out: Path) -> float:
    """Largest change of any actor parameter: the step-``STEPS`` checkpoint against the initial model."""
    from transformers import AutoModelForCausalLM

    saved = saved_actor(out)
    initial = AutoModelForCausalLM.from_pretrained(inputs["model"]).state_dict()
    assert set(saved) == set(initial)
    return max((saved[k] - initial[k].float()).abs().max().item() for k in initial)


def check_run(inputs: dict, out: Path, log: str, tree: bool) -> list[dict]:
    """The run's own logs and checkpoint: every step logged, the actor trained, tree metrics iff ``tree``."""
    logged = metrics(out)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert changed_parameters(inputs, out) > 1e-4
    for m in logged:
        data = m["data"]
        assert data["critic/score/mean"] >= 0  # the reward ran
        tree_keys = [k for k in data if k.startswith("actor/tree/")]
        if tree:  # veRL prefixes the actor's metrics with actor/
            assert data["actor/tree/compression"] > 1.5, data["actor/tree/compression"]
            assert data["actor/tree/dense_tokens"] > data["actor/tree/unique_tokens"] > 0
        else:
            assert not tree_keys, tree_keys
    assert ("forkrl: veRL plugin active" in log) == tree
    return logged


def check_vllm_rollouts(logged: list[dict]) -> None:
    """veRL compares its rollout's sampling probabilities with the actor's: the engine starts from
    dummy weights (veRL's default load format), so they agree only if veRL's weight sync reached
    it (measured: about 5e-5; two different random models differ by about 4e-3)."""
    for m in logged:
        assert m["data"]["training/rollout_probs_diff_mean"] < 1e-3, m["data"][
            "training/rollout_probs_diff_mean"
        ]
