"""Real veRL in this process on the CPU, for tests and benchmarks: the stock FSDP2 engine and
forkrl's, built by veRL's own TrainingWorker, without Ray.

:func:`start` (idempotent; :func:`worker` calls it at first use) prepares the process: veRL's engine
device (``VERL_ENGINE_DEVICE=cuda``: veRL registers its FSDP engines for cuda/npu only), the CPU
platform, a gloo group (:func:`forkrl.core.testing.group.start_gloo`) and forkrl's engine registered.
The platform is the product's (:class:`forkrl.plugins.verl.cpu_platform.CPUPlatform`, the one CPU
smoke runs use), with two adjustments for tests: the Ulysses device mesh's device name, which veRL
reads at import; and veRL's log-softmax and entropy take float32 from bf16 logits, as its GPU
kernels do (:func:`_float32_softmax`; a no-op in float32), so that the precision tests compare what
a GPU run computes.

Batches are built as veRL's ray trainer hands them to ``update_actor``: padded [left-padded prompt |
right-padded response] tensors turned into veRL's no-padding layout by its own
``left_right_2_no_padding``. Equals stock: :func:`train` either side, :func:`parameters`, and the
comparison of :mod:`forkrl.core.testing.stock`.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from forkrl.core.testing.group import start_gloo
from forkrl.core.testing.models import byte_llama, byte_tokenizer, grpo_rollouts, left_padded, save_pretrained

if TYPE_CHECKING:
    from .config import ForkrlFSDPActorConfig

__all__ = [
    "PRECISIONS", "VLLM_SHAPE", "actor_config", "agent_loop_fields", "batch", "log_probs", "parameters",
    "rows", "save_model", "start", "train", "update", "worker",
]  # fmt: skip

_started = False


def start() -> None:
    """Prepare this process for :func:`worker` (idempotent): see the module's docstring."""
    global _started
    if _started:
        return
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    _install_platform()
    start_gloo()
    from . import register

    register()
    _started = True


def _float32_softmax(fn):
    """``fn`` on half-precision logits upcast to float32 first: on a GPU veRL's log-probs come from
    flash-attn's cross-entropy kernel, and its entropy from softmax/logsumexp under CUDA autocast,
    both float32 computations from bf16 logits; CPU autocast keeps those ops in bf16."""

    def upcast(logits, *args, **kwargs):
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return fn(logits, *args, **kwargs)

    return upcast


def _install_platform() -> None:
    import verl.utils.torch_functional as verl_F
    from verl.plugin.platform.platform_manager import set_platform

    from .cpu_platform import CPUPlatform

    set_platform(CPUPlatform())
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.device_name = "cpu"  # read at import, before this platform: Ulysses' device mesh
    # Before any engine exists (the engine binds entropy_from_logits in __init__).
    if not getattr(transformer_impl.logprobs_from_logits, "forkrl_float32", False):
        transformer_impl.logprobs_from_logits = _float32_softmax(transformer_impl.logprobs_from_logits)
        verl_F.entropy_from_logits = _float32_softmax(verl_F.entropy_from_logits)
        transformer_impl.logprobs_from_logits.forkrl_float32 = True


#: A byte Llama that vLLM's CPU build serves (head dimension 32) and forkrl's int4 drafter tiles
#: (hidden and MLP widths multiples of its 128-wide groups).
VLLM_SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)


def save_model(path, **shape) -> str:
    """A tiny byte Llama with its tokenizer, saved at ``path`` (``shape``: config fields, e.g. :data:`VLLM_SHAPE`)."""
    return save_pretrained(byte_llama(0, **shape), byte_tokenizer(), path)


#: ``fsdp_config`` precision settings: float32 (exactness tests), veRL's default mixed precision
#: (float32 parameters, bf16 compute under autocast, float32 reduction), bf16 parameters.
PRECISIONS = {
    "fp32": dict(model_dtype="fp32", mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}),
    "mixed": dict(model_dtype="fp32", mixed_precision=None),
    "bf16": dict(model_dtype="bf16", mixed_precision=None),
}  # fmt: skip


def actor_config(forkrl: dict | None, precision: str = "fp32", **kw) -> ForkrlFSDPActorConfig:
    """veRL's actor config (forkrl's subclass; ``forkrl=None`` keeps veRL's own engine); ``precision``
    is a key of :data:`PRECISIONS`."""
    start()
    from verl.workers.config import FSDPEngineConfig

    from .config import ForkrlFSDPActorConfig

    fields = dict(
        rollout_n=1, strategy="fsdp2", ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
        use_torch_compile=False, fsdp_config=FSDPEngineConfig(use_torch_compile=False, **PRECISIONS[precision]),
    )  # fmt: skip
    fields.update(kw)
    return ForkrlFSDPActorConfig(forkrl=forkrl or {}, **fields)


def worker(
    path: str,
    actor,
    use_remove_padding: bool = True,
    lr: float = 0.05,
    max_token_len: int | None = None,
    gradient_checkpointing: bool = False,
    **model_kw,
):
    """A TrainingWorker built as veRL's ActorRolloutRefWorker builds its actor; the optimizer is
    torch's SGD through veRL's own optimizer config (no clipping), so the update is the gradient's.

    ``gradient_checkpointing`` is veRL's ``model.enable_gradient_checkpointing`` (on in veRL's own
    config; off here, so that ``tree_mode: auto`` trains in keep mode unless a test asks);
    ``model_kw``: further ``HFModelConfig`` fields (``lora_rank``, ...)."""
    start()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    model = HFModelConfig(
        path=path,
        override_config={"attn_implementation": "sdpa"},
        use_remove_padding=use_remove_padding,
        enable_gradient_checkpointing=gradient_checkpointing,
        **model_kw,
    )
    engine = actor.engine
    engine.use_dynamic_bsz = actor.use_dynamic_bsz
    engine.micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    engine.infer_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    engine.max_token_len_per_gpu = max_token_len
    engine.infer_max_token_len_per_gpu = max_token_len
    engine.use_remove_padding = use_remove_padding
    optim = FSDPOptimizerConfig(
        lr=lr, weight_decay=0.0, clip_grad=1e9, optimizer="SGD", optimizer_impl="torch.optim"
    )
    config = TrainingWorkerConfig(
        model_type="language_model", model_config=model, engine_config=engine, optimizer_config=optim,
        checkpoint_config=CheckpointConfig(),
    )  # fmt: skip
    w = TrainingWorker(config)
    w.reset()
    w.set_loss_fn(partial(ppo_loss, config=actor))
    return w


rows = grpo_rollouts  # GRPO-shaped (prompt, response) token lists


def agent_loop_fields(td: TensorDict, rollouts) -> TensorDict:
    """The per-row ``multi_modal_inputs`` veRL's v1 agent loop writes for every row (text rows: what
    its own ``_compute_multi_modal_inputs`` returns without a processor, an empty dict)."""
    from types import SimpleNamespace

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils import tensordict_utils as tu

    worker = SimpleNamespace(processor=None)
    rows = [
        AgentLoopWorker._compute_multi_modal_inputs(
            worker, SimpleNamespace(multi_modal_data=None), torch.tensor(p + r)
        )
        for p, r in rollouts
    ]
    tu.assign_non_tensor_stack(td, "multi_modal_inputs", rows)
    return td


def batch(
    rollouts,
    seed: int = 0,
    kl: bool = False,
    is_weights: bool = False,
    positions: list | None = None,
    response_masks: list[list[int]] | None = None,
) -> TensorDict:
    """The rollouts as veRL's trainer hands them to the actor (no-padding layout, response tensors).
    ``positions``: per row, its ``[4, len(p) + len(r)]`` position ids as veRL's agent loop computes
    them for an M-RoPE model (text positions, then the three M-RoPE rows); default: text positions.
    ``response_masks``: per row, its agent loop's ``response_mask`` (``[len(r)]``, 0 over tool and
    user tokens), applied as veRL's ``_agent_loop_postprocess`` applies it (the attention mask keeps
    those tokens; the response mask, and so the loss, drops them); default: every response token."""
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(1000 + seed)
    B = len(rollouts)
    P = max(len(p) for p, _ in rollouts)
    R = max(len(r) for _, r in rollouts)
    ids, mask = left_padded(rollouts)
    response_mask = mask[:, P:].clone()
    for b, m in enumerate(response_masks or []):
        response_mask[b, : len(m)] *= torch.tensor(m)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    if positions is not None:  # [B, 4, P + R], each row's own placed at its real tokens
        position_ids = torch.zeros(B, 4, P + R, dtype=torch.long)
        for b, ((p, r), pos) in enumerate(zip(rollouts, positions, strict=True)):
            position_ids[b, :, P - len(p) : P + len(r)] = pos
    fields = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "prompts": ids[:, :P],
        "responses": ids[:, P:],
        "response_mask": response_mask,
        "old_log_probs": (torch.randn(B, R, generator=g) * 0.2 - 5.5) * response_mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, R) * response_mask,
    }
    if kl:
        fields["ref_log_prob"] = (torch.randn(B, R, generator=g) * 0.2 - 5.5) * response_mask
    if is_weights:
        fields["rollout_is_weights"] = (0.5 + torch.rand(B, R, generator=g)) * response_mask
    return left_right_2_no_padding(TensorDict(fields, batch_size=[B]))


def update(w, td: TensorDict, mini_batch: int, entropy: bool, temperature: float = 1.0):
    """One ``update_actor`` call (as veRL's trainer makes it); returns the metrics (None on a rank
    veRL does not collect from: a Ulysses group's ranks after its first)."""
    from verl.utils import tensordict_utils as tu

    td = td.clone()
    tu.assign_non_tensor(
        td, calculate_entropy=entropy, global_batch_size=mini_batch, mini_batch_size=mini_batch, epochs=1, seed=42,
        dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=temperature,
    )  # fmt: skip
    out = w.train_mini_batch(td)
    return None if out is None else tu.get(out, "metrics")


def log_probs(w, td: TensorDict, entropy: bool = True, temperature: float = 1.0):
    """``compute_log_prob`` as veRL's trainer makes it: response log-probs (and entropies), padded
    (Nones on a rank veRL does not collect from)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    td = td.clone()
    tu.assign_non_tensor(td, calculate_entropy=entropy, compute_loss=False, temperature=temperature)
    out = w.infer_batch(td)
    if out is None:  # a rank veRL does not collect from (a Ulysses group's ranks after its first)
        return None, None, None
    lp = no_padding_2_padding(tu.get(out, "log_probs"), td)
    ent = no_padding_2_padding(tu.get(out, "entropy"), td) if entropy else None
    return lp, ent, tu.get(out, "metrics")


def parameters(w) -> dict[str, torch.Tensor]:
    """Worker ``w``'s parameters, whole (FSDP2's shards gathered)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in w.engine.module.named_parameters()
    }


def train(w, rollouts, steps: int = 2, mini_batch: int = 8, entropy: bool = True, **batch_kw) -> list:
    """Equals stock's entry point: ``steps`` ``update_actor`` calls of worker ``w`` (stock veRL's or
    forkrl's: its :func:`actor_config`) on :func:`batch` ``(rollouts, seed=step, **batch_kw)``;
    returns each call's metrics. The final parameters: :func:`parameters`."""
    return [update(w, batch(rollouts, seed=step, **batch_kw), mini_batch, entropy) for step in range(steps)]
