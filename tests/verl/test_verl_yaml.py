"""The override YAMLs, composed by veRL's own Hydra config and validated by veRL's own checks, build
forkrl's actor and reference configs (so a wrong key fails here, not in a user's cluster)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from forkrl.core import TreeOptions  # noqa: E402
from forkrl.plugins.verl import CONFIG_DIR  # noqa: E402
from forkrl.plugins.verl import testing as harness  # started by conftest.py

OVERRIDES = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return harness.save_model(tmp_path_factory.mktemp("verl-yaml-model"))


def _compose(name: str, model: str, extra: list[str] = (), stock: bool = False):
    """forkrl's YAML ``name`` as veRL's Hydra composes it; ``stock``: veRL's own ppo_trainer instead."""
    paths = [f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}"]
    if stock:
        import verl.trainer.config

        with initialize_config_dir(
            config_dir=os.path.dirname(verl.trainer.config.__file__), version_base=None
        ):
            return compose(config_name="ppo_trainer", overrides=[*paths, *extra])
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=name, overrides=[*OVERRIDES, *paths, *extra])


def _build(cfg):
    """Actor and reference configs exactly as veRL's ActorRolloutRefWorker.init_model builds them."""
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref_node = cfg.actor_rollout_ref.ref
    with open_dict(ref_node):
        ref_node.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref_node.ppo_micro_batch_size = ref_node.pop("log_prob_micro_batch_size", None)
        ref_node.ppo_micro_batch_size_per_gpu = ref_node.pop("log_prob_micro_batch_size_per_gpu", None)
        ref_node.use_dynamic_bsz = ref_node.pop("log_prob_use_dynamic_bsz", False)
        ref_node.ppo_max_token_len_per_gpu = ref_node.pop("log_prob_max_token_len_per_gpu", None)
    return actor, omega_conf_to_dataclass(ref_node)


@pytest.mark.parametrize("name", ["forkrl_tree", "forkrl_long_context"])
def test_ray_init_reaches_ray_as_veRL_passes_it(name, model_path, monkeypatch):
    """veRL hands ``ray_kwargs.ray_init`` to Ray without resolving interpolations
    (``OmegaConf.to_container`` in ``main_ppo.run_ppo``): forkrl's YAML must put nothing there that only
    a resolver makes valid, and must leave the workers' ``VERL_USE_EXTERNAL_MODULES`` to the user. (An
    earlier YAML set it through a resolver; the workers received the literal ``${...}`` and every run
    failed at TaskRunner start, which only the end-to-end run found.)"""
    from omegaconf import OmegaConf

    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "my_platform")
    stock = _compose(name, model_path, stock=True)
    cfg = _compose(name, model_path)
    as_verl_passes_it = OmegaConf.to_container(cfg.ray_kwargs.ray_init)
    assert "${" not in repr(as_verl_passes_it)
    assert as_verl_passes_it == OmegaConf.to_container(stock.ray_kwargs.ray_init)


def test_the_config_class_registers_the_engine_without_plugin_discovery():
    """A worker that builds forkrl's config from the YAML's ``_target_`` finds the engine with veRL's
    plugin discovery off and no VERL_USE_EXTERNAL_MODULES."""
    code = (
        "import forkrl.plugins.verl.config\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "from forkrl.plugins.verl.engine import BACKEND\n"
        "print(BACKEND in EngineRegistry._engines['language_model'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env.update(VERL_USE_EXTERNAL_PLUGINS="none", VERL_ENGINE_DEVICE="cuda")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_importing_the_engine_before_verl_registers_it_without_a_plugin_failure():
    """A script that imports forkrl's engine before anything of veRL's: the engine's first ``verl``
    import makes veRL load its plugins, forkrl's among them, while the engine module is half-built.
    The engine registers once, and no "plugin failed to load" error is logged."""
    code = (
        "import forkrl.plugins.verl.engine\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "print(sorted(EngineRegistry._engines['language_model']['fsdp2_tree']))\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed to load" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['cuda', 'npu']"


@pytest.mark.parametrize("name", ["forkrl_tree", "forkrl_long_context"])
def test_yaml_builds_forkrl_configs_and_passes_verl_validation(name, model_path):
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    cfg = _compose(name, model_path)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor, ref = _build(cfg)
    for config in (actor, ref):
        assert type(config).__name__ == "ForkrlFSDPActorConfig"
        assert config.strategy == "fsdp2" and config.engine.strategy == "fsdp2_tree"
        assert isinstance(config.engine.forkrl, TreeOptions) and config.engine.forkrl.tree_enabled
    if name == "forkrl_long_context":
        assert actor.engine.forkrl.long_context_replay and actor.engine.forkrl.tree_block_size == 2048


@pytest.mark.parametrize("name", ["forkrl_tree", "forkrl_long_context"])
def test_ulysses_sequence_parallelism_passes_verl_validation(name, model_path):
    """The override a Ulysses user already has (``ulysses_sequence_parallel_size=2`` on two GPUs)
    composes with forkrl's YAML and builds forkrl's engine (the update: ``test_verl_ulysses``)."""
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    extra = [
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.model.use_remove_padding=true",
    ]
    cfg = _compose(name, model_path, extra)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    for config in _build(cfg):
        assert config.engine.strategy == "fsdp2_tree" and config.engine.forkrl.tree_enabled
        assert config.engine.ulysses_sequence_parallel_size == 2


def test_a_wrong_forkrl_key_fails_when_veRL_builds_the_config(model_path):
    cfg = _compose("forkrl_tree", model_path, ["+actor_rollout_ref.actor.forkrl.tree_mod=keep"])
    with pytest.raises(Exception, match=r"unknown forkrl option\(s\) \['tree_mod'\]"):
        _build(cfg)
    cfg = _compose("forkrl_tree", model_path, ["actor_rollout_ref.actor.forkrl.tree_mode=fastest"])
    with pytest.raises(Exception, match="tree_mode='fastest' is not one of"):
        _build(cfg)


#: A valid, non-default value for every documented key (each overridden alone, without ``+``).
SET = {
    "tree_packing": ("false", False),
    "tree_mode": ("replay", "replay"),
    "tree_block_size": ("4096", 4096),
    "tree_replay_threshold": ("4096", 4096),
    "long_context_replay": ("true", True),
    "long_context_prompt_grad": ("none", "none"),
    "tree_balance": ("off", "off"),
}
NEEDS = {"long_context_prompt_grad": ["actor_rollout_ref.actor.forkrl.long_context_replay=true"]}


def test_every_documented_key_overrides_without_plus_and_the_reference_follows(model_path):
    """Every option of the docs' table is in the YAML with its default, so the plain override form
    works for the actor and the reference; the reference takes the actor's value unless set."""
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from forkrl.core.options import option_docs

    assert [d.name for d in option_docs(TreeOptions)] == list(SET)  # a new option needs a case here
    for key, (text, value) in SET.items():
        for side in ("actor", "ref"):
            cfg = _compose(
                "forkrl_tree",
                model_path,
                [f"actor_rollout_ref.{side}.forkrl.{key}={text}", *NEEDS.get(key, [])],
            )
            validate_config(
                config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
            )
            actor, ref = _build(cfg)
            assert ref.forkrl[key] == value, (side, key)  # set on the actor: the reference follows
            want = value if side == "actor" else dataclasses.asdict(TreeOptions(tree_packing=True))[key]
            assert actor.forkrl[key] == want, (side, key)


def test_a_wrong_reference_key_fails_on_the_driver_before_ray(model_path):
    """veRL's validate_config builds only the actor's config; the actor checks the reference's block."""
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    for override, match in [
        (
            "+actor_rollout_ref.ref.forkrl.tree_mod=keep",
            r"unknown forkrl option\(s\) \['tree_mod'\] in actor_rollout_ref.ref.forkrl",
        ),
        (
            "actor_rollout_ref.ref.forkrl.tree_mode=fastest",
            "actor_rollout_ref.ref.forkrl: tree_mode='fastest' is not one of",
        ),
    ]:
        cfg = _compose("forkrl_tree", model_path, [override])
        with pytest.raises(Exception, match=match):
            validate_config(
                config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
            )
    with pytest.raises(Exception, match="tree_mod"):  # without +: Hydra itself refuses the unknown key
        _compose("forkrl_tree", model_path, ["actor_rollout_ref.ref.forkrl.tree_mod=keep"])


def test_the_included_yamls_are_not_primary_configs(model_path):
    from hydra.errors import MissingConfigException

    for name in ("forkrl_base", "forkrl_speculative_base"):
        with pytest.raises(MissingConfigException):
            _compose(name, model_path)


def test_the_plugin_announces_itself_once_per_process_at_verls_log_level():
    """veRL's logging hides INFO; forkrl's one line reaches stderr anyway, once, and only when a
    config turns the tree on. No other logger changes level."""
    code = (
        "import logging\n"
        "from forkrl.plugins.verl import testing as h\n"
        "h.start()\n"
        "root, verl_level = logging.getLogger().level, logging.getLogger('verl').level\n"
        "h.actor_config(None)\n"
        "print('STOCK-BUILT', flush=True)\n"
        "h.actor_config({'tree_packing': True}, use_prefix_grouper=True)\n"
        "h.actor_config({'tree_packing': True, 'tree_mode': 'replay'})\n"
        "assert (logging.getLogger().level, logging.getLogger('verl').level) == (root, verl_level)\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("forkrl: veRL plugin active") == 1, out.stderr[-3000:]
    assert "fsdp2 actor trains and scores on prefix trees (tree_packing=True)" in out.stderr
    # veRL's own prefix sharing flag, set beside the tree, gets a word (it does not reach veRL's engine)
    assert "veRL's use_prefix_grouper is set" in out.stderr


def test_the_module_prints_the_config_dir():
    out = subprocess.run(
        [sys.executable, "-m", "forkrl.plugins.verl"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == str(CONFIG_DIR)
    assert (CONFIG_DIR / "forkrl_tree.yaml").exists()


def test_the_entry_point_registers_the_engine_in_a_fresh_process():
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "import os; os.environ['VERL_ENGINE_DEVICE'] = 'cuda'\n"
        "import verl\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "print('BACKENDS', sorted(EngineRegistry._engines['language_model']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fsdp2_tree" in out.stdout.split("BACKENDS")[1], out.stdout
    assert "forkrl: veRL plugin loaded" in out.stderr


@pytest.mark.parametrize("name", ["forkrl_speculative", "forkrl_tree_speculative"])
def test_speculative_yaml_passes_forkrls_drafter_to_vllm(name, model_path):
    """veRL's rollout config, as veRL builds it, carries to vLLM exactly forkrl's speculative config."""
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from forkrl.core.speculative import SpeculativeOptions
    from forkrl.plugins.vllm.speculative import vllm_speculative_config

    cfg = _compose(name, model_path, ["actor_rollout_ref.rollout.tensor_model_parallel_size=1"])
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    vllm_kwargs = rollout.engine_kwargs["vllm"]
    options = SpeculativeOptions(
        speculative_rollout=True, speculative_policy="always", speculative_draft_len=4
    )
    assert dict(vllm_kwargs["speculative_config"]) == vllm_speculative_config(options, model_path, 1)
    assert vllm_kwargs["disable_log_stats"] is False
    actor, _ = _build(cfg)
    tree = getattr(actor.engine, "forkrl", None)  # veRL's own actor config without forkrl_base
    assert (tree is not None and tree.tree_enabled) == (name == "forkrl_tree_speculative")


def test_the_readme_command_composes_and_passes_verl_validation():
    """The README's complete veRL command, pasted unchanged: Hydra composes it from forkrl's config
    folder, veRL's validate_config accepts it, and the actor it builds trains on trees."""
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from ..readme_commands import command

    argv = command("python -m verl.trainer.main_ppo", {'"$(python -m forkrl.plugins.verl)"': str(CONFIG_DIR)})
    assert argv[3:7] == ["--config-path", str(CONFIG_DIR), "--config-name", "forkrl_tree"], argv[:7]
    with initialize_config_dir(config_dir=argv[4], version_base=None):
        cfg = compose(config_name=argv[6], overrides=argv[7:])
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.actor_rollout_ref.rollout.n == 8 and cfg.algorithm.adv_estimator == "grpo"
    actor, ref = _build(cfg)
    assert actor.engine.forkrl.tree_enabled and ref.engine.forkrl.tree_enabled


def _validate(cfg) -> None:
    """veRL's driver-side check, as ``main_ppo.main`` runs it before ``ray.init``."""
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


#: Each setting forkrl's tree engine does not take, as a user writes it, and what the driver's
#: error must name (the block the user wrote and the way out).
REFUSED = {
    "actor param offload": (
        ["actor_rollout_ref.actor.fsdp_config.param_offload=true"],
        r"actor_rollout_ref\.actor\.fsdp_config\.param_offload=True.*set it to false.*"
        r"actor_rollout_ref\.actor\.forkrl\.tree_packing=false",
    ),
    "reference param offload": (
        ["actor_rollout_ref.ref.fsdp_config.param_offload=true"],
        r"actor_rollout_ref\.ref\.fsdp_config\.param_offload=True.*actor_rollout_ref\.ref\.forkrl\.tree_packing=false",
    ),
    "fp16": (
        [
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp16,reduce_dtype:fp32,buffer_dtype:fp32}"
        ],
        r"actor_rollout_ref\.actor\.fsdp_config\.mixed_precision\.param_dtype='fp16'.*use bf16",
    ),
    "reference fp16": (
        ["+actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype:fp16}"],
        r"actor_rollout_ref\.ref\.fsdp_config\.mixed_precision\.param_dtype='fp16'",
    ),
    "pad_to_length": (
        ["actor_rollout_ref.actor.pad_to_length=true"],
        r"actor_rollout_ref\.actor\.pad_to_length=True.*set it to false",
    ),
    "reference pad_to_length": (
        ["actor_rollout_ref.ref.pad_to_length=true"],
        r"actor_rollout_ref\.ref\.pad_to_length=True",
    ),
    "fused kernels": (
        ["actor_rollout_ref.model.use_fused_kernels=true"],
        r"actor_rollout_ref\.model\.use_fused_kernels=True.*set it to false",
    ),
    "distillation": (["distillation.enabled=true"], r"distillation\.enabled=True.*set it to false"),
    "sum of squared probabilities": (
        ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
        r"actor_rollout_ref\.actor\.calculate_sum_pi_squared=True",
    ),
    "LoRA": (
        # veRL's own LoRA check reads the rollout's name (vLLM's would import vLLM)
        ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.name=sglang"],
        r"does not train LoRA policies \(actor_rollout_ref\.model\.lora_rank=8\).*set lora_rank=0, or set "
        r"actor_rollout_ref\.actor\.forkrl\.tree_packing=false",
    ),
    "FSDP1": (
        ["actor_rollout_ref.actor.strategy=fsdp"],
        r"actor_rollout_ref\.actor\.strategy='fsdp': set strategy: fsdp2",
    ),
}


def test_tree_balance_on_with_one_rank_is_refused_on_the_driver(model_path):
    """An option without effect is an error: balancing needs several data-parallel ranks."""
    one = ["trainer.n_gpus_per_node=1", "trainer.nnodes=1", "actor_rollout_ref.actor.forkrl.tree_balance=on"]
    with pytest.raises(Exception, match=r"tree_balance: on balances rows.*this run has one"):
        _validate(_compose("forkrl_tree", model_path, one))
    _validate(
        _compose("forkrl_tree", model_path, [*one[:2], "actor_rollout_ref.actor.forkrl.tree_balance=auto"])
    )


@pytest.mark.parametrize("case", list(REFUSED))
def test_settings_the_tree_does_not_take_are_refused_on_the_driver(case, model_path):
    """Refused when veRL validates the config (``main_ppo.main``, before ``ray.init``), naming the
    block the user wrote; the same config with forkrl's engine off for that block passes."""
    overrides, match = REFUSED[case]
    with pytest.raises(Exception, match=match):  # Hydra wraps the config's ValueError
        _validate(_compose("forkrl_tree", model_path, overrides))
    side = "ref" if "reference" in case else "actor"
    _validate(
        _compose(
            "forkrl_tree", model_path, [*overrides, f"actor_rollout_ref.{side}.forkrl.tree_packing=false"]
        )
    )


def test_reference_settings_count_only_where_a_reference_runs(model_path):
    """veRL builds no reference without a KL term (and uses the actor without adapters under LoRA):
    its FSDP settings are then not forkrl's business."""
    offload = ["actor_rollout_ref.ref.fsdp_config.param_offload=true"]
    _validate(_compose("forkrl_tree", model_path, [*offload, "actor_rollout_ref.actor.use_kl_loss=false"]))
    with pytest.raises(Exception, match=r"actor_rollout_ref\.ref\.fsdp_config\.param_offload"):
        _validate(
            _compose(
                "forkrl_tree",
                model_path,
                [*offload, "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=true"],
            )
        )


def test_a_wrong_actor_value_is_named_under_the_actor(model_path):
    """The reference inherits the actor's keys: a bad actor value is reported under the block the
    user wrote, not under the reference that copied it."""
    cfg = _compose("forkrl_tree", model_path, ["actor_rollout_ref.actor.forkrl.tree_mode=kepp"])
    with pytest.raises(
        Exception, match=r"actor_rollout_ref\.actor\.forkrl: tree_mode='kepp' is not one of"
    ) as err:
        _validate(cfg)
    assert "actor_rollout_ref.ref" not in str(err.value)


@pytest.mark.parametrize("name", ["forkrl_speculative", "forkrl_tree_speculative"])
def test_speculative_rollouts_on_another_rollout_are_refused_on_the_driver(name, model_path):
    cfg = _compose(name, model_path, ["actor_rollout_ref.rollout.name=sglang"])
    with pytest.raises(
        Exception,
        match=r"actor_rollout_ref\.rollout\.name='sglang'.*set actor_rollout_ref\.rollout\.name=vllm",
    ):
        _validate(cfg)


def test_speculative_rollouts_are_refused_on_the_driver_where_forkrls_vllm_plugin_cannot_install(
    model_path, monkeypatch
):
    """A vLLM release that moved what forkrl's vLLM plugin needs (here the model runner's module):
    refused before Ray starts, not by an engine that does not know forkrl's quantization."""
    cfg = _compose("forkrl_speculative", model_path)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)
    with pytest.raises(
        Exception, match=r"does not install in vLLM 0\.29\.0.*use --config-name forkrl_tree \(tree training"
    ):
        _validate(cfg)


def test_verls_prefix_grouper_beside_the_tree_passes_validation(model_path):
    """veRL 0.9.1's ``use_prefix_grouper`` does not reach its engine (the contract test
    ``compat._prefix_grouper`` checks that), so it is accepted beside the tree; the update equals
    stock's with it set (``test_verl_engine``)."""
    cfg = _compose("forkrl_tree", model_path, ["actor_rollout_ref.actor.use_prefix_grouper=true"])
    _validate(cfg)
    actor, _ = _build(cfg)
    assert actor.use_prefix_grouper and actor.engine.forkrl.tree_enabled


@pytest.mark.parametrize("name", ["forkrl_tree", "ppo_trainer"])
def test_the_cpu_run_command_composes_and_passes_verl_validation(name, model_path, tmp_path):
    """``python -m forkrl.plugins.verl.cpu_run`` (docs/cpu.md): its command line is veRL's main_ppo
    with the CPU's settings and smoke sizes, a key the user passes replaces ours, and Hydra composes
    it from forkrl's folder (``ppo_trainer``: veRL's own) into a config veRL's driver accepts."""
    import verl.trainer.config

    from forkrl.plugins.verl import cpu_run

    data = [f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'val.parquet'}"]
    cmd = cpu_run.command(
        name, [*data, f"actor_rollout_ref.model.path={model_path}", "data.train_batch_size=4"]
    )
    assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"]
    assert ("--config-path" in cmd) == (name != "ppo_trainer")
    assert "data.train_batch_size=2" not in cmd and cmd[-1] == "data.train_batch_size=4"
    overrides = cmd[cmd.index("--config-name") + 2 :]
    folder = str(CONFIG_DIR) if name != "ppo_trainer" else os.path.dirname(verl.trainer.config.__file__)
    with initialize_config_dir(config_dir=folder, version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    _validate(cfg)
    assert cfg.actor_rollout_ref.rollout.name == cpu_run.ROLLOUT and cfg.data.train_batch_size == 4
    with pytest.raises(ValueError, match="drafts inside vLLM's engine"):
        cpu_run.command("forkrl_tree_speculative")
    env = cpu_run.environment({"VERL_USE_EXTERNAL_MODULES": "my_platform", "RAY_ADDRESS": "auto"})
    assert env["VERL_USE_EXTERNAL_MODULES"] == f"{cpu_run.HOST_MODULE},my_platform"
    assert env["VERL_PLATFORM"] == "forkrl_cpu" and "RAY_ADDRESS" not in env


@pytest.mark.parametrize("name", ["forkrl_tree_speculative", "ppo_trainer"])
def test_the_cpu_run_on_vllm_composes_and_refuses_what_vllms_cpu_build_lacks(name, tmp_path):
    """``--rollout vllm``: veRL's own vLLM rollout with the CPU's settings (eager, bf16, no sleep
    mode), the speculative configs allowed; refused before Ray: sleep mode, and a policy whose
    attention head dimension vLLM's CPU attention has no kernel for."""
    pytest.importorskip("vllm")
    import verl.trainer.config

    from forkrl.plugins.verl import cpu_run

    model = harness.save_model(tmp_path / "vllm", **harness.VLLM_SHAPE)
    data = [f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'val.parquet'}"]
    cmd = cpu_run.command(name, [*data, f"actor_rollout_ref.model.path={model}"], rollout="vllm")
    overrides = cmd[cmd.index("--config-name") + 2 :]
    folder = str(CONFIG_DIR) if name != "ppo_trainer" else os.path.dirname(verl.trainer.config.__file__)
    with initialize_config_dir(config_dir=folder, version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    _validate(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.name == "vllm" and rollout.enforce_eager and not rollout.enable_sleep_mode
    sleep = "++actor_rollout_ref.rollout.enable_sleep_mode=True"
    with pytest.raises(ValueError, match="sleep mode"):
        cpu_run.command(name, [f"actor_rollout_ref.model.path={model}", sleep], rollout="vllm")
    small = harness.save_model(tmp_path / "small")
    with pytest.raises(ValueError, match=r"head dimension \d+ .* pass --rollout hf"):
        cpu_run.command(name, [f"actor_rollout_ref.model.path={small}"], rollout="vllm")
    env = cpu_run.environment({}, rollout="vllm")
    assert env["FORKRL_VLLM_DENSE_CPU"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
