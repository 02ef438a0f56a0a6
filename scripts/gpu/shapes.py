"""What the training stages measure: model widths, GRPO batches, what each method holds in device
memory (and so how many layers fit), and what each method computes.

Models are random-weight Qwen2 decoders built from a config on the device (bf16 there, float32 in
``--tiny``): Qwen2.5-0.5B's and Qwen2.5-7B's widths, tied embeddings as those models have them.

FLOPs come from :func:`forkrl.core.estimate.pricing.config_flops` (forward: linear layers per token,
attention per causal query-key pair, the LM head per scored row only), times 3 for forward +
backward:
    dense           every row on its own: ``dense_stats`` of the rows in their micro-batches
    keep, packed,   the forest's unique work: ``forest_stats`` (each shared prefix once, each
    prefix_grouper  completion attending its prefix and itself)
    replay          the same plus its recompute: inner nodes are forwarded once without grad first
                    and again with grad (a forward of their tokens and attention, no head)
``ideal = dense FLOPs / method FLOPs`` is the speedup a method would reach at dense's FLOP rate;
packed's FlexAttention computes whole masked blocks and Prefix Grouper copies keys, so their real
work is somewhat above what is counted here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 2**30
METHODS = ("dense", "keep", "replay", "packed", "prefix_grouper")
#: veRL's default ``ppo_max_token_len_per_gpu``: dense's micro-batch and packed's / Prefix Grouper's
#: group batch, in tokens.
MICRO_BATCH_TOKENS = 16384
#: Replay's block (``TreeOptions``' default ``DEFAULT_BLOCK_SIZE``; kept equal by a test).
REPLAY_BLOCK = 2048
#: Keep mode's leaf batch (``TreeExecutor``'s default ``leaf_batch_tokens``).
LEAF_BATCH_TOKENS = 8192
#: The share of device memory a plan may fill (the rest: CUDA context, allocator slack).
MEMORY_SHARE = 0.90


@dataclass(frozen=True)
class Widths:
    """A decoder's widths (Qwen2: biases on q/k/v, RMSNorm, SwiGLU)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    tied: bool

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        return 2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * self.inter + 2 * h

    def fixed_params(self) -> int:
        """Embedding (and an untied LM head) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self, layers: int | None = None) -> int:
        return (self.layers if layers is None else layers) * self.layer_params() + self.fixed_params()

    def activation_bytes(self, element_size: int) -> float:
        """Autograd-saved bytes per token per layer without checkpointing. Per layer a Qwen2 block
        with flash/sdpa attention keeps: two RMSNorms (float32 input, bf16 cast and output: 4h
        elements each), q, the attention output and o_proj's input (3h), k and v (2 kv), the MLP's
        gate, its activation, up and their product (4 inter): 11h + 2kv + 4 inter. Measured on an
        H200 (0.5B widths, benchmarks/results/gpu.md): dense and keep held about 0.85 of this,
        packed (FlexAttention) about 1.5 (:data:`ACTIVATION_FACTOR`)."""
        return element_size * (11 * self.hidden + 2 * self.kv_dim + 4 * self.inter)


#: Per method, activations held per token over :meth:`Widths.activation_bytes` (1 where unmeasured).
ACTIVATION_FACTOR = {"packed": 1.5}


QWEN_05B = Widths("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, tied=True)
QWEN_7B = Widths("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, tied=False)
TINY = Widths("tiny", 64, 2, 4, 2, 128, 512, tied=True)
TINY_UNTIED = Widths("tiny-untied", 64, 3, 4, 1, 160, 640, tied=False)


@dataclass(frozen=True)
class Shape:
    """One training-stage shape: ``groups`` GRPO groups of one P-token prompt and G completions of
    R tokens each. ``micro_batch_tokens`` bounds dense's micro-batches and packed's and Prefix
    Grouper's calls (whole groups); ``block`` is replay's block; ``leaf_batch_tokens`` is keep's
    leaf batch as the executor's default sets it (the memory plan's figure; not passed on)."""

    name: str
    widths: Widths
    P: int
    G: int
    R: int
    groups: int = 1
    micro_batch_tokens: int = MICRO_BATCH_TOKENS
    block: int = REPLAY_BLOCK
    leaf_batch_tokens: int = LEAF_BATCH_TOKENS

    @property
    def row(self) -> int:
        return self.P + self.R

    @property
    def group(self) -> int:
        return self.P + self.G * self.R

    def rows_per_micro_batch(self) -> int:
        return max(1, self.micro_batch_tokens // self.row)

    def groups_per_micro_batch(self) -> int:
        return max(1, self.micro_batch_tokens // self.group)

    def describe(self) -> dict:
        return {
            "model": self.widths.name,
            "P": self.P,
            "G": self.G,
            "R": self.R,
            "groups": self.groups,
            "dense": f"{self.rows_per_micro_batch()} rows of {self.row} tokens per micro-batch "
            f"(at most {self.micro_batch_tokens} tokens; equal lengths: no padding)",
            "packed_and_prefix_grouper": f"{self.groups_per_micro_batch()} whole group(s) of {self.group} "
            f"unique tokens per call (at most {self.micro_batch_tokens})",
            "keep_and_replay": f"the whole forest in one call (replay block {self.block}; keep's leaf batch "
            f"the executor's default, {self.leaf_batch_tokens} tokens)",
        }


#: name -> (the GPU shape, its ``--tiny`` counterpart: the same structure at CPU size).
SHAPES: dict[str, tuple[Shape, Shape]] = {
    "0.5b": (
        Shape("0.5b", QWEN_05B, 8192, 16, 512),
        Shape("0.5b", TINY, 64, 4, 16, micro_batch_tokens=128, block=32),
    ),
    "7b": (
        Shape("7b", QWEN_7B, 4096, 8, 1024),
        Shape("7b", TINY_UNTIED, 48, 4, 24, micro_batch_tokens=150, block=32),
    ),
    "math": (
        Shape("math", QWEN_05B, 256, 8, 512, groups=32),
        Shape("math", TINY, 16, 4, 16, groups=6, micro_batch_tokens=224, block=32),
    ),
}


# ---------------------------------------------------------------------------- memory


def held(shape: Shape, method: str) -> tuple[int, int]:
    """(tokens whose activations autograd holds at the method's peak, LM-head rows materialised at
    once over the whole vocabulary: dense and Prefix Grouper form full logits; the executor's head
    is chunked)."""
    if method == "dense":
        rows = shape.rows_per_micro_batch()
        return rows * shape.row, rows * (shape.R + 1)
    if method == "keep":
        leaves = min(shape.G, max(1, shape.leaf_batch_tokens // shape.R))
        return shape.P + leaves * shape.R, 0
    if method == "replay":
        return max(shape.block, shape.R), 0
    groups = shape.groups_per_micro_batch()
    return groups * shape.group, (groups * shape.G * shape.R if method == "prefix_grouper" else 0)


def peak_bytes(shape: Shape, method: str, layers: int, element_size: int) -> float:
    """A method's predicted peak: weights and gradients, held activations, the head's logits in
    bf16 and float32 with their log-softmax and gradient (14 bytes per logit), Prefix Grouper's
    per-completion copies of its prefix's keys and values (saved by its attention), 1 GiB of
    workspace."""
    w = shape.widths
    tokens, head_rows = held(shape, method)
    weights_and_grads = 2 * element_size * w.params(layers)
    per_layer = tokens * w.activation_bytes(element_size) * ACTIVATION_FACTOR.get(method, 1.0)
    if method == "prefix_grouper":
        per_layer += shape.groups_per_micro_batch() * shape.G * shape.row * 2 * w.kv_dim * element_size
    chunked_head = 2**25 * 14  # the executor's head_chunk_elems logits at a time
    return weights_and_grads + layers * per_layer + head_rows * w.vocab * 14 + chunked_head + GIB


def plan_layers(shape: Shape, methods, element_size: int, memory_bytes: float | None) -> dict:
    """The number of layers at which every method fits in ``MEMORY_SHARE`` of the device's memory:
    the model's own unless some method cannot fit, then the most that all fit (linear in layers).

    Returns:
        ``layers``, ``cut`` (a sentence when layers were cut, else None) and, per method, the
        predicted peak in GiB at the model's own layer count.
    """
    w = shape.widths
    full = {m: peak_bytes(shape, m, w.layers, element_size) for m in methods}
    out = {
        "layers": w.layers,
        "cut": None,
        "predicted_gib_full_layers": {m: b / GIB for m, b in full.items()},
    }
    if memory_bytes is None:
        return out
    budget = MEMORY_SHARE * memory_bytes
    layers = w.layers
    for m in methods:
        fixed = peak_bytes(shape, m, 0, element_size)
        per_layer = peak_bytes(shape, m, 1, element_size) - fixed
        layers = min(layers, int((budget - fixed) // per_layer))
    if layers < w.layers:
        over = ", ".join(f"{m} {full[m] / GIB:.0f}" for m in methods if full[m] > budget)
        out["cut"] = (
            f"layers cut from {w.layers} to {max(layers, 0)}: at {w.layers} layers the predicted peak (GiB) of "
            f"{over} exceeds {MEMORY_SHARE:.0%} of the device's {memory_bytes / GIB:.0f} GiB"
        )
        out["layers"] = max(layers, 0)
    out["predicted_gib"] = {m: peak_bytes(shape, m, out["layers"], element_size) / GIB for m in methods}
    return out


# ---------------------------------------------------------------------------- models and batches


def build_model(widths: Widths, layers: int, device, dtype, max_len: int):
    """A random-weight Qwen2 causal LM of these widths, initialised on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=widths.hidden,
        intermediate_size=widths.inter,
        num_hidden_layers=layers,
        num_attention_heads=widths.heads,
        num_key_value_heads=widths.kv_heads,
        vocab_size=widths.vocab,
        tie_word_embeddings=widths.tied,
        max_position_embeddings=max(32768, max_len),
        use_sliding_window=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.train()
    return model


@dataclass
class Batch:
    """One optimizer step's rows (groups contiguous) and their forest."""

    seqs: list
    score_from: list[int]
    coefs: list
    forest: object
    group_slices: list[slice]

    def micro_batches(self, groups_per_call: int) -> list[slice]:
        """Row slices of whole groups, ``groups_per_call`` at a time."""
        out = []
        for i in range(0, len(self.group_slices), groups_per_call):
            chunk = self.group_slices[i : i + groups_per_call]
            out.append(slice(chunk[0].start, chunk[-1].stop))
        return out


def build_batch(shape: Shape) -> Batch:
    """``shape.groups`` GRPO groups (each its own random prompt) as one step, with its forest."""
    from forkrl.core import PrefixForest
    from forkrl.core.estimate.pricing import grpo_batch

    seqs, sf, coefs, slices = [], [], [], []
    for k in range(shape.groups):
        s, f, c = grpo_batch(shape.P, shape.G, shape.R, shape.widths.vocab, seed=k)
        slices.append(slice(len(seqs), len(seqs) + len(s)))
        seqs += s
        sf += f
        coefs += c
    return Batch(seqs, sf, coefs, PrefixForest.build(seqs, sf), slices)


# ---------------------------------------------------------------------------- FLOPs


def method_flops(config, batch: Batch, shape: Shape, methods) -> dict[str, float]:
    """Forward + backward FLOPs of each method on ``batch`` (module docstring)."""
    from forkrl.core.balance.cost import CostModel, PieceStats
    from forkrl.core.balance.plan import forest_stats
    from forkrl.core.estimate.pricing import config_flops
    from forkrl.core.estimate.workload import Step, dense_stats

    linear, attn, head = config_flops(config)
    forward = CostModel(per_token=linear, per_attended=attn, per_unit=0.0, per_scored=head)
    step = Step([s.tolist() for s in batch.seqs], list(batch.score_from))
    dense, _ = dense_stats(step, shape.rows_per_micro_batch() * shape.row)
    tree = forest_stats(batch.forest)
    inner = PieceStats()
    for node in batch.forest.nodes:
        if node.children:
            n, s = len(node.tokens), node.start
            inner = inner + PieceStats(tokens=n, attended=n * s + n * (n + 1) / 2, units=1)
    out = {}
    for m in methods:
        if m == "dense":
            out[m] = 3 * forward.predict(dense)
        elif m == "replay":
            out[m] = 3 * forward.predict(tree) + forward.predict(inner)
        else:
            out[m] = 3 * forward.predict(tree)
    return out


def tiny_or_full(name: str, tiny: bool) -> Shape:
    full, small = SHAPES[name]
    return small if tiny else full


def with_layers(shape: Shape, layers: int) -> Shape:
    return dataclasses.replace(shape, widths=dataclasses.replace(shape.widths, layers=layers))
