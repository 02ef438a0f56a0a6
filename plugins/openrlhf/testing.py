"""Real OpenRLHF in this process on the CPU, for tests and benchmarks: its ActorPPOTrainer (stock, or forkrl's subclass) around a real
DeepSpeed ZeRO engine, fed experiences through its own replay buffer and ``ppo_train``.

:func:`start` (idempotent; :func:`trainer` calls it at first use) starts the gloo group the engine
trains in (:func:`forkrl.core.testing.group.start_gloo`). OpenRLHF assumes CUDA in a few places that
have nothing to do with the training math; the :func:`cpu` context covers them: ``torch.cuda.current_device()`` answers ``"cpu"`` (``ppo_train``
moves experiences there), ``torch.cuda.set_device`` does nothing, the replay buffer's sampling
device is the CPU, the trainer's barrier
skips ``torch.cuda.synchronize``, and the strategy's device mesh is a CPU mesh. The arguments come
from a real OpenRLHF command line parsed by OpenRLHF's own ``__main__`` (forkrl's dry run). The
engine is DeepSpeed's, built from OpenRLHF's own DeepSpeed config (``get_ds_train_config``), in
float32 (OpenRLHF's ``--ds.param_dtype`` allows bf16/fp16 only, whose rounding would hide the
comparison) with torch's SGD as the optimizer, so the parameter change is the gradient itself.
Equals stock: :func:`train` either side, :func:`parameters`, :func:`agreement` (the comparison of
:mod:`forkrl.core.testing.stock`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from unittest import mock

import deepspeed
import torch
import torch.distributed as dist
from openrlhf.models import Actor
from openrlhf.trainer.ppo_utils import NaiveReplayBuffer
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ray import ppo_actor
from openrlhf.utils import get_strategy
from openrlhf.utils.deepspeed import deepspeed as ds_module

from forkrl.core.testing.group import start_gloo
from forkrl.core.testing.models import byte_llama, byte_tokenizer, grpo_rollouts, save_pretrained
from forkrl.core.testing.stock import relative_difference, update_size

from ..deepspeed import gathered
from .train_ppo_ray import parse_args
from .trainer import TreeActorPPOTrainer


def start() -> None:
    """Start the gloo group :func:`trainer`'s engine trains in, unless one is running (idempotent):
    a launcher's ranks (torchrun, ``run_on_ranks``), else this process alone."""
    start_gloo()


class _CPUReplayBuffer(NaiveReplayBuffer):
    def __init__(self, *args, **kwargs) -> None:
        with mock.patch("torch.cuda.current_device", return_value=0):
            super().__init__(*args, **kwargs)
        self.target_device = torch.device("cpu")


@contextlib.contextmanager
def cpu() -> Iterator[None]:
    """OpenRLHF's CUDA assumptions (outside the training math) pointed at the CPU."""
    real_mesh = ds_module.init_device_mesh
    with (
        mock.patch("torch.cuda.current_device", return_value="cpu"),
        mock.patch("torch.cuda.set_device"),
        mock.patch.object(ppo_actor, "NaiveReplayBuffer", _CPUReplayBuffer),
        mock.patch.object(ppo_actor, "torch_dist_barrier_and_cuda_sync", dist.barrier),
        mock.patch.object(ds_module, "init_device_mesh", lambda _device, *a, **k: real_mesh("cpu", *a, **k)),
    ):
        yield


def save_model(path) -> str:
    return save_pretrained(byte_llama(0), byte_tokenizer(), path)


def lora_model(path: str, args, seed: int = 7) -> torch.nn.Module:
    """The model at ``path`` wrapped for LoRA as OpenRLHF's ``PolicyModelActor`` has ``Actor`` wrap it
    (``--ds.lora.rank/alpha/target_modules/dropout``: peft's ``get_peft_model`` inside ``Actor``), its
    adapters initialised from ``seed``; float32 (``Actor`` loads in ``--ds.param_dtype``, bf16 or fp16)."""
    torch.manual_seed(seed)
    lora = args.ds.lora
    actor = Actor(
        path,
        attn_implementation="sdpa",
        param_dtype=args.ds.param_dtype,
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=lora.target_modules,
        lora_dropout=lora.dropout,
    )
    return actor.model.float()


def command(model_path: str, *extra: str, micro_batch: int = 2, batch: int = 8) -> list[str]:
    """An OpenRLHF GRPO command line for the tiny model (vLLM engines named, as every real run has)."""
    return [
        "--actor.model_name_or_path", model_path, "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1",
        "--ref.num_gpus_per_node", "1", "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4",
        "--rollout.micro_batch_size", "4", "--train.micro_batch_size", str(micro_batch), "--train.batch_size",
        str(batch), "--algo.advantage.estimator", "group_norm", "--ds.zero_stage", "2", *extra,
    ]  # fmt: skip


def trainer(
    args,
    forkrl: bool,
    lr: float = 0.05,
    model: torch.nn.Module | None = None,
    bf16: bool = False,
    vlm: bool = False,
):
    """Stock ``ActorPPOTrainer`` (``forkrl=False``) or forkrl's, built as ``PolicyModelActor`` builds
    it, around a DeepSpeed engine of ``model`` (default: the byte Llama, seed 0); float32 unless
    ``bf16`` (DeepSpeed's bf16 mode, OpenRLHF's default ``--ds.param_dtype``). ``vlm``: ``model`` is
    a vision-language model, marked as ``Actor`` marks one it loads by name (``is_vlm``, ``_vlm_config``)."""
    start()
    strategy = get_strategy(args)
    with cpu():
        strategy.setup_distributed()
    actor = Actor(model if model is not None else byte_llama(0), temperature=args.rollout.temperature)
    if vlm:  # Actor.__init__ sets these only when it loads the model from a name
        actor.is_vlm, actor._vlm_config = True, actor.model.config
    # Actor sets packing_samples only when it loads the model itself. OpenRLHF's packed layout
    # (--ds.packing_samples, forced on by --train.dynamic_batch_enable) needs flash-attention
    # varlen, which forces attn_implementation=flash_attention_2 and whose kernels a CPU lacks: sdpa
    # on a packed row is a different computation (3e-2 off). So the stock actor runs unpacked here,
    # the same math as packed on a GPU; its packed layout is a GPU check.
    actor.packing_samples = False
    if args.actor.gradient_checkpointing_enable:  # as PolicyModelActor.init_model_from_pretrained does
        actor.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.actor.gradient_checkpointing_reentrant}
        )
    config = strategy.get_ds_train_config(max_norm=0.0)
    config["bf16"] = {"enabled": bf16}
    config.pop("fp16", None)
    config["zero_allow_untested_optimizer"] = True
    if config["zero_optimization"]["stage"] == 3:  # partition every parameter of the tiny model
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, optim, _, scheduler = deepspeed.initialize(
        model=actor.model,
        # the trainable parameters, as OpenRLHF's optimizer takes them (a LoRA model's adapters)
        optimizer=torch.optim.SGD([p for p in actor.model.parameters() if p.requires_grad], lr=lr),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
        config=config,
    )
    actor.model = engine
    cls = TreeActorPPOTrainer if forkrl else ppo_actor.ActorPPOTrainer
    if not forkrl:
        args = _without_forkrl(args)
        strategy.args = args
    with cpu():
        return cls(
            strategy,
            actor,
            ema_model=None,
            actor_optim=optim,
            actor_scheduler=scheduler,
            micro_train_batch_size=args.train.micro_batch_size,
            tokenizer=None,
            dataloader_pin_memory=False,
            vllm_engines=None,
        )


def _without_forkrl(args):
    args = copy.deepcopy(args)
    if hasattr(args, "forkrl"):
        del args.forkrl
    return args


rollouts = grpo_rollouts  # GRPO-shaped (prompt, response) token lists


def experience(rows, seed: int = 0, kl: bool = True, per_token: bool = False) -> Experience:
    """One rollout micro-batch as OpenRLHF's experience maker builds it: ``[left-padded prompt |
    right-padded response]``, ``[B, num_actions]`` log-probs, advantages (per sequence, GRPO, or per
    token, PPO/GAE), reference log-probs, and per-sample info."""
    g = torch.Generator().manual_seed(1000 + seed)
    B = len(rows)
    P = max(len(p) for p, _ in rows)
    R = max(len(r) for _, r in rows)
    seq = torch.zeros(B, P + R, dtype=torch.long)
    att = torch.zeros_like(seq)
    for b, (p, r) in enumerate(rows):
        seq[b, P - len(p) : P], att[b, P - len(p) : P] = torch.tensor(p), 1
        seq[b, P : P + len(r)], att[b, P : P + len(r)] = torch.tensor(r), 1
    action = att[:, P:].bool()
    adv = torch.randn(B, R, generator=g) if per_token else torch.randn(B, 1, generator=g).expand(B, R)
    return Experience(
        sequences=seq,
        attention_mask=att,
        action_mask=action,
        action_log_probs=(torch.randn(B, R, generator=g) * 0.2 - 5.5) * action,
        base_action_log_probs=((torch.randn(B, R, generator=g) * 0.2 - 5.5) * action) if kl else None,
        advantages=adv * action,
        response_length=action.sum(-1).float(),
        total_length=att.sum(-1).float(),
        info={"reward": torch.randn(B, generator=g)},
    )


def fill(t, experiences) -> None:
    for e in experiences:
        t.replay_buffer.append(_copy(e))


def _copy(e: Experience) -> Experience:
    return copy.deepcopy(e)


def parameters(t) -> dict[str, torch.Tensor]:
    """The actor's parameters, whole (ZeRO-3 partitions gathered)."""
    module = t.actor.model.module
    partitions = [p for p in module.parameters() if hasattr(p, "ds_id")]
    with gathered(partitions):  # forkrl's gather: DeepSpeed's coalesced one is unreliable on gloo
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def train(args, rounds, forkrl: bool, kl_ctl: float = 0.0, model=None):
    """Equals stock's entry point: a :func:`trainer` (forkrl's, or OpenRLHF's without ``forkrl``),
    from ``model()`` (default the byte Llama, seed 0), trained on ``rounds`` (one list of experiences
    per ``ppo_train``, the DataLoader's shuffle seeded); returns it and each round's status. The final
    parameters: :func:`parameters`."""
    t = trainer(args, forkrl=forkrl, model=model() if model is not None else None)
    statuses = []
    for experiences in rounds:
        fill(t, experiences)
        torch.manual_seed(123)  # the DataLoader's shuffle
        with cpu():
            statuses.append(t.ppo_train(kl_ctl))
        t.replay_buffer.clear()
    return t, statuses


def agreement(stock, tree, model=None) -> tuple[float, float]:
    """``(|stock's update|, |tree - stock| / |stock's update|)`` over trainers ``stock`` and ``tree``'s
    parameters, from the initial weights ``model()`` (default ``byte_llama(0)``), in the Euclidean
    norm of all parameters together (:mod:`forkrl.core.testing.stock`, ``norm="l2"``)."""
    before = {n: p.detach() for n, p in (model or (lambda: byte_llama(0)))().named_parameters()}
    p_stock, p_tree = parameters(stock), parameters(tree)
    return update_size(p_stock, before, "l2"), relative_difference(p_stock, p_tree, before, "l2")


def policy_actor(t, cls):
    """A policy actor of class ``cls`` around trainer ``t``, as ``init_model_from_pretrained`` leaves it."""
    a = object.__new__(cls)
    a.actor, a.trainer, a.strategy = t.actor, t, t.strategy
    return a


def reference_actor(t, cls):
    """A reference actor of class ``cls`` on ``t``'s model, with the tree scorer its init builds."""
    from forkrl.core import TreeStep

    a = object.__new__(cls)
    a.model, a.strategy = t.actor, t.strategy
    a.tree_step = TreeStep(t.tree_options, temperature=t.actor.temperature, gather=gathered)
    return a


__all__ = [
    "agreement",
    "command",
    "cpu",
    "experience",
    "fill",
    "lora_model",
    "parameters",
    "parse_args",
    "policy_actor",
    "reference_actor",
    "rollouts",
    "save_model",
    "start",
    "train",
    "trainer",
]
