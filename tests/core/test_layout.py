"""Host row layouts <-> per-sequence tokens, checked against hand-placed dense values.

Each host layout is built here the way its host builds it (TRL's left-padded prompt with
right-padded completion; OpenRLHF's right-padded sequences with an action mask and next-token
log-probs; veRL's packed rows rolled by one), and the tree's scores placed by :class:`RowLayout`
must land exactly where the host's own per-token tensors hold them.
"""

from __future__ import annotations

import pytest
import torch

from forkrl.core import RowLayout, TreeOptions, TreeStep, Window
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import dense_logprobs, left_padded
from forkrl.core.testing.models import tiny_causal_lm as make_model


def _rows(seed=0, vocab=61):
    """Prompts (two share one) and completions of varying lengths, as token lists."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = rand(5)
    prompts = [shared, shared, rand(3), shared + rand(2)]
    completions = [rand(4), rand(2), rand(5), rand(1)]
    return prompts, completions


def test_trl_layout_round_trip_and_errors():
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [4, 5, 6, 7, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    lay = RowLayout.padded(ids, mask, 3)
    assert [s.tolist() for s in lay.sequences] == [[5, 6, 7, 8], [4, 5, 6, 7]]
    assert lay.score_from == [2, 3] and lay.scored == [2, 1] and lay.shape == (2, 3)
    host = lay.to_host(torch.tensor([1.0, 2.0, 3.0]))
    assert host.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]
    assert lay.from_host(host).tolist() == [1.0, 2.0, 3.0]
    assert [t.tolist() for t in lay.split(torch.tensor([1.0, 2.0, 3.0]))] == [[1.0, 2.0], [3.0]]
    assert lay.mask().tolist() == [[True, True, False], [True, False, False]]
    empty = RowLayout.padded(ids, torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]), 3)
    assert empty.scored == [2, 0] and empty.score_from[1] == len(empty.sequences[1]) == 3
    with pytest.raises(ValueError, match="row 0 of attention_mask is not one run of real tokens"):
        RowLayout.padded(ids, torch.tensor([[1, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]), 3)
    with pytest.raises(ValueError, match="row 0 has no prompt token"):
        RowLayout.padded(ids, torch.tensor([[0, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0]]), 3)
    with pytest.raises(ValueError, match="same"):
        RowLayout.padded(ids, mask[:, :4], 3)
    with pytest.raises(ValueError, match="width=7"):
        RowLayout.padded(ids, mask, 7)
    with pytest.raises(ValueError, match="response_mask marks a padding position"):
        RowLayout.padded(ids, mask, 3, response_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]))
    with pytest.raises(ValueError, match="flat tensor of the 3 scored tokens"):
        lay.to_host(torch.zeros(4))


def test_to_host_is_differentiable_in_the_values():
    lay = RowLayout.padded(torch.tensor([[3, 4, 5, 6]]), torch.tensor([[1, 1, 1, 1]]), 2)
    values = torch.tensor([0.5, -1.0], requires_grad=True)
    weights = torch.tensor([[2.0, 3.0]])
    (lay.to_host(values, fill=7.0) * weights).sum().backward()
    assert values.grad.tolist() == [2.0, 3.0]


def _score_host(model, layout):
    step = TreeStep(TreeOptions(tree_packing=True))
    with Float64Mode():
        return step.score(model, layout)[0]


def _dense(model, prompts, completions):
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    with Float64Mode(), torch.no_grad():
        return dense_logprobs(model, seqs, [len(p) for p in prompts])[0]


def test_trl_layout_scores_where_trl_reads_them():
    model = make_model("llama-gqa")
    prompts, completions = _rows()
    C = max(map(len, completions))
    ids, mask = left_padded(list(zip(prompts, completions, strict=True)))
    got = _score_host(model, RowLayout.padded(ids, mask, C))
    want = torch.zeros(len(prompts), C, dtype=torch.float64)
    for b, lp in enumerate(_dense(model, prompts, completions)):
        want[b, : len(lp)] = lp  # TRL: completion column j holds completion token j
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_openrlhf_layout_next_token_values_over_the_action_columns():
    """Right-padded full sequences; log-probs [B, T - 1] (position t predicts t + 1), actions the
    last A columns, marked by an action mask (the prompt may reach into those columns)."""
    model = make_model("llama-gqa")
    prompts, completions = _rows(seed=1)
    T = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    A = max(map(len, completions)) + 2
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    action = torch.zeros(len(prompts), A, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = p + c
        ids[b, : len(seq)], mask[b, : len(seq)] = torch.tensor(seq), 1
        for j in range(len(p), len(seq)):  # token j is predicted at log-prob column j - 1
            action[b, (j - 1) - (T - 1 - A)] = 1
    # Layout width A over the [B, T - 1] next-token tensor's last A columns = tokens T - A .. T - 1.
    layout = RowLayout.padded(ids, mask, A, response_mask=action)
    got = _score_host(model, layout)
    want = torch.zeros(len(prompts), A, dtype=torch.float64)
    for b, lp in enumerate(_dense(model, prompts, completions)):
        start = len(prompts[b]) - (T - A)
        want[b, start : start + len(lp)] = lp
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert layout.score_from == [len(p) for p in prompts]


@pytest.mark.parametrize("align", ["token", "next"])
@pytest.mark.parametrize("two_d", [False, True])
def test_packed_layout_places_values_at_the_token_or_its_predictor(align, two_d):
    model = make_model("llama-gqa")
    prompts, completions = _rows(seed=2)
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    ids = torch.tensor([t for s in seqs for t in s])
    ids = ids[None] if two_d else ids
    layout = RowLayout.packed(ids, torch.tensor(cu), [len(p) for p in prompts], align=align)
    got = _score_host(model, layout)
    assert tuple(got.shape) == tuple(ids.shape)
    want = torch.zeros(cu[-1], dtype=torch.float64)
    shift = 1 if align == "next" else 0
    for b, lp in enumerate(_dense(model, prompts, completions)):
        first = cu[b] + len(prompts[b]) - shift
        want[first : first + len(lp)] = lp
    torch.testing.assert_close(got.reshape(-1), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly"):
        RowLayout.packed(ids, [0, 3, 3, cu[-1]], [1, 1, 1])
    with pytest.raises(ValueError, match=r"score_from\[1\] = 0 is out of range"):
        RowLayout.packed(ids, cu, [1, 0, 1, 1])


def test_window_joins_micro_batches_in_order():
    a = RowLayout.spans([torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4, 5])], [1, 2])
    b = RowLayout.spans([torch.tensor([1, 2, 3, 9])], [3])
    w = Window([a, b])
    forest = w.forest()
    assert forest.num_sequences == 3 and w.rows == [0, 2, 3]
    per_seq = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0])]
    flat = w.flat(per_seq)
    assert [f.tolist() for f in flat] == [[1.0, 2.0, 3.0, 4.0], [5.0]]
    assert [t.tolist() for t in w.per_sequence(flat)] == [t.tolist() for t in per_seq]
