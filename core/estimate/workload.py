"""A user's training workload as shapes: their prompts (and optionally logged rollouts) grouped
into optimizer steps, priced as the stock path and as a forest.

Reading: a JSONL, JSON, Parquet or CSV file, a dataset saved with ``datasets.save_to_disk``, or a
Hugging Face dataset name. A row gives its prompt as token ids (``prompt_ids``/``input_ids``), as
text, or as chat messages (rendered with the tokenizer's chat template, as TRL, veRL and
OpenRLHF's ``--apply_chat_template`` do). A rollouts file has a prompt and a ``completion`` (text or
``completion_ids``) per row; rows with the same prompt form a group.

Without rollouts each prompt gets G completions of R distinct tokens: they share the prompt and
nothing else, the least a real group shares (real completions often open alike).

A hub dataset is read through ``datasets``; when the Hub cannot be reached, only a cached copy is
read (at once, instead of after the Hub client's retries).
"""

from __future__ import annotations

import contextlib
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..balance.cost import PieceStats
from ..balance.plan import forest_stats, trees_of_forest
from ..tree import PrefixForest

__all__ = [
    "Step",
    "Workload",
    "check_source",
    "dense_stats",
    "load_rows",
    "micro_batches",
    "read_workload",
]

#: Token-id columns read before the prompt columns the caller names (``python -m forkrl estimate``
#: names them by host).
ID_KEYS = ("prompt_ids", "input_ids")
COMPLETION_KEYS = ("completion_ids", "completion", "response", "output")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
#: Seconds to wait for the Hub before reading a hub dataset from the local cache only.
HUB_PROBE_SECONDS = 5.0


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


def check_source(source: str, flag: str = "--dataset") -> None:
    """Refuse a file name that does not exist, before anything else is read.

    Raises:
        ValueError: ``source`` names a .jsonl/.json/.parquet/.csv file that does not exist.
    """
    path = Path(source)
    if path.suffix.lower() in FILE_SUFFIXES and not path.is_file():
        raise ValueError(f"{flag} {source}: no such file")


def load_rows(source: str, split: str = "train", flag: str = "--dataset") -> list[dict[str, Any]]:
    """The rows of a JSONL/JSON/Parquet/CSV file, a saved dataset folder, or a hub dataset name.

    Args:
        source: the file, folder or hub name.
        split: the split of a folder or hub dataset.
        flag: the option ``source`` came from, named in errors.

    Raises:
        ValueError: a file that does not exist or has no rows, a format it cannot read, or a hub
            dataset that cannot be loaded.
    """
    check_source(source, flag)
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
    elif suffix == ".json":
        data = json.loads(path.read_text())
        rows = data if isinstance(data, list) else data.get("data", data.get("rows", []))
    elif suffix in (".parquet", ".csv") or path.is_dir() or not path.exists():
        rows = _datasets_rows(source, suffix, split, flag)
    else:
        raise ValueError(
            f"{flag} {source}: give a .jsonl, .json, .parquet or .csv file, a saved dataset folder or a hub name"
        )
    if not rows:
        raise ValueError(f"{flag} {source}: no rows")
    return rows


def _datasets_rows(source: str, suffix: str, split: str, flag: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"{flag} {source}: reading this format needs the `datasets` library (pip install datasets), "
            "or give a .jsonl file"
        ) from err
    if suffix in (".parquet", ".csv"):
        ds = datasets.load_dataset(suffix[1:], data_files=source, split="train")
    elif Path(source).is_dir():
        ds = datasets.load_from_disk(source)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = _hub_dataset(datasets, source, split, flag)
    return list(ds)


def _hub_reachable() -> bool:
    """Whether the Hub endpoint answers at all (any HTTP status), through the environment's proxies."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        urllib.request.urlopen(
            urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=HUB_PROBE_SECONDS
        )
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def _offline(datasets) -> Iterator[None]:
    """The Hub clients' offline mode for one call: cached copies only, no retries on a dead network."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _hub_dataset(datasets, source: str, split: str, flag: str):
    reachable = _hub_reachable()
    try:
        with contextlib.nullcontext() if reachable else _offline(datasets):
            return datasets.load_dataset(source, split=split)
    except Exception as err:  # datasets raises many kinds (network, name, split): one advice for all
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = (
            "" if reachable else " (the Hugging Face Hub cannot be reached from here and no copy is cached)"
        )
        raise ValueError(
            f"{flag} {source}: the dataset could not be loaded{where}: {why}; give a local file "
            "(.jsonl, .json, .parquet or .csv) or a save_to_disk folder"
        ) from None


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
    rows: Sequence[dict[str, Any]] | None,
    group_size: int | None,
    completion_length: int | None,
    prompts_per_step: int,
    tokenizer=None,
    prompt_keys: Sequence[str] = ("prompt",),
    rollouts: Sequence[dict[str, Any]] | None = None,
    vocab_size: int = 32000,
    limit: int = 0,
) -> Workload:
    """The user's prompts (or logged rollouts) as optimizer steps of ``prompts_per_step`` groups.

    Args:
        rows: the prompts (unused with ``rollouts``).
        group_size: completions per prompt; with ``rollouts``, None or every logged group's size.
        completion_length: synthetic completions' tokens; with ``rollouts``, None or a bound every
            logged completion keeps.
        prompts_per_step: prompts (groups) per optimizer step.
        tokenizer: for text and chat prompts.
        prompt_keys: the columns a prompt is looked for in.
        rollouts: logged rollouts: a prompt and a completion per row.
        vocab_size: synthetic completion tokens stay below it.
        limit: the first ``limit`` prompts (logged groups, in order of first appearance); 0: all.

    Raises:
        ValueError: a row without a prompt, text without a tokenizer, a non-positive size, logged
            groups or completions that disagree with ``group_size`` or ``completion_length``.
    """
    for name, value, least in (
        ("--num-generations", group_size, 1),
        ("--max-completion-length", completion_length, 1),
        ("--prompts-per-step", prompts_per_step, 1),
        ("--limit", limit, 0),
    ):
        if value is not None and value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if rollouts is not None:
        groups = _logged_groups(rollouts, tokenizer, prompt_keys, limit)
        _check_logged(groups, group_size, completion_length)
        groups = [(prompt, [c for c, _ in completions]) for prompt, completions in groups]
    else:
        if rows is None or group_size is None or completion_length is None:
            raise ValueError(
                "synthetic completions need the prompts, --num-generations and --max-completion-length"
            )
        rows = rows[:limit] if limit else rows
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


def _logged_groups(rollouts, tokenizer, prompt_keys, limit: int = 0):
    """Per logged prompt (in order of first appearance), its completions with their row numbers."""
    by_prompt: dict[tuple[int, ...], list[tuple[list[int], int]]] = {}
    for i, row in _progress(enumerate(rollouts), len(rollouts), "tokenizing rollouts"):
        prompt = tuple(_prompt_ids(row, prompt_keys, tokenizer, f"--rollouts row {i}"))
        if limit and prompt not in by_prompt and len(by_prompt) == limit:
            continue
        key = next((k for k in COMPLETION_KEYS if row.get(k) is not None), None)
        if key is None:
            raise ValueError(
                f"--rollouts row {i}: no completion: expected one of {', '.join(COMPLETION_KEYS)}"
            )
        completion = _tokens(row[key], tokenizer, f"--rollouts row {i}: {key!r}", prompt=False)
        if not completion:
            raise ValueError(f"--rollouts row {i}: the completion is empty")
        by_prompt.setdefault(prompt, []).append((completion, i))
    return [(list(p), cs) for p, cs in by_prompt.items()]


def _check_logged(groups, group_size: int | None, completion_length: int | None) -> None:
    """Refuse a ``-G`` or ``-R`` the logged rollouts contradict (they would price another workload)."""
    if group_size is not None:
        sizes = sorted({len(cs) for _, cs in groups})
        if sizes != [group_size]:
            odd = next(cs for _, cs in groups if len(cs) != group_size)
            have = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}"
            raise ValueError(
                f"--num-generations {group_size}: the logged rollouts have {have} completions per prompt "
                f"(the prompt of --rollouts row {odd[0][1]} has {len(odd)}); drop --num-generations to "
                "price the logged groups as they are"
            )
    if completion_length is not None:
        for _, cs in groups:
            for completion, row in cs:
                if len(completion) > completion_length:
                    raise ValueError(
                        f"--max-completion-length {completion_length}: --rollouts row {row}'s completion has "
                        f"{len(completion)} tokens; drop --max-completion-length to price the logged "
                        "completions as they are"
                    )


# ---------------------------------------------------------------------------- pricing shapes


def micro_batches(
    score_from: Sequence[int], lengths: Sequence[int], micro_batch_tokens: int
) -> list[tuple[int, int, int, int]]:
    """The stock path's micro-batches of rows in order: each takes rows while its padded size (rows
    times longest prompt plus longest completion) stays within ``micro_batch_tokens`` (at least one
    row).

    Returns:
        Per micro-batch ``(first row, rows, longest prompt, longest completion)``.
    """
    out, i = [], 0
    while i < len(lengths):
        prompt_max, completion_max, n = 0, 0, 0
        while i + n < len(lengths):
            p = max(prompt_max, score_from[i + n])
            c = max(completion_max, lengths[i + n] - score_from[i + n])
            if n and (n + 1) * (p + c) > micro_batch_tokens:
                break
            prompt_max, completion_max, n = p, c, n + 1
        out.append((i, n, prompt_max, completion_max))
        i += n
    return out


def dense_stats(step: Step, micro_batch_tokens: int) -> tuple[PieceStats, tuple[float, float]]:
    """The stock path's shape: the step's rows in :func:`micro_batches`, prompts left-padded and
    completions right-padded to the micro-batch's longest, the head over the completion columns.

    Returns:
        The summed :class:`PieceStats` (one unit per micro-batch) and the largest micro-batch's
        ``(tokens, scored)`` (what its activations hold at the peak).
    """
    total, peak = PieceStats(), (0.0, 0.0)
    lengths = [len(s) for s in step.sequences]
    for _, n, prompt_max, completion_max in micro_batches(step.score_from, lengths, micro_batch_tokens):
        length = prompt_max + completion_max
        mb = PieceStats(n * length, n * length * (length + 1) / 2, 1.0, n * completion_max)
        total = total + mb
        peak = max(peak, (mb.tokens, mb.scored))
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
