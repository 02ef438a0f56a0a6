"""A user's training workload as shapes: their prompts (and optionally logged rollouts) grouped
into optimizer steps, priced as the stock path and as a forest.

Reading: a JSONL, JSON, Parquet or CSV file, a dataset saved with ``datasets.save_to_disk``, or a
Hugging Face dataset name. A row gives its prompt as token ids (``prompt_ids``/``input_ids``), as
text, or as chat messages (rendered with the tokenizer's chat template, as TRL, veRL and
OpenRLHF's ``--apply_chat_template`` do). A rollouts file has a prompt and a ``completion`` (text or
``completion_ids``) per row; rows with the same prompt form a group.

Without rollouts each prompt gets G completions of R distinct tokens: they share the prompt and
nothing else, the least a real group shares (real completions often open alike).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..balance.cost import PieceStats
from ..balance.plan import forest_stats, trees_of_forest
from ..tree import PrefixForest

__all__ = ["Step", "Workload", "dense_stats", "load_rows", "read_workload"]

#: Where a prompt is looked for in a row, by host (their dataset conventions), then the others.
PROMPT_KEYS = {"trl": ("prompt",), "verl": ("prompt",), "openrlhf": ("input", "prompt")}
ID_KEYS = ("prompt_ids", "input_ids")
COMPLETION_KEYS = ("completion_ids", "completion", "response", "output")


@dataclass
class Step:
    """One optimizer step's sequences (prompt + completion tokens) and where each completion starts."""

    sequences: list[list[int]]
    score_from: list[int]
    forest: PrefixForest = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.forest = PrefixForest.build(self.sequences, self.score_from)


@dataclass
class Workload:
    """The steps of one pass over the user's prompts, and what they were read from."""

    steps: list[Step]
    prompts: int
    group_size: int
    logged: bool

    def prompt_lengths(self) -> list[int]:
        return [sf for step in self.steps for sf in step.score_from]

    def completion_lengths(self) -> list[int]:
        return [
            len(s) - sf for step in self.steps for s, sf in zip(step.sequences, step.score_from, strict=True)
        ]

    def compression(self) -> float:
        """Tokens of the batch as independent sequences over the forest's unique tokens."""
        dense = sum(step.forest.dense_tokens for step in self.steps)
        return dense / sum(step.forest.unique_tokens for step in self.steps)

    def longest_path(self) -> int:
        return max(max(step.forest.lengths) for step in self.steps)


# ---------------------------------------------------------------------------- reading


def load_rows(source: str, split: str = "train") -> list[dict[str, Any]]:
    """The rows of a JSONL/JSON/Parquet/CSV file, a saved dataset folder, or a hub dataset name.

    Raises:
        ValueError: a file that does not exist or has no rows, or a format it cannot read.
    """
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet", ".csv") and not path.is_file():
        raise ValueError(f"--dataset {source}: no such file")
    if suffix == ".jsonl":
        with path.open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
    elif suffix == ".json":
        data = json.loads(path.read_text())
        rows = data if isinstance(data, list) else data.get("data", data.get("rows", []))
    elif suffix in (".parquet", ".csv") or path.is_dir() or not path.exists():
        rows = _datasets_rows(source, suffix, split)
    else:
        raise ValueError(
            f"--dataset {source}: give a .jsonl, .json, .parquet or .csv file, a saved dataset folder or a hub name"
        )
    if not rows:
        raise ValueError(f"--dataset {source}: no rows")
    return rows


def _datasets_rows(source: str, suffix: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"--dataset {source}: reading this format needs the `datasets` library (pip install datasets), "
            "or give a .jsonl file"
        ) from err
    if suffix in (".parquet", ".csv"):
        ds = datasets.load_dataset(suffix[1:], data_files=source, split="train")
    elif Path(source).is_dir():
        ds = datasets.load_from_disk(source)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(source, split=split)
    return list(ds)


def _prompt_ids(row: dict[str, Any], keys: Sequence[str], tokenizer, where: str) -> list[int]:
    for key in ID_KEYS:
        if row.get(key) is not None:
            return [int(t) for t in row[key]]
    for key in keys:
        if row.get(key) is not None:
            return _tokens(row[key], tokenizer, f"{where}: {key!r}", prompt=True)
    raise ValueError(
        f"{where}: no prompt: expected one of the columns {', '.join((*ID_KEYS, *keys))} (this row has "
        f"{', '.join(sorted(row)) or 'none'}); name the column with --prompt-key"
    )


def _tokens(value: Any, tokenizer, where: str, prompt: bool) -> list[int]:
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return value
    if tokenizer is None:
        raise ValueError(
            f"{where} is text: give --tokenizer (or a --model folder with a tokenizer), or token ids"
        )
    if isinstance(value, list):  # chat messages
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{where} is chat messages but the tokenizer has no chat template: give --tokenizer with one"
            )
        # Rendered, then tokenized without special tokens (the template has them), as TRL does.
        text = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=prompt)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(value, str):
        return tokenizer(value, add_special_tokens=prompt)["input_ids"]
    raise ValueError(f"{where} is a {type(value).__name__}: expected text, chat messages or token ids")


def _progress(items: Iterable, total: int, desc: str) -> Iterator:
    """``items`` with a progress bar on stderr when it is a terminal and the work is long."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return iter(items)
    return iter(
        tqdm(items, total=total, desc=desc, disable=total < 200 or not sys.stderr.isatty(), leave=False)
    )


def read_workload(
    rows: Sequence[dict[str, Any]],
    group_size: int,
    completion_length: int,
    prompts_per_step: int,
    tokenizer=None,
    prompt_keys: Sequence[str] = ("prompt",),
    rollouts: Sequence[dict[str, Any]] | None = None,
    vocab_size: int = 32000,
) -> Workload:
    """The user's prompts (or logged rollouts) as optimizer steps of ``prompts_per_step`` groups.

    Raises:
        ValueError: a row without a prompt, text without a tokenizer, a non-positive size.
    """
    for name, value in (
        ("--num-generations", group_size),
        ("--max-completion-length", completion_length),
        ("--prompts-per-step", prompts_per_step),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if rollouts is not None:
        groups = _logged_groups(rollouts, tokenizer, prompt_keys)
    else:
        groups = _synthetic_groups(rows, group_size, completion_length, tokenizer, prompt_keys, vocab_size)
    steps = []
    for first in range(0, len(groups), prompts_per_step):
        seqs, sf = [], []
        for prompt, completions in groups[first : first + prompts_per_step]:
            seqs += [prompt + c for c in completions]
            sf += [len(prompt)] * len(completions)
        steps.append(Step(seqs, sf))
    size = round(sum(len(c) for _, c in groups) / len(groups))
    return Workload(steps, len(groups), size, rollouts is not None)


def _synthetic_groups(rows, group_size, completion_length, tokenizer, prompt_keys, vocab_size):
    groups = []
    for i, row in _progress(enumerate(rows), len(rows), "tokenizing"):
        prompt = _prompt_ids(row, prompt_keys, tokenizer, f"--dataset row {i}")
        if not prompt:
            raise ValueError(f"--dataset row {i}: the prompt is empty")
        # Distinct completions: token k of completion j is unique to (j, k) within the group.
        groups.append(
            (
                prompt,
                [
                    [(j * completion_length + k) % vocab_size for k in range(completion_length)]
                    for j in range(group_size)
                ],
            )
        )
    return groups


def _logged_groups(rollouts, tokenizer, prompt_keys):
    by_prompt: dict[tuple[int, ...], list[list[int]]] = {}
    for i, row in _progress(enumerate(rollouts), len(rollouts), "tokenizing rollouts"):
        prompt = tuple(_prompt_ids(row, prompt_keys, tokenizer, f"--rollouts row {i}"))
        key = next((k for k in COMPLETION_KEYS if row.get(k) is not None), None)
        if key is None:
            raise ValueError(
                f"--rollouts row {i}: no completion: expected one of {', '.join(COMPLETION_KEYS)}"
            )
        completion = _tokens(row[key], tokenizer, f"--rollouts row {i}: {key!r}", prompt=False)
        if not completion:
            raise ValueError(f"--rollouts row {i}: the completion is empty")
        by_prompt.setdefault(prompt, []).append(completion)
    return [(list(p), cs) for p, cs in by_prompt.items()]


# ---------------------------------------------------------------------------- pricing shapes


def dense_stats(step: Step, micro_batch_tokens: int) -> tuple[PieceStats, tuple[float, float]]:
    """The stock path's shape: the step's rows in order, in micro-batches of at most
    ``micro_batch_tokens`` padded tokens, prompts left-padded and completions right-padded to the
    micro-batch's longest, the head over the completion columns.

    Returns:
        The summed :class:`PieceStats` (one unit per micro-batch) and the largest micro-batch's
        ``(tokens, scored)`` (what its activations hold at the peak).
    """
    total, peak = PieceStats(), (0.0, 0.0)
    rows = list(zip(step.sequences, step.score_from, strict=True))
    i = 0
    while i < len(rows):
        prompt_max, completion_max, n = 0, 0, 0
        while i + n < len(rows):
            seq, sf = rows[i + n]
            p, c = max(prompt_max, sf), max(completion_max, len(seq) - sf)
            if n and (n + 1) * (p + c) > micro_batch_tokens:
                break
            prompt_max, completion_max, n = p, c, n + 1
        length = prompt_max + completion_max
        mb = PieceStats(n * length, n * length * (length + 1) / 2, 1.0, n * completion_max)
        total = total + mb
        peak = max(peak, (mb.tokens, mb.scored))
        i += n
    return total, peak


def tree_peaks(step: Step, leaf_batch_tokens: int, block_size: int) -> dict[str, tuple[float, float]]:
    """Per tree mode, the ``(tokens, scored)`` whose activations the mode holds at its peak.

    keep: a tree's inner nodes stay alive while its leaves run in batches of up to
    ``leaf_batch_tokens`` tokens (the largest tree counts); packed: the whole forest in one pass;
    replay: one ``block_size`` block (ancestors are held as keys and values without autograd; that
    cache is priced apart, from the longest path).
    """
    keep = (0.0, 0.0)
    for tree in trees_of_forest(step.forest):
        inner = {p for p in tree.parent if p >= 0}
        inner_tokens = sum(tree.lengths[n] for n in inner)
        leaf_tokens = sum(n for i, n in enumerate(tree.lengths) if i not in inner)
        leaf_scored = (
            sum(tree.scored[i] for i in range(len(tree.lengths)) if i not in inner) if tree.scored else 0
        )
        batch = min(leaf_tokens, leaf_batch_tokens)
        scored = leaf_scored * batch / max(leaf_tokens, 1)
        keep = max(keep, (inner_tokens + batch, scored))
    whole = forest_stats(step.forest)
    longest = max(step.forest.lengths)
    return {
        "keep": keep,
        "packed": (whole.tokens, whole.scored),
        "replay": (float(min(block_size, longest)), float(min(block_size, longest))),
    }
