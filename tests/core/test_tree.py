"""PrefixForest: trie structure, the sequence <-> entry maps, input validation, and (property-based)
exactness of TreeExecutor over random forests against plain per-sequence autograd in float64."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.forests import FORESTS
from forkrl.core.testing.models import TEST_VOCAB as VOCAB
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model

TOL = 1e-10


# ---------------------------------------------------------------------------------------------- helpers
def _as_lists(seqs):
    return [torch.as_tensor(s).tolist() for s in seqs]


def _subtree(forest, n):
    out, todo = [], [n]
    while todo:
        m = todo.pop()
        out.append(m)
        todo.extend(forest.nodes[m].children)
    return out


def _signature(forest):
    """Everything a forest holds, as plain Python values (for comparing two forests)."""
    nodes = [
        (
            n.index,
            n.tokens.tolist(),
            n.start,
            n.parent,
            list(n.children),
            list(n.owners),
            n.rows.tolist(),
            n.entry_row.tolist(),
            n.entry_target.tolist(),
            n.entry_offset,
        )
        for n in forest.nodes
    ]
    return (
        nodes,
        list(forest.roots),
        list(forest.lengths),
        list(forest.score_from),
        [list(p) for p in forest.paths],
        [e.tolist() for e in forest.seq_entries],
        forest.num_entries,
    )


def check_structure(forest, seqs, score_from):
    """Trie invariants: pre-order, paths, round trip, statistics."""
    seqs = _as_lists(seqs)
    nodes = forest.nodes
    assert forest.num_sequences == len(seqs)
    assert forest.lengths == [len(s) for s in seqs]
    assert forest.score_from == list(score_from)
    assert [n.index for n in nodes] == list(range(len(nodes)))
    assert forest.roots == [n.index for n in nodes if n.parent == -1]
    # Depth-first pre-order: parent before child, every subtree a contiguous index range.
    for n in nodes:
        assert len(n.tokens) >= 1
        assert n.tokens.dtype == torch.int64
        if n.parent >= 0:
            assert n.parent < n.index
            assert n.index in nodes[n.parent].children
            assert n.start == nodes[n.parent].end
        else:
            assert n.start == 0
        sub = sorted(_subtree(forest, n.index))
        assert sub == list(range(n.index, n.index + len(sub)))
        for c in n.children:
            assert nodes[c].parent == n.index
        # Children sorted by (and distinct in) their first token: the trie is compressed.
        firsts = [int(nodes[c].tokens[0]) for c in n.children]
        assert firsts == sorted(set(firsts))
        # A node with one child and no owner would not be maximal.
        assert len(n.children) != 1 or n.owners
        # Leaves end some sequence.
        assert n.children or n.owners
    root_firsts = [int(nodes[r].tokens[0]) for r in forest.roots]
    assert root_firsts == sorted(set(root_firsts))
    assert sorted(s for n in nodes for s in n.owners) == list(range(len(seqs)))
    # Walking the roots' subtrees in order visits every node exactly once, in index order.
    assert [m for r in forest.roots for m in sorted(_subtree(forest, r))] == list(range(len(nodes)))

    for s, seq in enumerate(seqs):
        path = forest.paths[s]
        assert path[0] in forest.roots
        assert nodes[path[0]].start == 0
        for a, b in zip(path, path[1:], strict=False):
            assert nodes[b].parent == a
            assert nodes[b].start == nodes[a].end
        assert s in nodes[path[-1]].owners
        assert nodes[path[-1]].end == len(seq)
        assert forest.sequence_tokens(s).tolist() == seq
    assert forest.unique_tokens == sum(len(n.tokens) for n in nodes)
    # Each stored token is one distinct non-empty prefix of the batch.
    assert forest.unique_tokens == len({tuple(seq[: t + 1]) for seq in seqs for t in range(len(seq))})
    assert forest.dense_tokens == sum(len(s) for s in seqs)
    assert forest.compression == pytest.approx(forest.dense_tokens / forest.unique_tokens)
    assert forest.compression >= 1
    assert forest.scored_tokens == sum(len(s) - f for s, f in zip(seqs, score_from, strict=True))
    assert forest.depth() == max(len(p) for p in forest.paths)


def _entry_owner(forest, e):
    """The node whose entry range [entry_offset, entry_offset + num_entries) holds entry e."""
    hits = [n for n in forest.nodes if n.entry_offset <= e < n.entry_offset + n.num_entries]
    assert len(hits) == 1, f"entry {e} is in {len(hits)} node ranges"
    return hits[0]


def check_mapping(forest, seqs, score_from, seed=0):
    """seq_entries: right targets, right prediction rows, shared exactly on equal prefixes; gather and
    scatter_add adjoint."""
    seqs = _as_lists(seqs)
    nodes = forest.nodes
    # Node entry ranges tile [0, num_entries) in node order.
    offset = 0
    for n in nodes:
        assert n.entry_offset == offset
        assert len(n.entry_row) == len(n.entry_target) == n.num_entries
        if n.num_entries:
            assert n.entry_row.min() >= 0 and n.entry_row.max() < len(n.rows)
            assert (n.entry_row[1:] >= n.entry_row[:-1]).all()  # the executor relies on this
        assert n.rows.tolist() == sorted(set(n.rows.tolist()))
        assert all(0 <= r < len(n.tokens) for r in n.rows.tolist())
        assert set(n.entry_row.tolist()) == set(range(len(n.rows)))  # no row without an entry
        offset += n.num_entries
    assert forest.num_entries == offset

    key_of_entry: dict[int, tuple] = {}
    entry_of_key: dict[tuple, int] = {}
    for s, (seq, sf) in enumerate(zip(seqs, score_from, strict=True)):
        ent = forest.seq_entries[s]
        assert ent.dtype == torch.int64
        assert ent.shape == (len(seq) - sf,)
        for t, e in zip(range(sf, len(seq)), ent.tolist(), strict=True):
            assert 0 <= e < forest.num_entries
            node = _entry_owner(forest, e)
            k = e - node.entry_offset
            assert int(node.entry_target[k]) == seq[t]
            # The entry is predicted from the hidden state at position t - 1 of this sequence.
            assert node.index in forest.paths[s]
            assert node.start + int(node.rows[node.entry_row[k]]) == t - 1
            key = tuple(seq[: t + 1])
            assert key_of_entry.setdefault(e, key) == key, "one entry for two different prefixes"
            assert entry_of_key.setdefault(key, e) == e, "one prefix spread over two entries"
    # Every entry is scored by some sequence: entries <-> distinct scored prefixes is a bijection.
    assert forest.num_entries == len(entry_of_key) == len(key_of_entry)

    # gather and scatter_add are adjoint.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(forest.num_entries, generator=g, dtype=torch.float64)
    y = [
        torch.randn(len(s) - f, generator=g, dtype=torch.float64)
        for s, f in zip(seqs, score_from, strict=True)
    ]
    gx = forest.gather(x)
    assert [t.shape for t in gx] == [t.shape for t in y]
    lhs = sum(float((a * b).sum()) for a, b in zip(gx, y, strict=True))
    rhs = float((x * forest.scatter_add(y)).sum())
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)
    # And gather is plain indexing by the per-sequence entries.
    for s in range(len(seqs)):
        assert torch.equal(gx[s], x[forest.seq_entries[s]])


# ---------------------------------------------------------------------------------------------- structure
def _rand(g, n, vocab=VOCAB):
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_grpo_group_is_one_root_with_one_child_per_completion():
    g = torch.Generator().manual_seed(0)
    P, G = 13, 6
    prompt = _rand(g, P)
    comps = [[10 + i] + _rand(g, i + 1) for i in range(G)]  # distinct first tokens
    seqs = [prompt + c for c in comps]
    forest = PrefixForest.build(seqs, [P] * G)
    check_structure(forest, seqs, [P] * G)
    check_mapping(forest, seqs, [P] * G)
    assert len(forest.nodes) == 1 + G
    assert forest.roots == [0]
    root = forest.nodes[0]
    assert root.tokens.tolist() == prompt and root.owners == []
    assert root.children == list(range(1, G + 1))
    assert [forest.nodes[c].tokens.tolist() for c in root.children] == comps
    assert all(forest.nodes[c].owners == [i] for i, c in enumerate(root.children))
    lens = [len(c) for c in comps]
    assert forest.unique_tokens == P + sum(lens)
    assert forest.dense_tokens == G * P + sum(lens)
    assert forest.compression == pytest.approx((G * P + sum(lens)) / (P + sum(lens)))
    assert forest.depth() == 2
    # The root predicts each child's first token from its last row; nothing inside it is scored.
    assert root.rows.tolist() == [P - 1]
    assert root.entry_target.tolist() == [c[0] for c in comps]
    assert forest.num_entries == sum(lens)


def test_identical_sequences_share_one_path_with_several_owners():
    g = torch.Generator().manual_seed(1)
    prompt, comp = _rand(g, 7), _rand(g, 5)
    other = [60] + _rand(g, 3)
    seqs = [prompt + comp, prompt + other, prompt + comp, prompt + comp]
    sf = [7, 7, 9, 7]
    forest = PrefixForest.build(seqs, sf)
    check_structure(forest, seqs, sf)
    check_mapping(forest, seqs, sf)
    leaf = forest.nodes[forest.paths[0][-1]]
    assert leaf.owners == [0, 2, 3]
    assert forest.paths[0] == forest.paths[2] == forest.paths[3]
    assert len(forest.nodes) == 3
    # Shared scored tokens are one entry.
    assert forest.seq_entries[0].tolist() == forest.seq_entries[3].tolist()
    assert forest.seq_entries[2].tolist() == forest.seq_entries[0][2:].tolist()

    only = PrefixForest.build([comp, comp, comp], [1, 2, 5])
    check_structure(only, [comp] * 3, [1, 2, 5])
    check_mapping(only, [comp] * 3, [1, 2, 5])
    assert len(only.nodes) == 1 and only.nodes[0].owners == [0, 1, 2]
    assert only.num_entries == len(comp) - 1


def test_prefix_sequence_ends_at_internal_node():
    g = torch.Generator().manual_seed(2)
    a, b, c = _rand(g, 6), [3] + _rand(g, 4), [4] + _rand(g, 2)
    seqs = [a + b, a, a + c]
    sf = [2, 3, 6]
    forest = PrefixForest.build(seqs, sf)
    check_structure(forest, seqs, sf)
    check_mapping(forest, seqs, sf)
    node = forest.nodes[forest.paths[1][-1]]
    assert node.tokens.tolist() == a
    assert node.owners == [1]
    assert len(node.children) == 2
    # A prefix whose extension is a single branch still splits the span there.
    seqs = [a + b, a]
    forest = PrefixForest.build(seqs, [6, 6])
    check_structure(forest, seqs, [6, 6])
    check_mapping(forest, seqs, [6, 6])
    assert [n.tokens.tolist() for n in forest.nodes] == [a, b]
    assert forest.nodes[0].owners == [1] and forest.nodes[0].children == [1]
    # The sequence that is the prefix scores nothing, but the longer one scores its first token
    # from the shared node's last row.
    assert forest.seq_entries[1].numel() == 0
    assert forest.nodes[0].rows.tolist() == [5]


def test_groups_sharing_a_system_prompt_join_under_one_root():
    g = torch.Generator().manual_seed(3)
    system = _rand(g, 8)
    q1, q2 = [1] + _rand(g, 4), [2] + _rand(g, 3)
    seqs = [system + q1 + [7] + _rand(g, 3), system + q1 + [9] + _rand(g, 2)]
    seqs += [system + q2 + [5] + _rand(g, 4), system + q2 + [8], system + q2 + [11] + _rand(g, 6)]
    sf = [len(system) + len(q1)] * 2 + [len(system) + len(q2)] * 3
    forest = PrefixForest.build(seqs, sf)
    check_structure(forest, seqs, sf)
    check_mapping(forest, seqs, sf)
    assert forest.roots == [0]
    root = forest.nodes[0]
    assert root.tokens.tolist() == system
    assert [forest.nodes[c].tokens.tolist() for c in root.children] == [q1, q2]
    assert len(forest.nodes) == 1 + 2 + 2 + 3
    assert forest.depth() == 3
    assert forest.unique_tokens == len(system) + len(q1) + len(q2) + sum(
        len(s) - len(system) - len(q) for s, q in zip(seqs, [q1, q1, q2, q2, q2], strict=True)
    )


def test_no_common_first_token_gives_several_roots():
    seqs = [[5, 1, 2], [3, 1, 2], [5, 1, 4], [9], [3, 1, 2, 6]]
    sf = [1, 2, 3, 1, 2]
    forest = PrefixForest.build(seqs, sf)
    check_structure(forest, seqs, sf)
    check_mapping(forest, seqs, sf)
    assert len(forest.roots) == 3
    assert [forest.nodes[r].tokens.tolist() for r in forest.roots] == [[3, 1, 2], [5, 1], [9]]
    # [3,1,2] and [3,1,2,6] both score position 2: one shared entry.
    assert forest.seq_entries[1].tolist() == forest.seq_entries[4][:1].tolist()


@pytest.mark.parametrize("name", sorted(FORESTS))
def test_fixture_forests(name):
    seqs, sf = FORESTS[name]()
    forest = PrefixForest.build(seqs, sf)
    check_structure(forest, seqs, sf)
    check_mapping(forest, seqs, sf)


def test_preorder_on_a_deep_forest():
    # Built so that the creation order of a level-by-level construction differs from pre-order.
    seqs = [
        [1, 2, 3, 4],
        [1, 2, 3, 5, 6],
        [1, 2, 3, 5, 7],
        [1, 8, 9],
        [1, 8, 10, 11],
        [1, 8, 10, 12],
        [2, 1],
        [2, 3, 4],
        [2, 3, 5],
    ]
    forest = PrefixForest.build(seqs, [1] * len(seqs))
    check_structure(forest, seqs, [1] * len(seqs))
    check_mapping(forest, seqs, [1] * len(seqs))
    got = [(n.tokens.tolist(), n.parent) for n in forest.nodes]
    assert got == [
        ([1], -1),
        ([2, 3], 0),
        ([4], 1),
        ([5], 1),
        ([6], 3),
        ([7], 3),
        ([8], 0),
        ([9], 6),
        ([10], 6),
        ([11], 8),
        ([12], 8),
        ([2], -1),
        ([1], 11),
        ([3], 11),
        ([4], 13),
        ([5], 13),
    ]


def test_input_types_give_identical_forests():
    g = torch.Generator().manual_seed(4)
    base = _rand(g, 9)
    seqs = [base + _rand(g, 4), base + _rand(g, 2), base[:5], base + _rand(g, 4), [7, 7]]
    sf = [9, 3, 5, 8, 1]
    want = PrefixForest.build(seqs, sf)
    check_structure(want, seqs, sf)
    variants = {
        "int64 tensor": [torch.tensor(s, dtype=torch.int64) for s in seqs],
        "int32 tensor": [torch.tensor(s, dtype=torch.int32) for s in seqs],
        "numpy int64": [np.array(s, dtype=np.int64) for s in seqs],
        "numpy int32": [np.array(s, dtype=np.int32) for s in seqs],
        "tuples": [tuple(s) for s in seqs],
        "mixed": [
            torch.tensor(seqs[0]),
            np.array(seqs[1]),
            seqs[2],
            torch.tensor(seqs[3], dtype=torch.int32),
            seqs[4],
        ],
    }
    for name, batch in variants.items():
        got = PrefixForest.build(batch, sf)
        assert _signature(got) == _signature(want), name
    for sf_variant in (torch.tensor(sf), np.array(sf), tuple(sf)):
        assert _signature(PrefixForest.build(seqs, sf_variant)) == _signature(want)
    # The forest does not alias the caller's tensors.
    t = [torch.tensor(s) for s in seqs]
    forest = PrefixForest.build(t, sf)
    t[0].fill_(0)
    assert _signature(forest) == _signature(want)


def test_scatter_add_checks_shapes():
    forest = PrefixForest.build([[1, 2, 3], [1, 2, 4]], [1, 2])
    with pytest.raises(ValueError, match="one tensor per sequence"):
        forest.scatter_add([torch.zeros(2)])
    with pytest.raises(ValueError, match=r"sequence 1: expected \(1,\) values"):
        forest.scatter_add([torch.zeros(2), torch.zeros(2)])
    out = forest.scatter_add([torch.tensor([1.0, 2.0]), torch.tensor([4.0])])
    # Entry of token 2 (shared prefix [1, 2]) is scored only by sequence 0.
    assert sorted(out.tolist()) == [1.0, 2.0, 4.0]


# ---------------------------------------------------------------------------------------------- bad input
BAD_INPUTS = [
    pytest.param([], [], r"at least one sequence.*empty batch", id="empty-batch"),
    pytest.param([[1, 2], [3, 4], [], [5, 6]], [1, 1, 1, 1], r"sequence 2 is empty", id="empty-seq-list"),
    pytest.param(
        [[1, 2], [3, 4], torch.zeros(0, dtype=torch.long)],
        [1, 1, 1],
        r"sequence 2 is empty",
        id="empty-seq-tensor",
    ),
    pytest.param(
        [[1, 2], [3, 4], np.zeros(0, dtype=np.int64)], [1, 1, 1], r"sequence 2 is empty", id="empty-seq-numpy"
    ),
    pytest.param(
        [[1, 2, 3], [4, 5, 6]],
        [1, 0],
        r"score_from\[1\] = 0 is out of range for sequence 1 of length 3.*1 <= score_from <= length",
        id="score-from-zero",
    ),
    pytest.param(
        [[1, 2, 3, 4, 5], [4, 5, 6]],
        [6, 1],
        r"score_from\[0\] = 6 is out of range for sequence 0 of length 5",
        id="score-from-past-end",
    ),
    pytest.param(
        [[1, 2, 3], [4, 5, 6]], [1, -1], r"score_from\[1\] = -1 is out of range", id="score-from-neg"
    ),
    pytest.param(
        [[1, 2], [3, 4], [5, 6]],
        [1, 1],
        r"score_from has 2 entries but there are 3 sequences",
        id="score-from-too-short",
    ),
    pytest.param(
        [[1, 2], [3, 4]],
        [1, 1, 1],
        r"score_from has 3 entries but there are 2 sequences",
        id="score-from-too-long",
    ),
    pytest.param(
        [[1, 2, 3], [4, 5, 6]], [1, 2.5], r"score_from\[1\] must be an integer, got 2\.5", id="sf-float"
    ),
    pytest.param(
        [[1, 2, 3], [4, 5, 6]], [1, 2.0], r"score_from\[1\] must be an integer, got 2\.0", id="sf-2.0"
    ),
    pytest.param(
        [[1, 2, 3], [4, 5, 6]], [True, 1], r"score_from\[0\] must be an integer, got True", id="sf-bool"
    ),
    pytest.param([[1, 2, 3], [4, 5, 6]], ["1", 1], r"score_from\[0\] must be an integer", id="sf-str"),
    pytest.param(
        [[1, 2, 3], [4, 5, 6]],
        torch.tensor([1.0, 2.0]),
        r"score_from\[0\] must be an integer",
        id="sf-float-tensor",
    ),
    pytest.param(
        [[1, 2, 3], [4, -3, 6]], [1, 1], r"sequence 1: token ids must be >= 0, found -3", id="neg-token"
    ),
    pytest.param(
        [[1, 2], torch.tensor([4, 5, -7], dtype=torch.int32)],
        [1, 1],
        r"sequence 1: token ids must be >= 0, found -7",
        id="neg-token-tensor",
    ),
    pytest.param(
        [torch.tensor([1.0, 2.0, 3.0])],
        [1],
        r"sequence 0: tokens must be integers, got dtype torch\.float32",
        id="float-tensor",
    ),
    pytest.param(
        [[1, 2], torch.tensor([True, False])],
        [1, 1],
        r"sequence 1: tokens must be integers, got dtype torch\.bool",
        id="bool-tensor",
    ),
    pytest.param([[1, 2], [1.0, 2.5, 3.0]], [1, 1], r"sequence 1: tokens must be integers", id="float-list"),
    pytest.param(
        [[1, 2], [1.0, 2.0, 3.0]], [1, 1], r"sequence 1: tokens must be integers", id="integral-floats"
    ),
    pytest.param(
        [[1, 2], np.array([1.0, 2.0])], [1, 1], r"sequence 1: tokens must be integers", id="float-numpy"
    ),
    pytest.param([[1, 2], [True, False]], [1, 1], r"sequence 1: tokens must be integers", id="bool-list"),
    pytest.param(
        [torch.zeros(2, 3, dtype=torch.long)],
        [1],
        r"sequence 0: expected a 1-D token tensor, got shape \(2, 3\)",
        id="2d-tensor",
    ),
    pytest.param(
        [[1, 2], torch.tensor(3)],
        [1, 1],
        r"sequence 1: expected a 1-D token tensor, got shape \(\)",
        id="0d-tensor",
    ),
    pytest.param([[1, 2], [[1, 2], [3, 4]]], [1, 1], r"sequence 1: expected a flat list", id="nested-list"),
]


@pytest.mark.parametrize("seqs,score_from,match", BAD_INPUTS)
def test_bad_input_raises_value_error(seqs, score_from, match):
    with pytest.raises(ValueError, match=match):
        PrefixForest.build(seqs, score_from)


def test_boundary_score_from_is_accepted():
    # score_from == len scores nothing but still shares; numpy integers count as integers.
    seqs = [[4], [4, 5], [4, 5, 6]]
    sf = [np.int64(1), 2, np.int32(1)]
    forest = PrefixForest.build(seqs, sf)
    check_structure(forest, seqs, [1, 2, 1])
    check_mapping(forest, seqs, [1, 2, 1])
    assert [e.numel() for e in forest.seq_entries] == [0, 0, 2]
    assert forest.num_entries == 2


# ---------------------------------------------------------------------------------------------- properties
@st.composite
def random_batches(draw, max_sequences=24, max_stems=3, max_depth=3, max_branches=3, max_seg=4, vocab=None):
    """Stems extended by random branches; duplicates and prefixes; random score_from per sequence."""
    if vocab is None:
        vocab = draw(st.integers(1, 6) | st.just(VOCAB))
    tok = st.integers(0, vocab - 1)
    seqs: list[list[int]] = []

    def grow(prefix, depth):
        n_branches = 0 if depth >= max_depth else draw(st.integers(0, max_branches))
        if n_branches == 0 or draw(st.integers(0, 3)) == 0:  # a leaf, or a prefix of its extensions
            seqs.append(prefix)
        for _ in range(n_branches):
            grow(prefix + draw(st.lists(tok, min_size=1, max_size=max_seg)), depth + 1)

    for _ in range(draw(st.integers(1, max_stems))):
        grow(draw(st.lists(tok, min_size=1, max_size=2 * max_seg)), 0)
    dups = draw(st.lists(st.integers(0, len(seqs) - 1), max_size=3))
    seqs += [list(seqs[i]) for i in dups]
    seqs = draw(st.permutations(seqs))[:max_sequences]
    score_from = [draw(st.integers(1, len(s))) for s in seqs]
    return seqs, score_from


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_batches(), st.integers(0, 2**31 - 1), st.sampled_from(["list", "int32", "int64", "numpy"]))
def test_random_forests_structure_and_mapping(batch, seed, kind):
    seqs, score_from = batch
    convert = {
        "list": list,
        "int32": lambda s: torch.tensor(s, dtype=torch.int32),
        "int64": lambda s: torch.tensor(s, dtype=torch.int64),
        "numpy": np.array,
    }[kind]
    forest = PrefixForest.build([convert(s) for s in seqs], score_from)
    check_structure(forest, seqs, score_from)
    check_mapping(forest, seqs, score_from, seed=seed)


_MODEL: dict[str, torch.nn.Module] = {}


def _llama():
    # Built once per module: hypothesis does not allow function-scoped fixtures.
    if "llama-gqa" not in _MODEL:
        _MODEL["llama-gqa"] = make_model("llama-gqa")
    return _MODEL["llama-gqa"]


def _reference(model, seqs, score_from, c_lp, c_ent):
    model.zero_grad(set_to_none=True)
    lps, ents = dense_logprobs(model, seqs, score_from, entropy=True)
    total = sum((lp * c).sum() + (e * d).sum() for lp, e, c, d in zip(lps, ents, c_lp, c_ent, strict=True))
    total.backward()
    return [t.detach() for t in lps], [t.detach() for t in ents], grads(model)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    random_batches(max_sequences=8, max_stems=2, max_branches=2, max_seg=4),
    st.integers(1, 9),
    st.integers(0, 2**31 - 1),
)
def test_executor_matches_dense_on_random_forests(batch, block_size, seed):
    seqs, score_from = batch
    model = _llama()
    forest = PrefixForest.build(seqs, score_from)
    g = torch.Generator().manual_seed(seed)
    c_lp = [
        torch.randn(len(s) - f, generator=g, dtype=torch.float64)
        for s, f in zip(seqs, score_from, strict=True)
    ]
    c_ent = [
        torch.randn(len(s) - f, generator=g, dtype=torch.float64)
        for s, f in zip(seqs, score_from, strict=True)
    ]
    with Float64Mode():
        lp_d, ent_d, g_d = _reference(model, seqs, score_from, c_lp, c_ent)
        for mode, block in (("keep", None), ("replay", block_size), ("packed", None)):
            ex = TreeExecutor(model, mode=mode, block_size=block)
            model.zero_grad(set_to_none=True)
            res = ex.backward(forest, c_lp, c_ent)
            g_t = grads(model)
            assert max_rel_err(res.logprobs, lp_d) < TOL, mode
            assert max_rel_err(res.entropies, ent_d) < TOL, mode
            assert max_rel_err(g_t, g_d) < TOL, mode
            if mode == "replay":
                scored = ex.score(forest, entropy=True)
                assert max_rel_err(scored.logprobs, lp_d) < TOL
                assert max_rel_err(scored.entropies, ent_d) < TOL


# ---------------------------------------------------------------------------------------------- timing
def _groups(n: int, g: torch.Generator, P: int = 2048, C: int = 2048, G: int = 16) -> list[torch.Tensor]:
    seqs = []
    for i in range(n):
        prompt = torch.randint(0, 32000, (P,), generator=g)
        prompt[0] = i  # distinct prompts and distinct completions, whatever the random draw
        for j in range(G):
            comp = torch.randint(0, 32000, (C,), generator=g)
            comp[0] = j
            seqs.append(torch.cat([prompt, comp]))
    return seqs


def _best_of(k: int, fn) -> float:
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@pytest.mark.timing
def test_build_512_long_sequences_is_fast():
    """Building is linear in the tokens, measured as ratios side by side (no absolute time): 512
    sequences of 4096 tokens take at most a few times what reading their tokens into Python takes,
    and four times the groups at most about four times the time (a quadratic build would take 16)."""
    g = torch.Generator().manual_seed(0)
    P, C, G, N = 2048, 2048, 16, 32
    seqs = _groups(N, g, P, C, G)
    quarter = seqs[: len(seqs) // 4]
    read = _best_of(3, lambda: [s.tolist() for s in seqs])
    build = _best_of(3, lambda: PrefixForest.build(seqs, [P] * len(seqs)))
    build_quarter = _best_of(3, lambda: PrefixForest.build(quarter, [P] * len(quarter)))
    assert build < 10 * read, f"building 512 x 4096 tokens took {build / read:.1f}x reading them"
    assert build < 8.0 * build_quarter, f"four times the groups took {build / build_quarter:.1f}x the time"
    forest = PrefixForest.build(seqs, [P] * len(seqs))
    assert len(forest.roots) == N
    assert len(forest.nodes) == N * (1 + G)
    assert forest.unique_tokens == N * P + N * G * C
    assert forest.num_entries == N * G * C
