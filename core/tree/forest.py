"""Prefix forests: a batch of token sequences stored as a compressed trie.

Sequences that share a prefix share the nodes that hold it, so a GRPO group (one prompt, G
completions) becomes a two-level tree, multi-turn trajectories become deeper trees, and groups
sharing a system prompt join under one root. Each shared token is stored, and later computed, once.

A scored token at position ``t`` of a sequence contributes ``log p(x_t | x_<t)``. It is predicted
from the hidden state at ``t - 1``, which may live in the parent node when ``t`` is the first
token of a node; the forest records every such prediction as an *entry* ``(node, row, target)``,
so the executor forms logits only at the rows that some sequence scores.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cmp_to_key

import numpy as np
import torch

__all__ = ["PrefixForest", "TreeNode"]


@dataclass(eq=False)
class TreeNode:
    """One maximal shared span of tokens.

    Attributes:
        index: position of the node in ``PrefixForest.nodes`` (parents come before children).
        tokens: ``[length]`` int64 token ids of the span.
        start: absolute position of the span's first token in every sequence that passes through it.
        parent: index of the parent node, or -1 for a root.
        children: indices of the child nodes, sorted by their first token.
        owners: sequences whose last token is the last token of this node.
        rows: ``[num_rows]`` sorted offsets (into ``tokens``) whose hidden state some entry reads.
        entry_row: ``[num_entries]`` index into ``rows`` for each entry of the node.
        entry_target: ``[num_entries]`` token each entry scores.
        entry_offset: global index of the node's first entry (entries of a node are contiguous).
        first_scored: smallest ``score_from`` among the sequences through the node: the node is
            pure context (a prompt) when ``end <= first_scored``.
    """

    index: int
    tokens: torch.Tensor
    start: int
    parent: int
    children: list[int] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    rows: torch.Tensor | None = None
    entry_row: torch.Tensor | None = None
    entry_target: torch.Tensor | None = None
    entry_offset: int = 0
    first_scored: int = 0

    @property
    def end(self) -> int:
        """Absolute position one past the span's last token."""
        return self.start + len(self.tokens)

    @property
    def num_entries(self) -> int:
        return 0 if self.entry_target is None else len(self.entry_target)


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The int64 ``arrays`` on ``device`` as views of one buffer, moved with one copy: pinned and
    non-blocking on CUDA (a copy from pageable memory would wait for the device to drain), none on
    the CPU. Issues no tensor op but the copy."""
    if not arrays:
        return []
    flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays])
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        moved = host.pin_memory().to(device, non_blocking=True)
    elif device.type == "cpu":
        moved = host
    else:
        moved = host.to(device)
    sizes = [int(np.size(a)) for a in arrays]
    return [part.view(np.shape(a)) for part, a in zip(moved.split(sizes), arrays, strict=True)]


def _as_token_array(seq: Sequence[int] | torch.Tensor | np.ndarray, i: int) -> np.ndarray:
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1:
            raise ValueError(f"sequence {i}: expected a 1-D token tensor, got shape {tuple(seq.shape)}")
        if seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
            raise ValueError(f"sequence {i}: tokens must be integers, got dtype {seq.dtype}")
        arr = seq.detach().cpu().numpy().astype(np.int64, copy=False)
    else:
        arr = np.asarray(seq)
        if arr.ndim != 1:
            raise ValueError(f"sequence {i}: expected a flat list of token ids, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"sequence {i}: tokens must be integers, got {arr.dtype} values")
        arr = arr.astype(np.int64, copy=False)
    if arr.size == 0:
        raise ValueError(
            f"sequence {i} is empty: every sequence needs at least one context token and one scored token"
        )
    if (arr < 0).any():
        bad = int(arr[arr < 0][0])
        raise ValueError(f"sequence {i}: token ids must be >= 0, found {bad}")
    return arr


def _runs(lcp: list[int], a: int, b: int, depth: int) -> list[tuple[int, int]]:
    """Maximal runs ``[i, j)`` of the sorted range ``[a, b)`` that share more than ``depth`` tokens."""
    runs = []
    i = a
    while i < b:
        j = i + 1
        while j < b and lcp[j] > depth:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _compare(a: np.ndarray, b: np.ndarray) -> int:
    """-1, 0 or 1 as ``a`` sorts before, with or after ``b`` lexicographically (a prefix first)."""
    k = _common_prefix(a, b)
    if k == min(len(a), len(b)):
        return (len(a) > len(b)) - (len(a) < len(b))
    return -1 if a[k] < b[k] else 1


class PrefixForest:
    """A batch of sequences as a compressed trie, with the maps between sequences and node tokens.

    Build with :meth:`build`. ``nodes`` are in depth-first pre-order (a parent before its
    children, a subtree contiguous), so walking them in order is a valid depth-first schedule.

    Attributes:
        nodes: the trie nodes.
        roots: indices of the root nodes.
        lengths: ``[num_sequences]`` sequence lengths.
        score_from: ``[num_sequences]`` index of each sequence's first scored token.
        paths: for each sequence, the node indices from its root to its last node.
        seq_entries: for each sequence, ``[len - score_from]`` int64 global entry index of each
            scored token, in order. Several sequences may point to one entry (shared tokens).
        num_entries: number of distinct scored (prediction, target) pairs.
    """

    def __init__(self) -> None:
        self.nodes: list[TreeNode] = []
        self.roots: list[int] = []
        self.lengths: list[int] = []
        self.score_from: list[int] = []
        self.paths: list[list[int]] = []
        self.seq_entries: list[torch.Tensor] = []
        self.num_entries: int = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        sequences: Sequence[Sequence[int] | torch.Tensor],
        score_from: Sequence[int] | torch.Tensor,
    ) -> PrefixForest:
        """Build the forest of ``sequences``.

        Args:
            sequences: token sequences, each a list of ints or a 1-D integer tensor.
            score_from: ``[num_sequences]``; ``score_from[i]`` is the index of sequence i's first
                scored token, ``1 <= score_from[i] <= len(sequences[i])`` (equal to the length
                means the sequence scores nothing but still shares its prefix).

        Returns:
            The forest.

        Raises:
            ValueError: on an empty batch or sequence, a non-integer or negative token, or a
                ``score_from`` out of range; the message names the sequence index.
        """
        if isinstance(sequences, (str, bytes, torch.Tensor)) or not isinstance(sequences, Sequence):
            raise TypeError(
                f"sequences must be a list of token sequences (lists of ints or 1-D tensors), got "
                f"{type(sequences).__name__}"
            )
        if len(sequences) == 0:
            raise ValueError("PrefixForest.build needs at least one sequence, got an empty batch")
        if score_from is None or isinstance(score_from, (str, bytes, float)):
            raise TypeError(
                f"score_from must give one completion start per sequence (a list of ints or a 1-D integer tensor), "
                f"got {type(score_from).__name__}"
            )
        if isinstance(score_from, torch.Tensor):
            score_from = score_from.reshape(-1).tolist() if score_from.dim() else [score_from.item()]
        if isinstance(score_from, (int, np.integer)):
            raise ValueError(
                f"score_from must give one completion start per sequence ({len(sequences)} values), got the "
                f"single value {score_from}"
            )
        score_from = list(score_from)
        if len(score_from) != len(sequences):
            raise ValueError(
                f"score_from has {len(score_from)} entries but there are {len(sequences)} sequences: give one "
                "completion start per sequence"
            )
        arrays = [_as_token_array(s, i) for i, s in enumerate(sequences)]
        lengths = [len(a) for a in arrays]
        for i, (sf, n) in enumerate(zip(score_from, lengths, strict=True)):
            if isinstance(sf, bool) or not isinstance(sf, (int, np.integer)):
                raise ValueError(f"score_from[{i}] must be an integer, got {sf!r}")
            if not 1 <= sf <= n:
                raise ValueError(
                    f"score_from[{i}] = {sf} is out of range for sequence {i} of length {n}: it must satisfy "
                    f"1 <= score_from <= length (token 0 has no context to be predicted from)"
                )

        forest = cls()
        forest.lengths = lengths
        forest.score_from = [int(s) for s in score_from]
        # Lexicographic order, compared in numpy (a key of Python ints would cost ~36 bytes a token).
        order = sorted(range(len(arrays)), key=cmp_to_key(lambda i, j: _compare(arrays[i], arrays[j])))
        # lcp[k] = common prefix length of sorted neighbours k-1 and k.
        lcp = [0] + [_common_prefix(arrays[order[k - 1]], arrays[order[k]]) for k in range(1, len(order))]
        forest._build_nodes(arrays, order, lcp)
        forest._build_entries(arrays)
        return forest

    def _build_nodes(self, arrays: list[np.ndarray], order: list[int], lcp: list[int]) -> None:
        # Explicit stack: (parent node, sorted range [a, b), depth already covered by ancestors).
        # Ranges are pushed in reverse so nodes come out in depth-first pre-order.
        stack: list[tuple[int, int, int, int]] = [(-1, 0, len(order), 0)]
        while stack:
            parent, a, b, depth = stack.pop()
            pending = [
                self._add_node(arrays, order, lcp, parent, i, j, depth) for i, j in _runs(lcp, a, b, depth)
            ]
            # Visit children of this level depth-first, first run first.
            stack.extend(reversed([p for p in pending if p is not None]))
        self._reorder_preorder()
        self.paths = [[] for _ in arrays]
        for node in self.nodes:
            for s in node.owners:
                self.paths[s] = self._path_to(node.index)

    def _add_node(self, arrays, order, lcp, parent: int, i: int, j: int, depth: int):
        """The node of sorted run ``[i, j)`` below ``parent``; returns its children's range, if any."""
        end = min(lcp[i + 1 : j]) if j - i > 1 else len(arrays[order[i]])
        node = TreeNode(
            index=len(self.nodes),
            tokens=torch.from_numpy(arrays[order[i]][depth:end].copy()),
            start=depth,
            parent=parent,
        )
        self.nodes.append(node)
        (self.roots if parent < 0 else self.nodes[parent].children).append(node.index)
        k = i
        # Sorted order puts sequences that end here (prefixes of the others) first.
        while k < j and len(arrays[order[k]]) == end:
            node.owners.append(order[k])
            k += 1
        return (node.index, k, j, end) if k < j else None

    def _path_to(self, n: int) -> list[int]:
        path = []
        while n >= 0:
            path.append(n)
            n = self.nodes[n].parent
        return path[::-1]

    def _reorder_preorder(self) -> None:
        # The stack visits a node's siblings before its children's subtrees are finished, so the
        # creation order is not pre-order; renumber so that every subtree is contiguous.
        new_order: list[int] = []
        walk = list(reversed(self.roots))
        while walk:
            n = walk.pop()
            new_order.append(n)
            walk.extend(reversed(self.nodes[n].children))
        remap = {old: new for new, old in enumerate(new_order)}
        nodes = [self.nodes[old] for old in new_order]
        for node in nodes:
            node.index = remap[node.index]
            node.parent = remap[node.parent] if node.parent >= 0 else -1
            node.children = [remap[c] for c in node.children]
        self.nodes = nodes
        self.roots = [remap[r] for r in self.roots]

    def _build_entries(self, arrays: list[np.ndarray]) -> None:
        min_score = self._min_scores()
        offset = 0
        for node in self.nodes:
            offset = self._node_entries(node, min_score, offset)
        self.num_entries = offset
        child_slot = self._child_slots(min_score)
        first_in = {node.index: max(1, min_score[node.index] - node.start) for node in self.nodes}
        self.seq_entries = [
            self._sequence_entries(s, path, child_slot, first_in) for s, path in enumerate(self.paths)
        ]

    def _min_scores(self) -> list[int]:
        """Per node, the earliest ``score_from`` among the sequences through it: it decides which of
        the node's tokens anyone scores."""
        min_score = [np.iinfo(np.int64).max] * len(self.nodes)
        for node in reversed(self.nodes):  # children before parents
            m = min((self.score_from[s] for s in node.owners), default=min_score[node.index])
            m = min([m, *(min_score[c] for c in node.children)])
            min_score[node.index] = m
            node.first_scored = int(m)
        return min_score

    def _scored_children(self, node: TreeNode, min_score: list[int]) -> list[int]:
        """Children whose first token someone scores (it is predicted from this node's last row)."""
        return [c for c in node.children if min_score[c] <= self.nodes[c].start]

    def _node_entries(self, node: TreeNode, min_score: list[int], offset: int) -> int:
        """Set the node's rows and entries (in-node targets by offset, then scored children's first
        tokens in child order); returns the next global entry offset."""
        length = len(node.tokens)
        # Tokens inside the node: the target at offset o is predicted from row o - 1.
        first = min(max(1, min_score[node.index] - node.start), length)
        n_in = length - first
        scored_children = self._scored_children(node, min_score)
        rows = torch.arange(first - 1, length - 1)
        if scored_children:
            rows = torch.cat([rows, torch.tensor([length - 1])])
        node.rows = rows
        node.entry_row = torch.cat(
            [torch.arange(n_in), torch.full((len(scored_children),), len(rows) - 1, dtype=torch.long)]
        )
        targets = [node.tokens[first:]]
        if scored_children:
            targets.append(torch.stack([self.nodes[c].tokens[0] for c in scored_children]))
        node.entry_target = torch.cat(targets)
        node.entry_offset = offset
        return offset + len(node.entry_target)

    def _child_slots(self, min_score: list[int]) -> dict[int, int]:
        """Global entry of each scored child's first token (stored in its parent's entries)."""
        child_slot: dict[int, int] = {}
        for node in self.nodes:
            scored = self._scored_children(node, min_score)
            n_in = len(node.entry_target) - len(scored)
            for k, c in enumerate(scored):
                child_slot[c] = node.entry_offset + n_in + k
        return child_slot

    def _sequence_entries(
        self, s: int, path: list[int], child_slot: dict[int, int], first_in: dict
    ) -> torch.Tensor:
        """``[len - score_from]`` global entry of each scored token of sequence ``s``."""
        idx: list[np.ndarray] = []
        sf = self.score_from[s]
        for n in path:
            node = self.nodes[n]
            lo, hi = max(sf, node.start), node.end
            if lo >= hi:
                continue
            if lo == node.start:
                idx.append(np.array([child_slot[n]], dtype=np.int64))
                lo += 1
            if lo < hi:
                # In-node entries start at offset first_in[n]; position p sits at entry p - start - first_in.
                base = node.entry_offset - node.start - first_in[n]
                idx.append(np.arange(lo + base, hi + base, dtype=np.int64))
        return torch.from_numpy(np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64))

    # ------------------------------------------------------------------ statistics
    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def unique_tokens(self) -> int:
        """Tokens stored in the forest: each shared token counted once."""
        return sum(len(n.tokens) for n in self.nodes)

    @property
    def dense_tokens(self) -> int:
        """Tokens in the batch as independent sequences."""
        return sum(self.lengths)

    @property
    def compression(self) -> float:
        """``dense_tokens / unique_tokens`` (>= 1): how many times fewer tokens the forest computes."""
        return self.dense_tokens / self.unique_tokens

    @property
    def scored_tokens(self) -> int:
        """Scored tokens over all sequences, counting shared ones once per sequence."""
        return sum(n - s for n, s in zip(self.lengths, self.score_from, strict=True))

    @property
    def max_token(self) -> int:
        """The largest token id in the forest (read on the host, once)."""
        if "_max_token" not in self.__dict__:
            tops = [int(n.tokens.numpy().max()) for n in self.nodes if len(n.tokens)]
            self._max_token = max(tops, default=-1)
        return self._max_token

    def entry_index(self, device: torch.device | str) -> torch.Tensor:
        """``[sum of len_i - score_from_i]`` every sequence's entry indices end to end, on ``device``
        (moved once per forest and device: :meth:`gather` and :meth:`scatter_add` index with it)."""
        device = torch.device(device)
        cache = self.__dict__.setdefault("_entry_index", {})
        if device not in cache:
            flat = np.concatenate([i.numpy() for i in self.seq_entries]) if self.seq_entries else np.zeros(0)
            cache[device] = to_device([flat], device)[0]
        return cache[device]

    def depth(self) -> int:
        """Number of nodes on the longest root-to-leaf path."""
        return max(len(p) for p in self.paths)

    # ------------------------------------------------------------------ mapping
    def sequence_tokens(self, s: int) -> torch.Tensor:
        """``[len]`` token ids of sequence ``s``, read back from the nodes."""
        return torch.cat([self.nodes[n].tokens for n in self.paths[s]])

    def gather(self, entry_values: torch.Tensor) -> list[torch.Tensor]:
        """Per-entry values to per-sequence tensors.

        Args:
            entry_values: ``[num_entries, ...]``.

        Returns:
            One ``[len_i - score_from_i, ...]`` tensor per sequence.
        """
        flat = entry_values.index_select(0, self.entry_index(entry_values.device))
        return list(flat.split([len(idx) for idx in self.seq_entries]))

    def scatter_add(self, per_sequence: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-sequence values to per-entry sums (the adjoint of :meth:`gather`).

        Args:
            per_sequence: one ``[len_i - score_from_i]`` tensor per sequence.

        Returns:
            ``[num_entries]``: for each entry, the sum over the sequences that score it, in the
            promoted dtype of the inputs (detached: the sums are coefficients, not a graph).

        Raises:
            ValueError: on a count or shape mismatch, or a non-floating tensor.
        """
        if len(per_sequence) != self.num_sequences:
            raise ValueError(
                f"expected one tensor per sequence ({self.num_sequences}), got {len(per_sequence)}"
            )
        tensors = [torch.as_tensor(t) for t in per_sequence]
        for s, t in enumerate(tensors):
            if not t.is_floating_point():
                raise ValueError(
                    f"sequence {s}: values of dtype {t.dtype}; per-token values must be real floating point "
                    "(an integer tensor would truncate every other sequence's values to integers)"
                )
        # Promote over all of them, so one lower-precision tensor cannot round the others.
        dtype = functools.reduce(torch.promote_types, {t.dtype for t in tensors}, tensors[0].dtype)
        device = tensors[0].device
        for s, (vals, idx) in enumerate(zip(tensors, self.seq_entries, strict=True)):
            if vals.shape != idx.shape:
                raise ValueError(
                    f"sequence {s}: expected {tuple(idx.shape)} values (len - score_from = "
                    f"{self.lengths[s]} - {self.score_from[s]}), got shape {tuple(vals.shape)}"
                )
        values = torch.cat([t.detach().to(dtype=dtype, device=device) for t in tensors])
        out = torch.zeros(self.num_entries, dtype=dtype, device=device)
        return out.index_add_(0, self.entry_index(device), values)

    def __repr__(self) -> str:
        return (
            f"PrefixForest(sequences={self.num_sequences}, nodes={len(self.nodes)}, "
            f"unique_tokens={self.unique_tokens}, dense_tokens={self.dense_tokens}, "
            f"compression={self.compression:.2f})"
        )
