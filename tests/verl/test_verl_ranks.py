"""Two gloo ranks under veRL's FSDP2 engine: ranks hold different forests (rank 0 groups that share
prompts, rank 1 rows that share nothing) and the tree engine's update still equals veRL's own,
with the mini-batch's rows moved between the ranks by tree cost (``tree_balance: auto``) and without."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkrl.core.testing.ranks import rank_lines, torchrun

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
from tests.verl import harness as h
from forkrl.core.testing.ranks import finish, report
import forkrl.plugins.verl.engine as engine
rows_after = []
def spy(*args, **kwargs):  # this rank's row count after each rebalancing
    out, result = balance_mini_batch(*args, **kwargs)
    rows_after.append(len(out))
    return out, result
balance_mini_batch, engine.balance_mini_batch = engine.balance_mini_batch, spy
rank = dist.get_rank()
path = sys.argv[1]
g = torch.Generator().manual_seed(7)
dynamic = sys.argv[3].endswith("-dynamic")  # veRL's token-budget micro-batches
kw = dict(use_dynamic_bsz=True) if dynamic else {{}}
tokens = 48 if dynamic else None
if sys.argv[3].startswith("uneven"):  # rank 0 one cheap group of 8, rank 1 eight costly rows: counts should change
    if rank == 0:
        prompt = torch.randint(0, 250, (12,), generator=g).tolist()
        rollouts = [(prompt, torch.randint(0, 250, (2 + k % 3,), generator=g).tolist()) for k in range(8)]
    else:
        rollouts = [([k] + torch.randint(0, 250, (30,), generator=g).tolist(), torch.randint(0, 250, (3,), generator=g).tolist()) for k in range(8)]
elif rank == 0:  # two GRPO groups (two trees: the second's opening differs)
    rollouts = [(p if i < 4 else [251] + p[1:], r) for i, (p, r) in enumerate(h.rows(seed=0))]
else:  # nothing shared between rows, and longer: the costlier rank, until rows move
    rollouts = [([k] + torch.randint(0, 250, (11 + k % 3,), generator=g).tolist(), torch.randint(0, 250, (2 + k % 4,), generator=g).tolist()) for k in range(8)]
stock = h.worker(path, h.actor_config(None, ppo_mini_batch_size=16, **kw), max_token_len=tokens)
balances = sys.argv[2].split(",")
trees = {{b: h.worker(path, h.actor_config({{"tree_packing": True, "tree_balance": b}}, ppo_mini_batch_size=16, **kw), max_token_len=tokens) for b in balances}}
init = h.parameters(stock)
rows_of, mts = {{}}, {{}}
for step in range(2):
    td = h.batch(rollouts, seed=10 * rank + step, kl=True)
    ms = h.update(stock, td, 16, entropy=True)
    for b, tree in trees.items():
        rows_after.clear()
        mts[b] = h.update(tree, td, 16, entropy=True)
        rows_of[b] = ",".join(map(str, rows_after)) or "-"
p_stock = h.parameters(stock)
change = max((p_stock[n] - init[n]).abs().max().item() for n in p_stock)
lines = []
for b, tree in trees.items():
    p_tree, mt = h.parameters(tree), mts[b]
    rel = max((p_tree[n] - p_stock[n]).abs().max().item() for n in p_stock) / change
    if b != "off":  # the slowest rank's measured step beside the plan's prediction
        assert mt["tree/balance_measured_imbalance"][0] >= 1.0 and mt["tree/balance_predicted_makespan"][0] > 0
    moved = mt.get("tree/balance_moved_rows", [-1])
    moved = moved[0] if isinstance(moved, list) else moved
    lines.append(f"RANK {{rank}} {{b}} REL {{rel:.3e}} CHANGE {{change:.3e}} LOSS {{ms['loss'][0]:.6f}} {{mt['loss'][0]:.6f}} MOVED {{moved}} ROWS {{rows_of[b]}}")
report(*lines)
finish()
"""


@pytest.mark.parametrize(
    "balances,shape", [("auto,off", "skewed"), ("on", "uneven"), ("on", "uneven-dynamic")]
)
def test_two_ranks_equal_stock(tmp_path, balances, shape):
    """Stock's update with and without the balancer (one run trains stock and each setting); in
    ``uneven`` the plan changes the ranks' row counts, and each rank still trains 4 micro-batches
    (of unequal sizes); ``-dynamic``: veRL's token-budget micro-batches (the same count on every
    rank, as veRL makes them)."""
    from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained

    path = save_pretrained(byte_llama(0), byte_tokenizer(), tmp_path / "model")
    script = tmp_path / "ranks.py"
    script.write_text(_SCRIPT.format(root=str(ROOT)))
    lines = rank_lines(torchrun(script, path, balances, shape, cwd=ROOT).stdout)
    assert len(lines) == 2 * len(balances.split(",")), lines
    counts: dict[str, list[str]] = {}
    for line in lines:
        fields = line.split()
        balance = fields[2]
        assert float(fields[4]) < 1e-4 and float(fields[6]) > 0, line
        assert abs(float(fields[8]) - float(fields[9])) < 1e-4 * max(1.0, abs(float(fields[8]))), line
        moved = float(fields[11])
        assert moved > 0 if balance != "off" else moved == -1, line  # rows moved; off left them
        counts.setdefault(balance, []).append(fields[13])
    if shape.startswith("uneven"):
        first = [int(c.split(",")[0]) for c in counts["on"]]
        assert sum(first) == 16 and first[0] != first[1], counts
    else:
        assert counts["off"] == ["-", "-"], counts


_VIDEO_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
from tests.verl import harness as h
from forkrl.core.testing.ranks import finish, report
rank = dist.get_rank()
tree = h.worker(sys.argv[1], h.actor_config({{"tree_packing": True}}, ppo_mini_batch_size=16))
rollouts = h.rows(seed=rank)
clean = h.agent_loop_fields(h.batch(rollouts, seed=rank), rollouts)
td = clean.clone()
if rank == 0:  # one row of one rank carries video
    from verl.utils import tensordict_utils as tu
    rows = [{{}} for _ in rollouts]
    rows[3] = {{"pixel_values_videos": torch.zeros(16, 1176), "video_grid_thw": torch.tensor([[1, 4, 4]])}}
    tu.assign_non_tensor_stack(td, "multi_modal_inputs", rows)
before = h.parameters(tree)
try:
    h.update(tree, td, 16, True)
    error = "none"
except ValueError as err:
    error = str(err).split(":")[0].replace(" ", "_")
after = h.parameters(tree)
unchanged = all(torch.equal(after[n], before[n]) for n in before)
no_grad = all(p.grad is None or not p.grad.any() for p in tree.engine.module.parameters())
h.update(tree, clean, 16, True)  # the ranks are still in step: the next batch trains on both
moved = max((h.parameters(tree)[n] - before[n]).abs().max().item() for n in before)
report(f"RANK {{rank}} ERROR {{error}} UNCHANGED {{unchanged and no_grad}} MOVED {{moved:.3e}}")
finish()
"""


def test_a_refusal_on_one_rank_stops_every_rank(tmp_path):
    """Video in one rank's rows (a vision-language model, two gloo ranks): that rank refuses it and
    the other learns of it and raises too, before the step's first collective, nothing changed on
    either (without the agreement the other rank waits in veRL's token all-reduce for ever); both
    then train the next batch. Bounded by the run's timeout."""
    from forkrl.core.testing.vision import qwen_vl_model, qwen_vl_processor

    processor = qwen_vl_processor()
    model = qwen_vl_model(processor.tokenizer, tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "model")
    processor.tokenizer.save_pretrained(tmp_path / "model")
    script = tmp_path / "video.py"
    script.write_text(_VIDEO_SCRIPT.format(root=str(ROOT)))
    lines = rank_lines(torchrun(script, str(tmp_path / "model"), cwd=ROOT, timeout=300).stdout)
    assert sorted(line.split()[:4] for line in lines) == [
        ["RANK", "0", "ERROR", "row_3_carries_video_(pixel_values_videos,_video_grid_thw)"],
        ["RANK", "1", "ERROR", "another_rank_refused_this_batch_before_the_step_(see_that_rank's_error"],
    ], lines
    for line in lines:
        fields = line.split()
        assert fields[5] == "True" and float(fields[7]) > 0, line
