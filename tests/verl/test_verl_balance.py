"""veRL's mini-batches split into rows and collated back (``forkrl.tree_balance``), in one process:
the round trip gives veRL's batch back, and rows of ranks with different padded widths collate to
the layout veRL's own ``left_right_2_no_padding`` gives their union."""

from __future__ import annotations

import torch
from verl.workers.utils.padding import no_padding_2_padding

from forkrl.plugins.verl import balance, compat
from forkrl.plugins.verl import testing as h


def _equal(a, b) -> bool:
    if getattr(a, "is_nested", False) or getattr(b, "is_nested", False):
        return all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _fields(td) -> dict:
    return {k: td.get(k) for k in td.keys()}


def _round_trip(td):
    rows, meta = balance._split(td)
    nested = {
        k: bool(getattr(v, "is_nested", False)) for k, v in _fields(td).items() if isinstance(v, torch.Tensor)
    }
    widths = {
        k: int(v.shape[1]) for k, v in _fields(td).items() if k in nested and not nested[k] and v.dim() > 1
    }
    return rows, meta, balance._collate(rows, nested, widths)


def test_round_trip_padded_layout():
    td = h.batch(h.rows(seed=0), kl=True, is_weights=True)
    rows, meta, out = _round_trip(td)
    assert {"max_seq_len", "max_response_len", "indices"} <= set(meta)
    for key, value in _fields(td).items():
        if isinstance(value, torch.Tensor):
            assert _equal(out.get(key), value), key
    assert [balance._sequence(r)[1] for r in rows] == compat.prompt_lengths(td).tolist()


def test_round_trip_nested_layout():
    """The v1 trainer's layout: prompts and responses nested per row too."""
    rollouts = h.rows(seed=1)
    td = h.batch(rollouts)
    td["prompts"] = torch.nested.as_nested_tensor([torch.tensor(p) for p, _ in rollouts], layout=torch.jagged)
    td["responses"] = torch.nested.as_nested_tensor(
        [torch.tensor(r) for _, r in rollouts], layout=torch.jagged
    )
    del td["attention_mask"]
    rows, _, out = _round_trip(td)
    assert out.get("prompts").is_nested and out.get("responses").is_nested
    for key in ("input_ids", "position_ids", "prompts", "responses", "old_log_probs", "advantages"):
        assert _equal(out.get(key), td.get(key)), key
    assert [balance._sequence(r) for r in rows] == [(p + r, len(p)) for p, r in rollouts]


def test_rows_of_different_widths_collate_to_veRLs_layout():
    """Rank 0's rows are wider (long prompts and responses) than rank 1's; their rows together are
    laid out as veRL lays out the union of the rollouts, and each row keeps its values."""
    long_rows = [([7] * 20 + [k], [3, 4, 5, 6, 7, 8][: 2 + k % 4]) for k in range(4)]
    short_rows = [([9, k], [1]) for k in range(4)]
    a, b = h.batch(long_rows, kl=True), h.batch(short_rows, kl=True)
    rows_a, _ = balance._split(a)
    rows_b, _ = balance._split(b)
    mixed = [rows_b[0], rows_a[2], rows_b[3], rows_a[3]]  # with the widest prompt and response
    union = h.batch([short_rows[0], long_rows[2], short_rows[3], long_rows[3]], kl=True)
    nested = {
        k: bool(getattr(v, "is_nested", False)) for k, v in _fields(a).items() if isinstance(v, torch.Tensor)
    }
    widths = {k: max(int(a.get(k).shape[1]), int(b.get(k).shape[1])) for k in nested if not nested[k]}
    out = balance._collate(mixed, nested, widths)
    for key in (
        "input_ids",
        "position_ids",
        "prompts",
        "responses",
        "response_mask",
        "attention_mask",
        "loss_mask",
    ):
        assert _equal(out.get(key), union.get(key)), key
    # per-token values follow their rows, read back as veRL's loss reads them
    read = no_padding_2_padding(out.get("input_ids"), out)
    assert torch.equal(read, no_padding_2_padding(union.get("input_ids"), union))
    for slot, (row, source) in enumerate([(0, b), (2, a), (3, b), (3, a)]):
        width = int(source.get("responses").shape[1])
        assert torch.equal(out.get("old_log_probs")[slot, :width], source.get("old_log_probs")[row])
        assert not out.get("old_log_probs")[slot, width:].any()
