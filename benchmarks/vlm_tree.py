"""A GRPO step of a vision-language model on a tree against the plain path, side by side.

One group: a prompt of one image (``--image-tokens`` rows after the 2x2 patch merge) and ``--P``
text tokens, ``--G`` completions of ``--R`` tokens, on a small Qwen2.5-VL-shaped model (float32,
CPU), timed round-robin in one process (median of ``--repeat``):

    dense   the host's path (TRL's GRPO step): one padded batch of the G rows, each with the image's
            pixel values (the vision tower runs G times), logits of the completions only
            (``logits_to_keep``), the log-prob functional, one backward
    tree    :class:`forkrl.core.executor.vision.VisionBatch` (the vision tower once) and
            ``TreeExecutor`` keep mode: the image rows and the text prompt computed once

Also measured: the peak bytes autograd holds (saved tensors) per path, and the ideal FLOP ratio:
dense FLOPs over the tree's when every shared token and the image are computed once, forward and
backward (3x forward), counting the vision tower (patch embedding, its blocks with their window and
full attention, the merger), the language model's linear layers and attention per token and context
position, and the LM head at scored rows. ``achieved/ideal`` is the measured speedup over that ratio.

    .venv/bin/python -m benchmarks.vlm_tree --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.common import machine, print_table, timed
from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.executor.vision import Image, VisionBatch
from forkrl.core.testing import SavedBytes

SIZES = {  # text: hidden, layers, heads, kv heads, intermediate, vocab; vision: hidden, depth, heads, intermediate
    "micro": ((64, 2, 4, 2, 128, 1024), (32, 2, 2, 64)),
    "small": ((256, 4, 4, 2, 768, 32000), (128, 4, 4, 256)),
}
PATCH, TEMPORAL, MERGE, WINDOW = 14, 2, 2, 112


def specials(vocab: int) -> tuple[int, int, int, int]:
    """(image, video, vision start, vision end) token ids: the vocabulary's last four."""
    return vocab - 4, vocab - 3, vocab - 2, vocab - 1


def vlm(size: str):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    (hidden, layers, heads, kv, inter, vocab), (vh, depth, vheads, vinter) = SIZES[size]
    image, video, start, end = specials(vocab)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "mrope_section": [hidden // heads // 8] * 2 + [hidden // heads // 4],
                             "rope_theta": 1e6},
        ),
        vision_config=dict(
            depth=depth, hidden_size=vh, num_heads=vheads, intermediate_size=vinter, out_hidden_size=hidden,
            patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=WINDOW,
            fullatt_block_indexes=[depth - 1],
        ),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).float().train()


def ideal_flops(
    size: str, prompt: int, patches: int, forest: PrefixForest, G: int, R: int
) -> tuple[float, float]:
    """(dense, tree) forward FLOPs; a backward costs twice its forward in both paths (module docstring)."""
    (hidden, layers, heads, kv, inter, vocab), (vh, depth, vheads, vinter) = SIZES[size]
    head_dim = hidden // heads
    linear = 2 * layers * (2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter)
    attn = layers * 4 * hidden  # QK^T and AV per query per key
    head = 2 * hidden * vocab
    window = (WINDOW // PATCH) ** 2  # patches per attention window
    per_patch = 2 * 3 * TEMPORAL * PATCH * PATCH * vh + 2 * depth * (4 * vh * vh + 3 * vh * vinter)
    vision = patches * per_patch + 4 * vh * patches * (window * (depth - 1) + patches)
    merged = patches // MERGE**2
    vision += merged * 2 * (MERGE**2 * vh) * (MERGE**2 * vh + hidden)
    length = prompt + R
    dense = G * (vision + length * linear + attn * length * (length + 1) / 2 + R * head)
    tree = vision + R * G * head
    for node in forest.nodes:
        n = len(node.tokens)
        tree += n * linear + attn * n * (node.start + (n + 1) / 2)
    return float(dense), float(tree)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument(
        "--image-tokens", type=int, default=1024, help="image rows after the merge (a square grid)"
    )
    ap.add_argument("--P", type=int, default=128, help="text tokens of the prompt")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--R", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="round-robin runs per method; the median is kept")
    args = ap.parse_args()

    side = int(round(args.image_tokens**0.5)) * MERGE
    if (side // MERGE) ** 2 != args.image_tokens:
        raise SystemExit(f"--image-tokens {args.image_tokens} is not a square number of merged rows")
    model = vlm(args.size)
    vocab = model.config.text_config.vocab_size
    IMAGE, _, START, END = specials(vocab)  # noqa: N806
    g = torch.Generator().manual_seed(0)
    image = Image(
        torch.randn(side * side, 3 * TEMPORAL * PATCH * PATCH, generator=g), torch.tensor([1, side, side])
    )
    text = torch.randint(0, vocab - 16, (args.P,), generator=g).tolist()
    prompt = [START] + [IMAGE] * args.image_tokens + [END] + text
    seqs = [
        torch.tensor(prompt + torch.randint(0, vocab - 16, (args.R,), generator=g).tolist())
        for _ in range(args.G)
    ]
    coefs = [torch.randn(args.R, generator=g) / (args.G * args.R) for _ in range(args.G)]
    sf = len(prompt)
    ex = TreeExecutor(model).verify()

    def dense():
        ids = torch.stack(seqs)
        out = model(
            input_ids=ids,
            pixel_values=torch.cat([image.pixel_values] * args.G),
            image_grid_thw=torch.stack([image.grid_thw] * args.G),
            mm_token_type_ids=(ids == IMAGE).int(),
            logits_to_keep=args.R + 1,
        )
        lp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, sf:, None])[..., 0]
        (lp * torch.stack(coefs)).sum().backward()

    def tree():
        vision = VisionBatch.prepare(model, seqs, [[image]] * args.G)
        forest = PrefixForest.build(vision.sequences, [sf] * args.G)
        ex.backward(forest, coefs, vision=vision)
        return forest

    methods = {"dense": dense, "tree": tree}
    times: dict[str, list[float]] = {m: [] for m in methods}
    saved: dict[str, int] = {}
    forest = None
    for fn in methods.values():  # warm-up (first-call costs: the executor's probe, allocator growth)
        model.zero_grad(set_to_none=True)
        fn()
    for _ in range(args.repeat):
        for name, fn in methods.items():
            model.zero_grad(set_to_none=True)
            seconds, out = timed(fn)
            forest = out if name == "tree" else forest
            times[name].append(seconds)
            print(f"  {name}: {seconds:.2f}s", file=sys.stderr, flush=True)
    for name, fn in methods.items():  # autograd's peak saved bytes, in a separate (untimed) run
        model.zero_grad(set_to_none=True)
        meter = SavedBytes()
        with meter.measure():
            fn()
        saved[name] = meter.peak
    dense_flops, tree_flops = ideal_flops(args.size, sf, side * side, forest, args.G, args.R)
    row = {
        "size": args.size, "image_tokens": args.image_tokens, "P": args.P, "G": args.G, "R": args.R,
        "compression": forest.compression, "dense_s": statistics.median(times["dense"]),
        "tree_s": statistics.median(times["tree"]), "ideal_flop_ratio": dense_flops / tree_flops,
        "dense_saved_mb": saved["dense"] / 2**20, "tree_saved_mb": saved["tree"] / 2**20,
    }  # fmt: skip
    row["speedup"] = row["dense_s"] / row["tree_s"]
    row["achieved_over_ideal"] = row["speedup"] / row["ideal_flop_ratio"]
    print_table(
        [row],
        [
            ("size", "{}"), ("image_tokens", "{}"), ("P", "{}"), ("G", "{}"), ("R", "{}"),
            ("compression", "{:.2f}"), ("dense_s", "{:.2f}"), ("tree_s", "{:.2f}"), ("speedup", "{:.2f}x"),
            ("ideal_flop_ratio", "{:.2f}x"), ("achieved_over_ideal", "{:.2f}"),
            ("dense_saved_mb", "{:.0f}"), ("tree_saved_mb", "{:.0f}"),
        ],
    )  # fmt: skip
    print(json.dumps({"benchmark": "vlm_tree", "machine": machine(), "rows": [row]}))


if __name__ == "__main__":
    main()
