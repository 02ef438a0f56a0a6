"""forkrl's TRL plugin on TRL's own multi-turn tool-calling loop (agentic GRPO), against stock TRL.

TRL's tool tests load Qwen's tokenizer from the Hub; here everything is built offline so that
TRL 1.16's whole loop runs unmodified: its chat-template checks (``supports_tool_calling``,
``is_chat_template_prefix_preserving``), generation with the real model, ``parse_response``,
tool execution (``tools=`` or ``environment_factory``), the re-rendered tool-result suffix
(``_get_tool_suffix_ids``), regeneration after the tool, and the tool mask in the loss.

The pieces:
- a word-level tokenizer whose words are the whitespace-split pieces of the chat template's own
  rendering (``{"name":``, ``"lookup",``, ...), so a generated tool call decodes to valid JSON;
- a chat template that renders tools, tool calls and tool results, and a ``response_template``
  for transformers' parser, both saved with the tokenizer, loaded by TRL from the model path;
- a tiny Llama whose embeddings are one-hot and whose LM head holds a transition table, so its
  real forward speaks this language: after the assistant header it calls ``lookup`` (or answers),
  with a sampled key; attention and MLP keep their random weights, so every parameter trains.

Stock ``trl.GRPOTrainer`` and forkrl's with ``tree_packing=True`` train two SGD steps from the same
weights with the same seed: TRL's seeded sampling gives both the same rollouts (checked), and the
parameters must agree to 1e-4 of the update (observed 6.6e-6). The bound is tight enough for the
tool results' context: replacing only the masked tool-result tokens moves stock's own update by
2.2e-3, and dropping the tool mask by 0.95.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from forkrl.core.testing.models import byte_llama, save_pretrained  # noqa: E402
from forkrl.core.testing.stock import assert_equals_stock  # noqa: E402
from forkrl.plugins import trl as ftrl  # noqa: E402

from .trl_helpers import base_args, initial_params  # noqa: E402

TOL = 1e-4
KEYS = 4

# The vocabulary: the chat template's structure, the JSON pieces of a rendered `lookup` call, the
# tool's results, the answers and the prompt words. Only <pad> and <eos> are special, so the
# parser and TRL's plain-text fallback see every other word.
WORDS = [
    "<pad>", "<eos>", "<unk>", "<user>", "<assistant>", "<tool>", "<tools>", "</tools>", "lookup",
    "<tool_call>", "</tool_call>", '{"name":', '"lookup",', '"arguments":', '{"key":',
    *[f'"k{i}"}}}}' for i in range(KEYS)],
    *[f"v{i}" for i in range(KEYS)],
    *[f"a{i}" for i in range(KEYS)],
    *[f"q{i}" for i in range(8)],
]  # fmt: skip
ID = {w: i for i, w in enumerate(WORDS)}

CHAT_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %} {{ t.function.name }}{% endfor %} </tools> {% endif -%}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<user> {{ m.content }} <eos> "
    "{%- elif m.role == 'assistant' %}<assistant>{% if m.content %} {{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %} <tool_call> {{ c.function | tojson }} </tool_call>{% endfor %} <eos> "
    "{%- elif m.role == 'tool' %}<tool> {{ m.content }} <eos> "
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}"
)

# transformers' response parser (TRL's parse_response): tool calls as JSON between the tags, the
# rest up to <eos> as content; the prompt's last <assistant> is where the message starts.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<assistant>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"\s*</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<eos>\s*", "content": "text"},
    },
}

# What the model says next, by the current word: logits over successors (one-hot embeddings and
# this table in the LM head make a bigram model). The assistant header calls the tool with
# probability 0.6 (after a tool result too: the loop can go round twice), else answers; the key
# is drawn uniformly, so groups differ in depth, key and answer.
CALL_LOGIT = math.log(6.0)
TRANSITIONS: dict[str, dict[str, float]] = {
    "<assistant>": {"<tool_call>": CALL_LOGIT, **{f"a{i}": 0.0 for i in range(KEYS)}},
    "<tool_call>": {'{"name":': 0.0},
    '{"name":': {'"lookup",': 0.0},
    '"lookup",': {'"arguments":': 0.0},
    '"arguments":': {'{"key":': 0.0},
    '{"key":': {f'"k{i}"}}}}': 0.0 for i in range(KEYS)},
    **{f'"k{i}"}}}}': {"</tool_call>": 0.0} for i in range(KEYS)},
    "</tool_call>": {"<eos>": 0.0},
    **{f"a{i}": {"<eos>": 0.0} for i in range(KEYS)},
}
MARGIN = 24.0  # a successor's logit over any other word's: the table is followed up to ~1e-9


def word_tokenizer():
    """The word-level tokenizer with the chat and response templates (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=ID, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def tool_calling_llama(seed: int = 0):
    """A tiny Llama (hidden 64, GQA 4/2, 2 layers) that follows :data:`TRANSITIONS`."""
    hidden = 64
    model = byte_llama(
        seed,
        vocab_size=len(WORDS),
        hidden_size=hidden,
        intermediate_size=64,
        pad_token_id=ID["<pad>"],
        eos_token_id=ID["<eos>"],
    )
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(len(WORDS), hidden))
        head = torch.zeros(len(WORDS), hidden)
        for word, successors in TRANSITIONS.items():
            for nxt, logit in successors.items():
                # The final RMSNorm scales a one-hot residual to sqrt(hidden) on its own axis.
                head[ID[nxt], ID[word]] = (MARGIN + logit) / math.sqrt(hidden)
        model.lm_head.weight.copy_(head)
    return model


def lookup(key: str) -> str:
    """Look a key up in the table.

    Args:
        key: The key to look up, k0 to k3.
    """
    return "v" + key.removeprefix("k")


class LookupEnv:
    """An environment whose ``lookup`` method is the tool (TRL's ``environment_factory``)."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, **kwargs: Any) -> None:
        self.calls = 0

    def lookup(self, key: str) -> str:
        """Look a key up in the table.

        Args:
            key: The key to look up, k0 to k3.
        """
        self.calls += 1
        return lookup(key)


class AnswerReward:
    """1 for answering with the last looked-up value (``a2`` after ``v2``), plus 0.25 per tool
    result; records every rollout it scores (prompt text and completion ids, tool results included)."""

    __name__ = "answer_reward"

    def __init__(self) -> None:
        self.rollouts: list[tuple[str, tuple[int, ...]]] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        rewards = []
        for prompt, messages, ids in zip(prompts, completions, completion_ids, strict=True):
            self.rollouts.append((prompt[-1]["content"], tuple(ids)))
            results = [m["content"] for m in messages if m["role"] == "tool"]
            answer = messages[-1].get("content", "") if messages[-1]["role"] == "assistant" else ""
            right = bool(results) and answer == "a" + results[-1].removeprefix("v")
            rewards.append(float(right) + 0.25 * len(results))
        return rewards


def prompts(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)]})


def run(
    model_path: str, out: Path, forkrl: bool, env: bool, **kw: Any
) -> tuple[dict[str, torch.Tensor], Any, AnswerReward, list[dict[str, torch.Tensor]]]:
    """Two SGD steps of TRL's own generation and tool loop; returns the parameters, the trainer,
    the reward (its recorded rollouts) and TRL's prepared batches (with ``tool_mask``)."""
    options = dict(max_steps=2, max_completion_length=32, max_tool_calling_iterations=2, **kw)
    if forkrl:
        args, cls = ftrl.GRPOConfig(**base_args(out, **options), tree_packing=True), ftrl.GRPOTrainer
    else:
        args, cls = trl.GRPOConfig(**base_args(out, **options)), trl.GRPOTrainer
    reward = AnswerReward()
    tools = dict(environment_factory=LookupEnv) if env else dict(tools=[lookup])
    trainer = cls(model=model_path, reward_funcs=reward, args=args, train_dataset=prompts(), **tools)
    batches: list[dict[str, torch.Tensor]] = []
    trainer._generate_and_score_completions = _recording(trainer._generate_and_score_completions, batches)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return params, trainer, reward, batches


def _recording(generate: Callable, into: list) -> Callable:
    # TRL's method runs unchanged; its prepared batch is kept for the tool-mask checks.
    def wrapped(inputs):
        output = generate(inputs)
        into.append({k: v.detach().clone() for k, v in output.items() if isinstance(v, torch.Tensor)})
        return output

    return wrapped


def tool_spans(ids: list[int]) -> list[tuple[int, int]]:
    """Where TRL appended a tool result: ``<tool> v <eos> <assistant>`` (the model never says ``<tool>``)."""
    return [(j, j + 4) for j, t in enumerate(ids) if t == ID["<tool>"]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_pretrained(tool_calling_llama(), word_tokenizer(), tmp_path_factory.mktemp("tool-llama"))


def test_offline_template_passes_trls_tool_checks():
    """The chat template is one TRL accepts for tools, and the parser reads a generated call."""
    from trl.chat_template_utils import (
        is_chat_template_prefix_preserving,
        parse_response,
        supports_tool_calling,
    )

    tok = word_tokenizer()
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "q3"}],
        tools=[lookup],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    call = tok('<tool_call> {"name": "lookup", "arguments": {"key": "k2"}} </tool_call> <eos>')["input_ids"]
    assert ID["<unk>"] not in prompt + call
    parsed = parse_response(tok, call, prefix=prompt, tools=[lookup])
    assert parsed["tool_calls"] == [
        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "k2"}}}
    ]


@pytest.mark.parametrize(
    "env, cfg",
    [(False, {}), (True, dict(beta=0.05))],
    ids=["tools", "environment-factory-beta"],
)
def test_tool_loop_plugin_equals_stock(env, cfg, model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    init = initial_params(model_path)
    stock, st, stock_reward, _ = run(model_path, tmp_path / "stock", False, env, **cfg)
    tree, tt, tree_reward, batches = run(model_path, tmp_path / "tree", True, env, **cfg)

    # TRL's loop ran: rollouts hold tool results, each the tool's answer to the call before it,
    # and TRL's tool mask takes exactly those tokens out of the loss.
    assert stock_reward.rollouts == tree_reward.rollouts, "the two runs did not get the same rollouts"
    calls, depths = 0, set()
    for batch in batches:
        for ids, mask, tool in zip(
            batch["completion_ids"], batch["completion_mask"], batch["tool_mask"], strict=True
        ):
            ids = ids[mask.bool()].tolist()
            expected = [1] * len(ids)
            spans = tool_spans(ids)
            for start, end in spans:
                key = WORDS[ids[start - 3]]  # '"k2"}}' before '</tool_call> <eos>'
                assert ids[start + 1] == ID["v" + key[2]], (WORDS[ids[start + 1]], key)
                expected[start:end] = [0] * (end - start)
            assert tool[: len(ids)].tolist() == expected
            calls += len(spans)
            depths.add(len(spans))
    assert calls > 0 and {1, 2} <= depths, depths
    if env:  # the calls reached the environment instances TRL drew from its pool
        assert sum(e.calls for e in tt.environments) > 0
    logged = [h for h in tt.state.log_history if "loss" in h]
    assert all(h["tools/call_frequency"] > 0 for h in logged)
    assert all(h["tree/compression"] > 1.0 for h in logged)

    assert_equals_stock(stock, tree, init, TOL, what="the plugin")
    for a, b in zip([h for h in st.state.log_history if "loss" in h], logged, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-6), (a["loss"], b["loss"])
