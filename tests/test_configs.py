"""Every Hydra config option composes, resolves and instantiates (options are discovered from
``configs/``, so a new YAML file is tested without editing this file)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

import videotrain.config.build as builder
from videotrain.data.loaders import READER_OPTIONS, build_data
from videotrain.data.transforms import clips_to_device
from videotrain.engine.inference import ExportSettings, PredictSettings
from videotrain.engine.optim import build_optimizer, warmup_cosine
from videotrain.engine.precision import Precision
from videotrain.engine.trainer import TrainerSettings, plan_steps
from videotrain.memory.base import MemoryStrategy
from videotrain.metrics.logger import WANDB_MODES
from videotrain.models.backbones import FrameBackbone
from videotrain.models.video import VideoClassifier

CONFIG_DIR = Path(builder.CONFIG_DIR)
CPU = torch.device("cpu")


def _groups() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for f in sorted(CONFIG_DIR.rglob("*.yaml")):
        group = f.parent.relative_to(CONFIG_DIR).as_posix()
        if group != ".":
            groups.setdefault(group, []).append(f.stem)
    return groups


GROUPS = _groups()
# hydra/* groups configure Hydra itself (launchers), not the job: tested on their own below
OPTIONS = [(g, o) for g, opts in GROUPS.items() for o in opts if not g.startswith("hydra/")]


def _select(group: str, option: str) -> str:
    return f"+{group}={option}" if group in ("exp", "sweep") else f"{group}={option}"


def test_discovery_found_the_known_groups() -> None:
    # a guard for the discovery itself: these must exist, more may be added
    for group, option in [("data", "synthetic"), ("data", "kinetics"), ("data", "folder"),
                          ("model/backbone", "resnet10"), ("model/head", "tconv"),
                          ("memory", "e2e"), ("optim", "adamw"), ("sched", "cosine"),
                          ("trainer", "default"), ("logger", "wandb"), ("exp", "synthetic_e2e")]:
        assert option in GROUPS.get(group, []), (group, option)


@pytest.fixture(scope="module")
def finetune_source(compose_cfg, tmp_path_factory) -> Path:
    """A 5-class state dict of the fine-tuning experiments' model (resnet50 + transformer head),
    for their required ``model.init_from``: the tiny datasets have 4 classes, so the head is
    re-initialised and the backbone loaded."""
    cfg = compose_cfg(["+exp=ucf101_finetune", "model.init_from=unused", "data.root=unused"])
    path = tmp_path_factory.mktemp("finetune") / "kinetics5.pt"
    torch.save(builder.build_model(cfg, num_classes=5, init=False).state_dict(), path)
    return path


@pytest.fixture
def tiny_cfg(compose_cfg, layout_root, isolated_env: Path, tiny_synthetic_overrides, request):
    """Compose with a group choice, pointing the data at the tiny session dataset (written
    in the layout the data config reads), and giving what an experiment requires."""

    def _cfg(*overrides: str) -> DictConfig:
        # which dataset? only an experiment file needs composing to find out
        exp = any(o.startswith("+exp=") for o in overrides)
        first = compose_cfg(list(overrides) if exp else [o for o in overrides if o.startswith("data=")])
        if first.data.name == "synthetic":  # generated into the cache: reuse the session tree
            data = [f"data.root={isolated_env}", *tiny_synthetic_overrides]
        else:
            data = [f"data.root={layout_root(first.data.layout)}"]
        try:
            builder.check_required(first)
        except ValueError as err:  # the fine-tuning experiments: model.init_from
            assert "model.init_from is required" in str(err)
            data.append(f"model.init_from={request.getfixturevalue('finetune_source')}")
        return compose_cfg([*overrides, *data])

    return _cfg


def _shrunk(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A copy with plain-value ``key=value`` overrides applied, like command-line overrides."""
    small = copy.deepcopy(cfg)
    for item in overrides:
        key, value = item.split("=", 1)
        OmegaConf.update(small, key, OmegaConf.from_dotlist([f"v={value}"]).v, merge=False)
    return small


def _instantiate_all(cfg: DictConfig) -> VideoClassifier:
    """What ``videotrain.run.train`` builds before its first step, without training."""
    settings = builder.trainer_settings(cfg)
    precision = Precision.from_config(cfg.trainer, CPU)
    assert cfg.sched.name == "cosine", "run.train accepts only sched.name=cosine"
    data, bad = builder.build_data_from_cfg(cfg, CPU)
    assert bad == [] and data.num_classes == 4
    model = builder.build_model(cfg, data.num_classes)
    optimizer = builder.optimizer_from_cfg(cfg, model)
    _, total = plan_steps(len(data.train), settings)
    warmup_cosine(optimizer, total, cfg.sched.warmup_steps, cfg.sched.min_lr_ratio)
    data.train_sampler.set_epoch(0)
    batch = next(iter(data.train))
    model.eval()
    with torch.no_grad(), precision.autocast():
        logits = model(clips_to_device(batch["video"][:2], CPU))
    assert logits.shape == (2, 4) and logits.float().isfinite().all()
    return model


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_resolves_and_instantiates(tiny_cfg, shrink_overrides, group: str,
                                                   option: str) -> None:
    cfg = tiny_cfg(_select(group, option))
    # every interpolation resolves and nothing required is left unset (given data.root)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert cfg.logger.wandb.mode in WANDB_MODES
    assert str(cfg.trainer.precision) in {"32", "bf16", "16"}
    # no network in tests: the offline error for pretrained weights is tested elsewhere
    model = _instantiate_all(_shrunk(cfg, [*shrink_overrides, "model.pretrained=null"]))
    assert isinstance(model.backbone, FrameBackbone)
    if group == "memory":
        assert isinstance(model.strategy, MemoryStrategy)


BACKBONE_OPTIONS = GROUPS["model/backbone"]
HEAD_OPTIONS = GROUPS["model/head"]


@pytest.mark.parametrize("head", HEAD_OPTIONS)
@pytest.mark.parametrize("backbone", BACKBONE_OPTIONS)
def test_backbone_head_pairs_build_and_run(compose_cfg, backbone: str, head: str) -> None:
    # the two groups are independent: compose each option once, then pair them up
    cfg = compose_cfg([f"model/backbone={backbone}", "data.crop_size=32"])
    cfg.model.head = compose_cfg([f"model/head={head}", "data.crop_size=32"]).model.head
    model = builder.build_model(cfg, num_classes=4)
    assert isinstance(model.backbone, FrameBackbone)
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 2, 3, 32, 32)).shape == (1, 4)


# ------------------------------------------------------------------- keys vs signatures


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


@pytest.mark.parametrize("option", GROUPS["data"])
def test_data_keys_are_build_data_arguments(compose_cfg, option: str) -> None:
    """No key is ignored, every required argument is there, and the reader options a config
    sets are those its layout takes (the others keep build_data's default, None)."""
    data = compose_cfg([f"data={option}"]).data
    keys = set(data)
    params = inspect.signature(build_data).parameters
    accepted = set(params) - {"seed", "rank", "world_size", "pin_memory", "preflight_train"}
    required = {k for k in accepted if params[k].default is inspect.Parameter.empty}
    assert keys <= accepted, f"unused: {keys - accepted}"
    assert required <= keys, f"missing: {required - keys}"
    reader_keys = {k for k in accepted if k in {o for opts in READER_OPTIONS.values() for o in opts}}
    assert keys & reader_keys <= set(READER_OPTIONS[data.layout]), data.layout
    if data.name != "synthetic":  # a real dataset's config shows all its reader's options
        assert keys & reader_keys == set(READER_OPTIONS[data.layout]), data.layout


@pytest.mark.parametrize("option", GROUPS["trainer"])
def test_trainer_keys_are_trainer_settings(compose_cfg, option: str) -> None:
    keys = set(compose_cfg([f"trainer={option}"]).trainer)
    fields = {f.name for f in dataclasses.fields(TrainerSettings)} - {"max_bad_fraction"}
    run_level = {"precision", "sync_bn", "channels_last"}  # read by run.train / build_model
    assert keys == fields | run_level, keys ^ (fields | run_level)


APP_SETTINGS = [("predict", PredictSettings), ("export", ExportSettings)]


@pytest.mark.parametrize("group,settings", APP_SETTINGS, ids=[g for g, _ in APP_SETTINGS])
def test_app_keys_are_their_settings(compose_cfg, group: str, settings: type) -> None:
    """``python -m videotrain.predict`` / ``.export`` read their group into a settings class."""
    for option in GROUPS[group]:
        node = compose_cfg([f"{group}={option}"])[group]
        assert set(node) == {f.name for f in dataclasses.fields(settings)}
        settings(**OmegaConf.to_container(node, resolve=True))


@pytest.mark.parametrize("option", GROUPS["optim"])
def test_optim_keys_are_build_optimizer_arguments(compose_cfg, option: str) -> None:
    keys = set(compose_cfg([f"optim={option}"]).optim)
    scaling = {"lr_scaling", "base_batch_size"}  # turned into lr by build.effective_lr
    assert scaling <= keys and keys - scaling <= _params(build_optimizer) - {"model"}


@pytest.mark.parametrize("option", GROUPS["sched"])
def test_sched_keys_are_schedule_arguments(compose_cfg, option: str) -> None:
    keys = set(compose_cfg([f"sched={option}"]).sched)
    assert keys <= {"name"} | (_params(warmup_cosine) - {"optimizer", "total_steps"})


@pytest.mark.parametrize("option", GROUPS["logger"])
def test_logger_keys(compose_cfg, option: str) -> None:
    logger = compose_cfg([f"logger={option}"]).logger
    assert set(logger) == {"wandb"} and set(logger.wandb) == {"mode", "project"}


# ------------------------------------------------------------------- specific configs


def test_default_config_values(compose_cfg) -> None:
    cfg = compose_cfg()
    assert cfg.data.name == "synthetic" and cfg.data.root is None
    assert cfg.model.backbone.layers == [1, 1, 1, 1] and cfg.model.head._target_.endswith("TConvHead")
    assert cfg.memory._target_ == "videotrain.memory.e2e.EndToEnd"
    assert cfg.data.hflip is False  # a flip swaps the synthetic task's left/right classes


def test_issue46_options_compose(compose_cfg) -> None:
    """trainer.channels_last and data.num_workers=auto compose, pass the schema and reach the
    objects they configure; the planner's prices reach the strategy when passed in code."""
    from hydra.utils import instantiate

    from videotrain.config.build import build_model
    from videotrain.data.loaders import DATA_VALUE_CHECKS

    cfg = compose_cfg()
    assert cfg.trainer.channels_last == "auto" and cfg.data.num_workers == "auto"
    assert DATA_VALUE_CHECKS["num_workers"][0]("auto") and not DATA_VALUE_CHECKS["num_workers"][0]("x")
    for value, on in (("true", True), ("false", False), ("auto", False)):  # auto: off on a CPU
        cfg = compose_cfg([f"trainer.channels_last={value}", "device=cpu"])
        assert build_model(cfg, num_classes=3).channels_last is on
    cfg = compose_cfg(["memory=recompute", "memory.policy=optimal", "data.num_workers=3"])
    # the planner's prices are set in code (the bench, tests), never by a config
    strategy = instantiate(cfg.memory, cost_model="measured", device_profile="h200", segment_cost_us=120)
    assert (strategy.cost_model, strategy.device_profile, strategy.segment_cost_us) == ("measured", "h200", 120)
    assert cfg.data.num_workers == 3


@pytest.mark.parametrize("option", [o for o in GROUPS["data"] if o != "synthetic"])
def test_real_datasets_require_root(compose_cfg, option: str) -> None:
    cfg = compose_cfg([f"data={option}"])
    assert OmegaConf.is_missing(cfg.data, "root")
    with pytest.raises(ValueError, match=rf"data.root is required for data={option}"):
        builder.build_data_from_cfg(cfg, CPU)


def test_kinetics_exp_overlays(compose_cfg, tiny_root: Path) -> None:
    cfg = compose_cfg(["+exp=kinetics_e2e", f"data.root={tiny_root}"])
    assert cfg.data.name == "kinetics" and cfg.optim.name == "sgd"
    assert cfg.model.backbone.depth == 50 and cfg.model.head._target_.endswith("TransformerHead")
    assert cfg.model.pretrained == "DEFAULT" and cfg.trainer.precision == "bf16"


def test_vit_image_size_follows_crop(compose_cfg) -> None:
    cfg = compose_cfg(["model/backbone=vit_tiny", "data.crop_size=48"])
    assert cfg.model.backbone.image_size == 48


def test_unknown_key_is_named(compose_cfg) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(["data.nonexistent_key=1"])
    text = f"{err.value} {err.value.__cause__}"
    assert "data.nonexistent_key" in text


# ------------------------------------------------------------------- Hydra's own groups


def _with_hydra(overrides: list[str]) -> DictConfig:
    """The composed config including the ``hydra`` node (launcher, sweeper, run dirs)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


LAUNCHERS = [*GROUPS.get("hydra/launcher", []), "submitit_local", "submitit_slurm"]


@pytest.mark.parametrize("option", LAUNCHERS)
def test_launchers_compose_and_instantiate(option: str) -> None:
    from hydra.utils import instantiate

    cfg = _with_hydra([f"hydra/launcher={option}", "hydra.launcher.partition=gpu"]
                      if option != "submitit_local" else [f"hydra/launcher={option}"])
    launcher = instantiate(cfg.hydra.launcher)  # the plugin's launcher object (submits nothing)
    params = launcher.params
    assert {"nodes", "gpus_per_node", "tasks_per_node", "timeout_min"} <= set(params)
    if option == "slurm":  # our preset: one task (= one DDP rank) per GPU
        assert params["tasks_per_node"] == params["gpus_per_node"] == 8
        assert params["partition"] == "gpu" and params["timeout_min"] == 1440
        assert type(launcher).__name__ == "SlurmLauncher"


def test_keep_ratio_sweep_config() -> None:
    cfg = _with_hydra(["+sweep=keep_ratio"])
    params = cfg.hydra.sweeper.params
    assert params["memory"] == "sbp"
    assert [float(v) for v in params["memory.keep_ratio"].split(",")] == [0.25, 0.5, 0.75, 1.0]
    first = (CONFIG_DIR / "sweep" / "keep_ratio.yaml").read_text().splitlines()[0]
    assert first == "# @package _global_"
    assert cfg.memory._target_.endswith("EndToEnd")  # the job config itself is unchanged
    # but every job meters every step on a CPU (its peaks are exact in a shared process)
    assert cfg.trainer.cpu_metered_steps is None


def test_run_dirs_use_one_launch_time() -> None:
    cfg = _with_hydra([])
    assert "${launch_time:" in OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"]
    assert "sweep" in cfg.hydra.job.config.override_dirname.exclude_keys
