"""Learning curves, forkrl against stock, from the same seeds: reward against step and wall-clock.

The task is the README example's (``examples/trl_grpo_tree.py``): a long shared document, then a
question naming a letter set; the reward is the fraction of the completion's characters in it
(dense, learnable by a tiny model in about 50 steps). Stock ``trl.GRPOTrainer`` and forkrl's
``GRPOTrainer(tree_packing=True)`` train from the same weights with the same seed, G=8, TRL's own
sampling, one after the other in this process. Reports per step both rewards, the first step where
the sampled rollouts differ (the updates differ by float rounding, and sampling amplifies a
rounding difference into other tokens eventually), the wall-clock to reach 90% of stock's final
reward, and whether greedy completions of the two final models agree. Writes a PNG (reward against
step and against seconds) and prints a table, then one line of JSON.

    .venv/bin/python -m benchmarks.learning_curve --host trl                 # about 2 minutes
    .venv/bin/python -m benchmarks.learning_curve --host trl --steps 80 --doc-len 2048

Only ``--host trl`` runs here: a veRL or OpenRLHF curve needs a whole run through the host's
launcher on this machine (issue 26's CPU host harness).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import REPO, machine, print_table

RESULTS = REPO / "benchmarks" / "results"


def _example():
    spec = importlib.util.spec_from_file_location("trl_grpo_tree", REPO / "examples" / "trl_grpo_tree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _curve(ex, args, model_path: str, out: Path, tree: bool, train_set):
    from transformers import TrainerCallback

    trainer = ex.make_trainer(args, model_path, out, tree, args.steps, train_set)
    clock = {"start": time.perf_counter(), "at": []}
    rollouts: list[list[list[int]]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            clock["at"].append(time.perf_counter() - clock["start"])

    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        batch = generate(inputs)
        rollouts.append(batch["completion_ids"].tolist())
        return batch

    trainer._generate_and_score_completions = recorded
    trainer.add_callback(Clock())
    clock["start"] = time.perf_counter()
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return trainer, rewards, clock["at"], rollouts


def _greedy(trainer, prompts: list[str], max_new: int) -> list[str]:
    tok = trainer.processing_class
    model = trainer.model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt")["input_ids"]
            gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
            out.append(tok.decode(gen[0, ids.shape[1] :]))
    return out


def _time_to(rewards: list[float], seconds: list[float], target: float, window: int = 3) -> float | None:
    for i in range(window - 1, len(rewards)):
        if statistics.mean(rewards[i - window + 1 : i + 1]) >= target:
            return seconds[i]
    return None


def plot(curves: dict[str, tuple[list[float], list[float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=120, sharey=True)
    for i, (name, (rewards, seconds)) in enumerate(curves.items()):
        # Each step's mean over 2 prompts is coarse (0, 0.5, 1 once the letters are learned): the
        # 5-step running mean is drawn over the raw values.
        smooth = [statistics.mean(rewards[max(0, k - 4) : k + 1]) for k in range(len(rewards))]
        steps = range(1, len(rewards) + 1)
        by_step.plot(steps, rewards, color=f"C{i}", alpha=0.25, lw=0.8)
        by_step.plot(steps, smooth, color=f"C{i}", label=f"{name} (5-step mean)")
        by_time.plot(seconds, rewards, color=f"C{i}", alpha=0.25, lw=0.8)
        by_time.plot(seconds, smooth, color=f"C{i}", label=f"{name} (5-step mean)")
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel("wall-clock seconds (generation included)")
    by_step.set_ylabel("mean reward")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", choices=["trl"], default="trl")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--doc-len", type=int, default=1024, help="tokens of the shared document")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    ap.add_argument("--group", type=int, default=8, help="G")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=str(RESULTS / "learning_curve_trl.png"), help="PNG path ('' for none)")
    args = ap.parse_args()
    args.device, args.bf16 = "cpu", False
    ex = _example()
    ex.quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_path = ex.tiny_model(tmp / "model", args.seed)
        train_set = ex.dataset(args.prompts * args.steps, args.doc_len, args.seed)
        runs = {}
        for name, tree in (("stock TRL", False), ("forkrl tree_packing", True)):
            runs[name] = _curve(ex, args, model_path, tmp / name, tree, train_set)
        probe = [train_set[i]["prompt"] for i in range(4)]
        greedy = {name: _greedy(run[0], probe, args.max_new) for name, run in runs.items()}
    (_, s_rew, s_sec, s_roll), (_, t_rew, t_sec, t_roll) = runs["stock TRL"], runs["forkrl tree_packing"]
    same = [a == b for a, b in zip(s_roll, t_roll, strict=False)]
    first_diff = same.index(False) + 1 if False in same else None
    target = 0.9 * statistics.mean(s_rew[-5:])
    ts, tt = _time_to(s_rew, s_sec, target), _time_to(t_rew, t_sec, target)
    rows = [
        {"step": i + 1, "stock_reward": a, "tree_reward": b, "stock_s": sa, "tree_s": sb, "same_rollouts": s}
        for i, (a, b, sa, sb, s) in enumerate(zip(s_rew, t_rew, s_sec, t_sec, same, strict=False))
    ]
    print_table(
        rows[:: max(1, len(rows) // 10)] + rows[-1:],
        [("step", "{}"), ("stock_reward", "{:.3f}"), ("tree_reward", "{:.3f}"), ("stock_s", "{:.1f}"),
         ("tree_s", "{:.1f}"), ("same_rollouts", "{}")],
    )  # fmt: skip
    summary = {
        "identical_steps": first_diff - 1 if first_diff else len(same),
        "first_step_rollouts_differ": first_diff,
        "max_reward_gap_while_identical": max(
            (abs(r["stock_reward"] - r["tree_reward"]) for r in rows if r["same_rollouts"]), default=0.0
        ),
        "final_reward": {"stock": statistics.mean(s_rew[-5:]), "tree": statistics.mean(t_rew[-5:])},
        "target_reward": target,
        "seconds_to_target": {"stock": ts, "tree": tt},
        "time_to_reward_ratio": ts / tt if ts and tt else None,
        "wall_clock_ratio": s_sec[-1] / t_sec[-1],
        "greedy_agree": greedy["stock TRL"] == greedy["forkrl tree_packing"],
    }
    for key, value in summary.items():
        print(f"{key}: {value}")
    if args.plot:
        m = machine()
        plot(
            {"stock TRL": (s_rew, s_sec), "forkrl tree_packing": (t_rew, t_sec)},
            Path(args.plot),
            f"TRL GRPO, tiny Llama, shared document {args.doc_len} tokens, G={args.group}, "
            f"{args.prompts} prompts/step, seed {args.seed}; {m['cpu']} CPU, {m['threads']} threads",
        )
    print(
        json.dumps(
            {
                "benchmark": "learning_curve",
                "machine": machine(),
                "args": vars(args),
                "summary": summary,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
