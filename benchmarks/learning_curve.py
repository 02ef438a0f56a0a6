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
    .venv-verl/bin/python -m benchmarks.learning_curve --host verl
    .venv-openrlhf/bin/python -m benchmarks.learning_curve --host openrlhf

``--host verl|openrlhf`` runs whole runs through the host's own launcher on the end-to-end tests'
CPU harness, each in the host's environment (:mod:`benchmarks.learning_curve_hosts`).
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


def _run_trl(args, tmp: Path) -> dict:
    """Stock ``trl.GRPOTrainer`` and forkrl's ``tree_packing``, one after the other in this process."""
    args.device, args.bf16 = "cpu", False
    ex = _example()
    ex.quiet_libraries()
    model_path = ex.tiny_model(tmp / "model", args.seed)
    train_set = ex.dataset(args.prompts * args.steps, args.doc_len, args.seed)
    runs, trainers = {}, {}
    for name, tree in (("stock TRL", False), ("forkrl tree_packing", True)):
        trainer, rewards, seconds, rollouts = _curve(ex, args, model_path, tmp / name, tree, train_set)
        trainers[name] = trainer
        runs[name] = {"rewards": rewards, "seconds": seconds, "rollouts": dict(enumerate(rollouts))}
    probe = [train_set[i]["prompt"] for i in range(4)]
    for name, trainer in trainers.items():
        runs[name]["greedy"] = _greedy(trainer, probe, args.max_new)
    return runs


def report(args, runs: dict[str, dict], title: str) -> dict:
    """Table, summary and plot of two runs (stock first): per step the rewards and seconds, whether
    the step's rollouts were the same; the time to 90% of stock's final reward."""
    (s_name, stock), (t_name, tree), *control = runs.items()
    s_rew, t_rew, s_sec, t_sec = stock["rewards"], tree["rewards"], stock["seconds"], tree["seconds"]
    steps = sorted(set(stock["rollouts"]) & set(tree["rollouts"]))
    same = [stock["rollouts"][k] == tree["rollouts"][k] for k in steps][: len(s_rew)]
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
        "max_reward_gap": max(abs(r["stock_reward"] - r["tree_reward"]) for r in rows),
        "final_reward": {"stock": statistics.mean(s_rew[-5:]), "tree": statistics.mean(t_rew[-5:])},
        "target_reward": target,
        "seconds_to_target": {"stock": ts, "tree": tt},
        "time_to_reward_ratio": ts / tt if ts and tt else None,
        "wall_clock_ratio": s_sec[-1] / t_sec[-1],
        "greedy_agree": stock["greedy"] == tree["greedy"],
        "mean_reward_gap": statistics.mean(abs(r["stock_reward"] - r["tree_reward"]) for r in rows),
    }
    for c_name, c in control:  # stock again, its update changed only by rounding: the noise floor
        c_same = [stock["rollouts"].get(k) == c["rollouts"].get(k) for k in steps][: len(s_rew)]
        gaps = [abs(a - b) for a, b in zip(s_rew, c["rewards"], strict=False)]
        summary["control"] = {
            "name": c_name,
            "first_step_rollouts_differ": c_same.index(False) + 1 if False in c_same else None,
            "max_reward_gap": max(gaps),
            "mean_reward_gap": statistics.mean(gaps),
            "final_reward": statistics.mean(c["rewards"][-5:]),
            "seconds_to_target": _time_to(c["rewards"], c["seconds"], target),
            "greedy_agree_with_stock": c["greedy"] == stock["greedy"],
        }
    for key, value in summary.items():
        print(f"{key}: {value}")
    m = machine()
    curves = {s_name: (s_rew, s_sec), t_name: (t_rew, t_sec)}
    curves.update({name: (c["rewards"], c["seconds"]) for name, c in control})
    title = f"{title}, G={args.group}, {args.prompts} prompts/step, seed {args.seed}; {m['cpu']} CPU, {m['threads']} threads"
    if args.plot:
        try:
            plot(curves, Path(args.plot), title)
        except ImportError:  # the veRL and OpenRLHF environments have no matplotlib
            print(
                "no plot: matplotlib is not installed here; plot the JSON line below with "
                f"`.venv/bin/python -m benchmarks.learning_curve --replot FILE --plot {args.plot}`"
            )
    return {"summary": summary, "rows": rows, "curves": curves, "title": title}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", choices=["trl", "verl", "openrlhf"], default="trl")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--doc-len", type=int, default=1024, help="tokens of the shared document (TRL)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    ap.add_argument("--group", type=int, default=8, help="G")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--lr", type=float, default=None, help="default: 2e-2 (TRL), 1e-2 (veRL, OpenRLHF)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--plot", default=None, help="PNG path ('' for none; default results/learning_curve_<host>.png)"
    )
    ap.add_argument("--replot", default=None, help="a JSON line this benchmark printed: only draw its plot")
    ap.add_argument(
        "--workdir", default=None, help="keep the runs' files here (default: a temporary directory)"
    )
    args = ap.parse_args()
    if args.replot:
        record = json.loads(Path(args.replot).read_text().strip().splitlines()[-1])
        plot(
            {k: tuple(v) for k, v in record["curves"].items()},
            Path(args.plot or RESULTS / f"learning_curve_{record['host']}.png"),
            record["title"],
        )
        return
    if args.lr is None:
        args.lr = 2e-2 if args.host == "trl" else 1e-2
    if args.plot is None:
        args.plot = str(RESULTS / f"learning_curve_{args.host}.png")
    titles = {
        "trl": f"TRL GRPO, tiny Llama, shared document {args.doc_len} tokens",
        "verl": "veRL main_ppo GRPO (FSDP2, KL loss), tiny Llama, shared document",
        "openrlhf": "OpenRLHF train_ppo_ray GRPO (ZeRO-2, KL loss), tiny Llama, shared document",
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.host == "trl":
            runs = _run_trl(args, work)
        else:
            from benchmarks.learning_curve_hosts import HOSTS

            runs = HOSTS[args.host](args, work)
    out = report(args, runs, titles[args.host])
    record = {
        "benchmark": "learning_curve",
        "host": args.host,
        "machine": machine(),
        "args": vars(args),
        **out,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
