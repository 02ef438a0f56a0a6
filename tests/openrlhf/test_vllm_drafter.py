"""forkrl's self-drafter inside vLLM (0.29, the version OpenRLHF pins; this environment has its CPU build).

These tests build vLLM's real Qwen2 model, its weight loaders, its ``SpeculativeConfig`` /
``VllmConfig`` and its layerwise reload functions directly, with forkrl's vLLM plugin
(:mod:`forkrl.plugins.vllm`: its quantization method and :class:`DrafterMirror`), to reach what a
running engine does not show (a reload, a mismatched target, each tensor's kernel). The one
stand-in is the model runner (a namespace with the attributes ``install_mirror`` reads, whose names
the contract test checks on vLLM's ``GPUModelRunner``); attention is never run, so the platform's
attention-backend lookup is pointed at FlexAttention to build the layers. Models are built with
the plugin's dense CPU linears, as a CPU engine with forkrl's drafter builds them. Real engines:
``test_vllm_cpu_engine.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import types
from importlib.metadata import entry_points

import pytest
import torch

pytest.importorskip("vllm")

from forkrl.core.compat import Private  # noqa: E402
from forkrl.core.quant import QuantLinear  # noqa: E402
from forkrl.core.speculative import SpeculativeOptions  # noqa: E402
from forkrl.core.testing.group import free_port  # noqa: E402
from forkrl.plugins import vllm as fv  # noqa: E402
from forkrl.plugins.vllm import compat as vllm_compat  # noqa: E402
from forkrl.plugins.vllm import speculative as ve  # noqa: E402

LAYER = "model.layers.{i}.{part}"
HF_PARTS = {  # vLLM's fused layers -> the Hugging Face weights stacked into them, in order
    "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "self_attn.o_proj": ["self_attn.o_proj"],
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.down_proj": ["mlp.down_proj"],
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny Qwen2 checkpoint on disk, vLLM's distributed state (1 gloo rank), the plugin registered."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.platforms import current_platform

    path = tmp_path_factory.mktemp("qwen2")
    cfg = Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    platform = type(current_platform)
    saved = platform.__dict__.get("get_attn_backend_cls")
    platform.get_attn_backend_cls = classmethod(
        lambda cls, *a, **k: "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend"
    )
    fv.register()
    target_config = ModelConfig(
        model=str(path), dtype=torch.float32, skip_tokenizer_init=True, enforce_eager=True
    )
    port = free_port()
    with set_current_vllm_config(
        VllmConfig(model_config=target_config, device_config=DeviceConfig(device="cpu"))
    ):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1)
    yield types.SimpleNamespace(path=str(path), target_config=target_config)
    if saved is None:
        del platform.get_attn_backend_cls
    else:
        platform.get_attn_backend_cls = saved


def _options(bits: int = 4, group: int | None = 32, k: int = 3) -> SpeculativeOptions:
    return SpeculativeOptions(
        speculative_rollout=True, speculative_bits=bits, speculative_group_size=group if bits == 4 else None,
        speculative_policy="always", speculative_draft_len=k,
    )  # fmt: skip


def _draft_config(env, bits: int, group: int | None):
    from vllm.config import ParallelConfig, SpeculativeConfig

    spec = ve.vllm_speculative_config(_options(bits, group), env.path, tensor_parallel_size=1)
    return SpeculativeConfig(
        **spec, target_model_config=env.target_config, target_parallel_config=ParallelConfig()
    )


def _build(model_config, state: dict[str, torch.Tensor]):
    """A vLLM model built and loaded the way vLLM's default loader does (weights, then processing),
    with dense linear weights as the plugin keeps them in an engine with forkrl's drafter."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    fv._dense_cpu_linears()  # for the rest of this process, as in a worker with forkrl's drafter
    with set_current_vllm_config(vllm_config):
        model = initialize_model(vllm_config)
        model.load_weights(iter(state.items()))
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    return model, vllm_config


def _checkpoint(env) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{env.path}/model.safetensors")


def _updated(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """An optimizer step's worth of change to every weight."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in state.items()}


def _expected(state: dict[str, torch.Tensor], i: int, part: str, bits: int, group: int | None) -> QuantLinear:
    """forkrl's QuantLinear of the Hugging Face weights a vLLM fused layer stacks."""
    w = torch.cat([state[LAYER.format(i=i, part=p) + ".weight"] for p in HF_PARTS[part]])
    q = QuantLinear(
        w.shape[1], w.shape[0], bits=bits, group_size=group or w.shape[1], out_dtype=torch.float32
    )
    q.load_(w)
    return q


def _assert_drafter_is(drafter, state, bits, group, cfg_layers=2):
    for i in range(cfg_layers):
        for part in HF_PARTS:
            layer = drafter.get_submodule(LAYER.format(i=i, part=part))
            want = _expected(state, i, part, bits, group)
            assert not layer.forkrl_dense
            assert torch.equal(layer.quant_method.dequantized(layer), want.dequantize()), (i, part)
            x = torch.randn(5, want.in_features)
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
            biases = [state.get(LAYER.format(i=i, part=p) + ".bias") for p in HF_PARTS[part]]
            ref = want(x) if biases[0] is None else want(x) + torch.cat(biases)
            assert torch.equal(y, ref), (i, part)  # the same kernel on the same codes, then the bias
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(drafter.get_parameter(name), state[name]), name
    bias = drafter.get_parameter("model.layers.0.self_attn.qkv_proj.bias")
    want_bias = torch.cat([state[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(bias, want_bias)


def _runner(target, drafter, spec):
    """The attributes of vLLM's GPUModelRunner that install_mirror reads (names checked in test_contract)."""
    calls = []
    proposer = types.SimpleNamespace(model=drafter, propose=lambda *a, **k: calls.append(a) or "drafts")
    runner = types.SimpleNamespace(
        speculative_config=spec, drafter=proposer, get_model=lambda: target, get_draft_model=lambda: drafter
    )
    return runner, calls


@pytest.mark.parametrize("private", vllm_compat.PRIVATES, ids=lambda p: p.name)
def test_vllm_private_is_where_the_plugin_expects_it(private):
    """Each vLLM private forkrl's plugin relies on (:data:`forkrl.plugins.vllm.compat.PRIVATES`)."""
    assert isinstance(private, Private) and private.host == "vLLM" and private.checked == vllm_compat.CHECKED
    private.check()


def test_contract():
    """The plugin's registration in the installed vLLM: its entry point, its quantization methods under
    forkrl's names, and the runner's load_model wrapped once (the privates it reads: test above)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("forkrl") == "forkrl.plugins.vllm:register"
    fv.register()
    fv.register()  # idempotent: vLLM loads plugins once per process, but several entry points may call it
    assert getattr(GPUModelRunner.load_model, "_forkrl_wrapped", False)
    assert GPUModelRunner.load_model.__wrapped__.__qualname__ == "GPUModelRunner.load_model"
    for name, (bits, group) in ve.QUANT_METHODS.items():
        assert name in QUANTIZATION_METHODS
        cls = get_quantization_config(name)
        assert (cls().get_name(), cls.bits, cls.group_size) == (name, bits, group)


def test_speculative_config_through_vllm(env):
    """forkrl's config builds vLLM's own SpeculativeConfig: a draft model of the policy, forkrl's quantization."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    spec = _draft_config(env, 4, 64)
    assert spec.method == "draft_model" and spec.num_speculative_tokens == 3
    assert spec.draft_model_config.model == env.path
    assert spec.draft_model_config.quantization == "forkrl_int4_g64"
    target = VllmConfig(model_config=env.target_config, device_config=DeviceConfig(device="cpu"))
    # DraftModelProposer._create_draft_vllm_config: the target's config with the draft model's, quant_config reset.
    assert "quant_config=None" in inspect.getsource(DraftModelProposer._create_draft_vllm_config)
    quant = dataclasses.replace(target, quant_config=None, model_config=spec.draft_model_config).quant_config
    assert target.quant_config is None
    assert (quant.get_name(), quant.bits, quant.group_size) == ("forkrl_int4_g64", 4, 64)
    assert ve.vllm_speculative_config(_options(8, None), "m")["quantization"] == "forkrl_int8"


def test_auto_schedule_is_accepted_by_vllm(env):
    """forkrl's cost-model table becomes vLLM's num_speculative_tokens_per_batch_size, which vLLM's own
    validation and SpeculativeConfig accept; a table of zeros means no speculative config."""
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    auto = SpeculativeOptions(speculative_rollout=True, speculative_group_size=32)
    schedule = [(1, 4, 6), (5, 16, 2), (17, 64, 0)]
    cfg = ve.vllm_speculative_config(auto, env.path, 1, schedule)
    assert cfg["num_speculative_tokens"] == 6
    lookup = build_dynamic_sd_schedule_lookup(cfg["num_speculative_tokens_per_batch_size"], 64, 6)
    assert lookup[1] == lookup[4] == 6 and lookup[5] == lookup[16] == 2 and lookup[17] == lookup[64] == 0
    spec = SpeculativeConfig(
        **cfg, target_model_config=env.target_config, target_parallel_config=ParallelConfig()
    )
    assert spec.num_speculative_tokens == 6 and spec.draft_model_config.quantization == "forkrl_int4_g32"
    assert ve.vllm_speculative_config(auto, env.path, 1, [(1, 64, 0)]) is None


def test_speculative_config_refusals():
    auto = SpeculativeOptions(speculative_rollout=True)
    with pytest.raises(ValueError, match="speculative_policy='always'"):
        ve.vllm_speculative_config(auto, "m")  # no table: the host cannot time the policy
    with pytest.raises(ValueError, match="speculative_rollout=True"):
        ve.vllm_speculative_config(SpeculativeOptions(), "m")


@pytest.mark.parametrize("bits,group", [(4, 32), (8, None)])
def test_drafter_equals_quantized_policy_after_every_sync(env, bits, group):
    """Loaded from the checkpoint, then after two syncs into the target: the drafter is exactly forkrl's
    quantization of the synced weights (codes, scales, kernel outputs, dense tensors), in the same storage."""
    state = _checkpoint(env)
    spec = _draft_config(env, bits, group)
    target, _ = _build(env.target_config, state)
    drafter, _ = _build(spec.draft_model_config, state)
    _assert_drafter_is(drafter, state, bits, group)
    runner, calls = _runner(target, drafter, spec)
    mirror = fv.install_mirror(runner)
    assert runner.forkrl_mirror is mirror and len(mirror.quantized) == 8
    storage = {n: b.data_ptr() for n, b in drafter.named_buffers() if "forkrl_" in n}
    assert storage
    for step in (1, 2):
        new = _updated(state, step)
        for (
            name,
            t,
        ) in new.items():  # one tensor per call, as TRL's colocate sync and OpenRLHF's WorkerWrap do
            target.load_weights([(name, t)])
        assert mirror.stale
        with pytest.raises(AssertionError):  # not yet re-synced: the drafter still holds the old policy
            _assert_drafter_is(drafter, new, bits, group)
        assert runner.drafter.propose("batch") == "drafts" and calls[-1] == ("batch",)
        assert not mirror.stale and mirror.syncs == step
        _assert_drafter_is(drafter, new, bits, group)
        assert {n: b.data_ptr() for n, b in drafter.named_buffers() if "forkrl_" in n} == storage
        state = new
    runner.drafter.propose("again")
    assert mirror.syncs == 2  # nothing loaded since: no re-sync


def test_vllm_layerwise_reload_requantizes_in_place(env):
    """vLLM's own reload of a draft model (the path of its start_draft_weight_update) re-runs forkrl's
    quantization into the existing buffers: same result as the mirror, same storage."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    state = _checkpoint(env)
    spec = _draft_config(env, 4, 32)
    drafter, vllm_config = _build(spec.draft_model_config, state)
    storage = {n: b.data_ptr() for n, b in drafter.named_buffers() if "forkrl_" in n}
    new = _updated(state, 7)
    with set_current_vllm_config(vllm_config):
        initialize_layerwise_reload(drafter)
        drafter.load_weights(iter(new.items()))
        finalize_layerwise_reload(drafter, spec.draft_model_config)
    _assert_drafter_is(drafter, new, 4, 32)
    assert {n: b.data_ptr() for n, b in drafter.named_buffers() if "forkrl_" in n} == storage


def test_mirror_refuses_a_target_of_another_shape(env, tmp_path):
    """A draft model that is not the served policy (here: another width) is refused, naming the tensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from vllm.config import ModelConfig

    cfg = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    other = ModelConfig(
        model=str(tmp_path), dtype=torch.float32, skip_tokenizer_init=True, enforce_eager=True
    )
    from safetensors.torch import load_file

    target, _ = _build(other, load_file(f"{tmp_path}/model.safetensors"))
    drafter, _ = _build(_draft_config(env, 4, 32).draft_model_config, _checkpoint(env))
    with pytest.raises(ValueError, match=r"qkv_proj: drafter \(256, 128\), target \(128, 64\)"):
        fv.DrafterMirror(target, drafter)
    assert "load_weights" not in vars(target)  # nothing was wrapped


def test_where_the_plugin_cannot_install_it_logs_why_and_the_drafter_is_refused(monkeypatch, caplog):
    """vLLM calls the plugin bare in every engine of an environment with forkrl installed, speculation
    or not: where a vLLM release has moved what it needs (here the model runner's module), raising
    would stop every engine. It logs why instead; the hosts' check refuses forkrl's drafter, naming
    the vLLM, before any engine starts; with nothing missing it installs again."""
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)
    with caplog.at_level(logging.WARNING, logger=fv.__name__):
        fv.register()
    assert "does not install in vLLM 0.29.0 (ModuleNotFoundError: " in caplog.text
    assert "this engine runs without forkrl's drafter" in caplog.text
    with pytest.raises(
        ValueError,
        match=r"in vLLM 0\.29\.0 \(ModuleNotFoundError: .*checked against vllm 0\.29\.0: .*, or FIX$",
    ):
        fv.check_installs("FIX")
    monkeypatch.undo()
    fv.check_installs("FIX")
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert "forkrl_int8" in QUANTIZATION_METHODS


def test_a_vllm_whose_runner_lacks_what_the_mirror_reads_is_refused(monkeypatch):
    """A vLLM where the plugin installs but the runner has no ``get_draft_model`` (as before 0.25) would
    stop each engine with forkrl's drafter as it loads: the hosts' check refuses the drafter first,
    naming the private and the vLLMs it works with; with it back the check passes."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.delattr(GPUModelRunner, "get_draft_model")
    with pytest.raises(ValueError) as refused:
        fv.check_installs("FIX")
    message = str(refused.value)
    assert (
        "does not install in vLLM 0.29.0 (GPUModelRunner.load_model / get_model / get_draft_model: "
        in message
    )
    assert message.endswith(f"install a vLLM from {vllm_compat.WORKS_WITH}, or FIX")
    monkeypatch.undo()
    fv.check_installs("FIX")


def test_a_vllm_before_029_is_refused(monkeypatch):
    """vLLM 0.24-0.28 (veRL 0.9.1's ``vllm`` extra pins 0.24) cannot build a quantized draft model from a
    checkpoint without a quantization config: every engine with forkrl's drafter stopped as it loaded.
    The check refuses them by version, before any engine starts."""
    monkeypatch.setattr(fv, "installed_vllm_version", lambda: "0.24.0")
    monkeypatch.setattr(fv, "installed_vllm_release", lambda: (0, 24))
    with pytest.raises(
        ValueError, match=r"in vLLM 0\.24\.0 \(forkrl's drafter needs vLLM 0\.29 or later: .*get_quant_config"
    ):
        fv.check_installs("FIX")


def test_no_mirror_without_a_forkrl_drafter():
    spec = types.SimpleNamespace(method="draft_model", quantization="fp8")
    runner = types.SimpleNamespace(speculative_config=spec, drafter=object())
    assert fv.install_mirror(runner) is None
    assert fv.install_mirror(types.SimpleNamespace(speculative_config=None)) is None


def test_spec_decode_metrics_from_vllm_counters():
    """vLLM's counters (its metrics reader's types) -> spec/* figures between two snapshots."""
    from vllm.v1.metrics.reader import Counter

    def snap(drafts, tokens, accepted):
        names = ve._SPEC_COUNTERS
        return [
            Counter(name=names["drafts"], labels={}, value=drafts),
            Counter(name=names["draft_tokens"], labels={}, value=tokens),
            Counter(name=names["accepted"], labels={}, value=accepted),
            Counter(name="vllm:prompt_tokens", labels={}, value=99),
        ]

    before, after = ve.spec_counters(snap(10, 40, 20)), ve.spec_counters(snap(30, 120, 80))
    m = ve.spec_decode_metrics(before, after)
    assert m == {"spec/acceptance": 60 / 80, "spec/draft_len": 4.0, "spec/mean_accepted_length": 1 + 60 / 20}
    assert ve.spec_decode_metrics(after, after) == {}
