"""Config -> objects: the one module that turns a Hydra config into the objects a command runs
(model with its memory strategy, data, precision, optimizer, trainer settings).

Every command builds through it (``python -m videotrain``, ``videotrain.eval``,
``videotrain.plan``, ``videotrain.bench``), so they cannot drift apart, and everything below
it (``data``, ``models``, ``memory``, ``engine``, ``metrics``) takes plain arguments and never
reads the config.

Importing it registers the ``${launch_time:...}`` and ``${job_dirname:...}`` resolvers that the
root config's ``hydra.run.dir`` / ``hydra.sweep.subdir`` use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from videotrain.config import schema
from videotrain.data.loaders import DataBundle, build_data, check_data_values
from videotrain.data.preflight import BadDataError
from videotrain.engine import distributed
from videotrain.engine.distributed import (  # noqa: F401 (the commands')
    SINGLE_PROCESS,
    DistContext,
    resolve_device,
    wrap_ddp,
)
from videotrain.engine.evaluate import EvalSettings
from videotrain.engine.optim import build_optimizer, scaled_lr, warmup_cosine
from videotrain.engine.precision import Precision
from videotrain.engine.recipe import RecipeSettings
from videotrain.engine.trainer import StepPlan, TrainerSettings
from videotrain.memory.base import MemoryStrategy, SelfPlanning
from videotrain.memory.estimate import StepMemory
from videotrain.models.finetune import freeze_backbone, init_from
from videotrain.models.video import VideoClassifier, wants_channels_last
from videotrain.models.weights import load_backbone_weights
from videotrain.untrusted import UnsafeFileError, check_run_folder
from videotrain.untrusted.files import make_new_dir

log = logging.getLogger(__name__)


def _config_dir() -> str:
    """``configs/``: inside the installed package (a wheel carries it as ``videotrain/configs``),
    else at the top of the source tree (an editable install), where users look for it."""
    here = Path(__file__).resolve().parents[1]  # the package, videotrain/
    for candidate in (here / "configs", here.parent / "configs"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"videotrain's Hydra configs were not found next to {here}")


CONFIG_DIR = _config_dir()


def job_dirname(overrides: str, limit: int = 160) -> str:
    """A multirun job's folder name from its overrides (``hydra.job.override_dirname``): kept
    as is up to ``limit`` characters, else cut and suffixed with a hash of the whole, so that
    long override lists stay under the filesystem's 255-byte name limit and stay distinct."""
    name = overrides.replace("/", "_")  # `model/backbone=x` must not become a sub-folder
    if len(name) <= limit:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return f"{name[:limit - 11]}~{digest}"


_claimed: dict[str, str] = {}


def unique_dir(path: str) -> str:
    """``${unique_dir:PATH}`` in ``hydra.run.dir``: ``PATH``, or ``PATH-1``, ``PATH-2``, ... the
    first that this run creates itself (``os.mkdir`` is atomic: of two runs that start in the
    same second, one gets ``PATH`` and the other ``PATH-1``). Claimed once per process; under
    DDP rank 0 claims and the other ranks take its answer. A name where a link (or anything
    else) already stands is passed over, never followed: the run folder is a real folder.

    A relative ``PATH`` (the default, ``outputs/DATE/TIME``) is the project's below the working
    folder: no link there is followed (an ``outputs`` linked elsewhere is refused, one
    ``error:`` line, exit status 2); an absolute one is the user's own, followed as given."""
    if path not in _claimed:
        root = None if os.path.isabs(path) else Path(os.getcwd())

        def claim() -> str:
            for i in itertools.count():
                candidate = path if i == 0 else f"{path}-{i}"
                if make_new_dir(candidate, root):  # the one writer
                    return candidate
            raise AssertionError("unreachable")

        try:
            _claimed[path] = distributed.from_main_process(claim)
        except (UnsafeFileError, OSError) as err:
            # raised while Hydra resolves hydra.run.dir, where its callbacks and job runner
            # would turn it into a warning or a traceback: the command ends here
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"error: hydra.run.dir: {err}; name the run folder yourself "
                      "(hydra.run.dir=PATH, followed as given) to write elsewhere",
                      file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    return _claimed[path]


# `${launch_time:%H-%M-%S}` in hydra.run.dir / hydra.sweep.dir: Hydra's `${now:...}`, except
# that all DDP ranks agree on it (rank 0's clock), so they share one output directory.
OmegaConf.register_new_resolver("launch_time", distributed.launch_time, use_cache=True, replace=True)
OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)
OmegaConf.register_new_resolver("unique_dir", unique_dir, use_cache=True, replace=True)
schema.register()  # the structured configs every YAML group composes onto


def _required(what: str) -> Any:
    raise ValueError(f"a required value is not set: {what}")


# `key: ${required:WHAT}` in an experiment: the user must set `key` on the command line.
# (A `???` cannot do this in an experiment: merged over the root's default, it is ignored.)
OmegaConf.register_new_resolver("required", _required, replace=True)


def check_required(cfg: DictConfig, prefix: str = "") -> None:
    """Raise a ``ValueError`` naming every key still set to ``${required:...}``."""
    for key in cfg.keys():
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            check_required(node, f"{prefix}{key}.")
        elif OmegaConf.is_interpolation(cfg, str(key)) and str(node._value()).startswith("${required:"):
            what = str(node._value())[len("${required:"):-1].strip()
            raise ValueError(f"{prefix}{key} is required here: {what} ({prefix}{key}=...)")


def validate(cfg: DictConfig) -> DictConfig:
    """Reject keys no schema has (``+trainer.max_epoch=3``), naming the nearest valid one, and
    keys an experiment requires that are not set; the types were checked while composing.
    Every app calls it on the config it runs."""
    schema.check_keys(cfg)
    check_required(cfg)
    return cfg


# What the user can fix (a config value or key, an annotation file, missing or unreadable
# videos, a missing data.root or list): one `error:` line and exit status 2, not a traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, BadDataError, FileNotFoundError)


def user_error(err: BaseException) -> Exception | None:
    """The user error ``err`` is or wraps (Hydra's ``instantiate`` wraps what a constructor
    raises in "Error in call to target"), else None."""
    while err is not None:
        if isinstance(err, USER_ERRORS):
            return err
        if not isinstance(err, InstantiationException):
            return None
        err = err.__cause__
    return None


@contextlib.contextmanager
def clean_errors() -> Iterator[None]:
    """A user error (``USER_ERRORS``: bad config values and keys, a budget no plan fits,
    malformed annotations, too many bad videos, a missing file or folder) ends the app with its
    message as one ``error:`` line on stderr and exit status 2, not a traceback;
    ``HYDRA_FULL_ERROR=1`` shows the traceback. Under torchrun only rank 0 prints it (every
    rank raises the errors rank 0 broadcasts, and rank 0 names a failed peer: ``run.train``);
    every rank exits with status 2."""
    try:
        yield
    except Exception as raised:
        err = user_error(raised)
        if err is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
            raise SystemExit(2) from None
        kind = "" if type(err) in (ValueError, FileNotFoundError) else f"{type(err).__name__}: "
        logging.getLogger("videotrain").error("%s%s", kind, err)
        print(f"error: {kind}{err}", file=sys.stderr)
        raise SystemExit(2) from None


# optim/sched key -> (check, what it must be); None (not set) passes. The other groups check
# their values in their own constructors (TrainerSettings, EvalSettings, RecipeSettings, the
# memory strategies), which check_values runs.
RUN_VALUE_CHECKS: dict[str, tuple[Any, str]] = {
    "optim.lr": (lambda v: v > 0, "a learning rate > 0"),
    "optim.weight_decay": (lambda v: v >= 0, ">= 0"),
    "optim.head_lr": (lambda v: v > 0, "null or a learning rate > 0"),
    "sched.name": (lambda v: v == "cosine", "'cosine'"),
    "sched.warmup_steps": (lambda v: v >= 0, "a number of steps >= 0"),
    "sched.min_lr_ratio": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
}


def check_values(cfg: DictConfig) -> MemoryStrategy | None:
    """Check every config value that can be checked without reading data, before any is read:
    the ``data`` values (``loaders.DATA_VALUE_CHECKS``), ``RUN_VALUE_CHECKS``, and the values
    the ``trainer``, ``eval``, ``recipe`` and ``memory`` groups check when they are built. Each
    invalid value raises one ``ValueError`` naming its key, which ``clean_errors`` reports as
    one ``error:`` line with exit status 2 (a strategy's error is taken out of Hydra's
    "Error in call to target"). ``model/backbone`` and ``model/head`` values are checked when
    the model is built, after the class list is read and before any video is.

    Returns the strategy it built to check the ``memory`` group (None without one): a run
    builds its model around that instance (``build_model(strategy=...)``)."""
    data = cfg.get("data")
    if data is not None:
        plain = OmegaConf.to_container(data, resolve=True)
        check_data_values({k: plain[k] for k in data if not OmegaConf.is_missing(data, k)})
    for key, (ok, must) in RUN_VALUE_CHECKS.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and not ok(value):
            raise ValueError(f"{key} must be {must}, got {value!r}")
    if cfg.get("trainer") is not None and data is not None:
        trainer_settings(cfg)
    if cfg.get("eval") is not None:
        eval_settings(cfg)
    recipe_settings(cfg)
    return build_strategy(cfg) if cfg.get("memory") is not None else None


def build_strategy(cfg: DictConfig) -> MemoryStrategy:
    """The ``memory`` group's strategy; a value its constructor refuses is raised as that
    constructor's error, not Hydra's "Error in call to target"."""
    try:
        return instantiate(cfg.memory)
    except InstantiationException as err:
        cause = user_error(err)
        if cause is None:
            raise
        raise cause from None


def compose_cfg(overrides: list[str]) -> DictConfig:
    """The root config with ``overrides``, composed outside a Hydra app (plan, bench) and
    validated."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        del cfg["hydra"]  # what compose() does without return_hydra_config
    return validate(cfg)


def config_mixes_frames(cfg: DictConfig) -> bool:
    """Whether the configured backbone mixes frames (TSM's ``model.backbone.temporal_shift`` >
    0), read from the config without building the model: SBP + recompute cannot train it."""
    return float(cfg.model.backbone.get("temporal_shift") or 0) > 0


def group_choices(overrides: list[str]) -> dict[str, str]:
    """Which option each config group resolved to (``{"model/backbone": "resnet50", ...}``)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    return {k: str(v) for k, v in cfg.hydra.runtime.choices.items()}


def device_type(cfg: DictConfig) -> str:
    """The kind of device ``cfg.device`` trains on (``auto``: cuda when there is one), without
    claiming it: for choices made while building (``trainer.channels_last``)."""
    name = str(cfg.get("device", "auto"))
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name).type


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def build_precision(cfg: DictConfig, device: torch.device) -> Precision:
    return Precision.from_config(cfg.trainer, device)


def build_model(cfg: DictConfig, num_classes: int, sync_bn: bool = False,
                init: bool = True, class_names: list[str] | None = None,
                strategy: MemoryStrategy | None = None) -> VideoClassifier:
    """Backbone (``model/backbone``, with ``model.pretrained`` or ``model.pretrained_path``
    weights), head (``model/head``) and strategy (``memory``); then ``model.init_from`` (a
    trained video model's weights) and ``model.freeze_backbone`` (``videotrain.models.finetune``).

    ``init=False`` skips every source of initial weights (``model.pretrained``,
    ``model.pretrained_path``, ``model.init_from``): for commands that load a trained checkpoint
    next (eval, predict, export) or read only the model's structure (plan), and which should
    neither download nor need the files training started from.

    ``class_names`` (the dataset's) let ``model.init_from`` refuse a checkpoint whose head
    numbers the same classes in another order.

    ``sync_bn`` converts BatchNorm layers to SyncBatchNorm *before* the strategy prepares the
    backbone, so that wrappers the strategy installs (recomputed blocks) see the final layers.

    ``strategy``: the one ``check_values`` built from ``cfg.memory`` (else it is built here).
    """
    if cfg.model.get("pretrained_path") and cfg.model.get("pretrained"):
        raise ValueError("set at most one of model.pretrained (download) and "
                         "model.pretrained_path (a local file)")
    backbone = instantiate(cfg.model.backbone, pretrained=cfg.model.get("pretrained") if init else None)
    if init and cfg.model.get("pretrained_path"):  # local image weights (offline); see models/weights.py
        load_backbone_weights(backbone, str(cfg.model.pretrained_path))
    head = instantiate(cfg.model.head, in_dim=backbone.feature_dim, num_classes=num_classes)
    if sync_bn:
        if cfg.memory.get("bn_policy") == "full_batch":
            raise ValueError("trainer.sync_bn=true does not combine with memory=sbp "
                             "memory.bn_policy=full_batch (it records per-process BN statistics); "
                             "use memory.bn_policy=frozen or trainer.sync_bn=false")
        backbone = nn.SyncBatchNorm.convert_sync_batchnorm(backbone)
        head = nn.SyncBatchNorm.convert_sync_batchnorm(head)
    if strategy is None:
        strategy = instantiate(cfg.memory)
    model = VideoClassifier(backbone, head, strategy)
    model.eval_frame_chunk = eval_settings(cfg).frame_chunk
    if init and cfg.model.get("init_from"):  # fine-tuning from a trained video model
        init_from(model, str(cfg.model.init_from), class_names, cfg.data.get("layout"))
    if wants_channels_last(cfg.trainer.get("channels_last", "auto"), device_type(cfg), model.backbone):
        model.use_channels_last()  # trainer.channels_last: weights and every clip NHWC
    if cfg.model.get("freeze_backbone"):
        frozen = freeze_backbone(model)
        log.info("model.freeze_backbone=true: %d backbone parameters frozen (BatchNorm statistics "
                 "too); only the head trains", frozen)
        if model.strategy.name != "e2e":
            log.warning("model.freeze_backbone=true: memory=%s has nothing to save, since the "
                        "backbone runs without autograd; memory=e2e does the same",
                        model.strategy.name)
    return model


def use_sync_bn(cfg: DictConfig, ctx: DistContext, device: torch.device) -> bool:
    """``trainer.sync_bn``, checked: it needs CUDA and matters only with several processes."""
    if not cfg.trainer.sync_bn:
        return False
    if not ctx.enabled:
        log.warning("trainer.sync_bn=true has no effect with a single process; plain BatchNorm is used")
        return False
    if device.type != "cuda":
        raise ValueError("trainer.sync_bn=true needs CUDA (torch's SyncBatchNorm runs on GPUs only); "
                         "set trainer.sync_bn=false for DDP on CPU")
    return True


def plan_memory(cfg: DictConfig, model: VideoClassifier, device: torch.device, num_classes: int,
                estimator: Callable[[DictConfig, int, str], Callable[[dict[str, Any]], StepMemory]],
                ) -> dict[str, Any] | None:
    """Let a self-planning strategy (``memory=auto``) choose its plan before training, from
    fake-tensor estimates of the configured run at full size for ``device``'s type; a no-op
    (None) for every other strategy. Raises ``NoPlanFits`` (a ``ValueError``) when no plan fits.

    ``estimator(cfg, num_classes, device_type)`` makes the estimator of a ``memory:`` node's
    step: the commands pass ``videotrain.config.estimate.ConfigEstimator``, which builds
    the model here through this module (so build does not import it)."""
    if not isinstance(model.strategy, SelfPlanning):
        return None
    return model.strategy.plan(estimator(cfg, num_classes, device.type), int(cfg.data.num_frames), device)


def build_data_from_cfg(cfg: DictConfig, device: torch.device, rank: int = 0,
                        world_size: int = 1, **extra: Any) -> tuple[DataBundle, list[str]]:
    """``build_data`` from ``cfg.data``; ``extra`` overrides some of its arguments (the
    evaluation command's views per video, for instance)."""
    for key in cfg.data:
        if OmegaConf.is_missing(cfg.data, key):
            raise ValueError(f"data.{key} is required for data={cfg.data.name} (e.g. data.{key}=...)")
    d = OmegaConf.to_container(cfg.data, resolve=True, throw_on_missing=True)
    assert isinstance(d, dict)
    r = recipe_settings(cfg)  # the recipe's per-clip augmentations act in the training transform
    # every data key is a build_data argument (tests/test_configs.py checks it)
    return build_data(**{**d, "seed": cfg.seed, "rank": rank, "world_size": world_size,
                         "randaugment": (r.randaugment_ops, r.randaugment_magnitude),
                         "random_erasing": r.random_erasing,
                         "pin_memory": device.type == "cuda", "device_type": device.type,
                         "shared": distributed.from_main_process if world_size > 1 else None, **extra})


def recipe_settings(cfg: DictConfig) -> RecipeSettings:
    """The ``recipe`` group (MixUp, CutMix, RandAugment, random erasing, EMA), checked."""
    node = cfg.get("recipe")
    return RecipeSettings(**OmegaConf.to_container(node, resolve=True)) if node is not None else RecipeSettings()


def eval_settings(cfg: DictConfig) -> EvalSettings:
    return EvalSettings(**OmegaConf.to_container(cfg.eval, resolve=True))


def build_eval_data(cfg: DictConfig, device: torch.device, ctx: DistContext = SINGLE_PROCESS,
                    report_dir: str | Path | None = None) -> tuple[DataBundle, list[str]]:
    """The configured dataset with ``eval.clips x eval.crops`` views per val video, the val
    videos sharded over ``ctx``'s ranks; training files are not stat-ed (only the class list is
    read from the train annotations). ``report_dir`` receives the list of missing val videos."""
    s = eval_settings(cfg)
    return build_data_from_cfg(cfg, device, ctx.rank, ctx.world_size, val_clips=s.clips,
                               val_crops=s.crops, val_batch_size=s.batch_size, preflight_train=False,
                               report_dir=report_dir)


def global_batch_size(cfg: DictConfig, world_size: int = 1) -> int:
    """Clips per optimizer step over all processes: what the learning rate sees."""
    return cfg.data.batch_size * cfg.trainer.grad_accum * world_size


def effective_lr(cfg: DictConfig, world_size: int = 1) -> float:
    """``optim.lr``, scaled to the global batch as ``optim.lr_scaling`` says (never implicitly)."""
    return scaled_lr(cfg.optim.lr, cfg.optim.get("lr_scaling", "none"),
                     cfg.optim.get("base_batch_size"), global_batch_size(cfg, world_size))


def optimizer_from_cfg(cfg: DictConfig, model: nn.Module,
                             world_size: int = 1) -> torch.optim.Optimizer:
    """The ``optim`` group -> optimizer, at ``effective_lr``."""
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    optim.pop("lr_scaling", None)
    optim.pop("base_batch_size", None)
    head_lr = optim.pop("head_lr", None)  # scaled with the global batch like optim.lr
    if head_lr is not None:
        head_lr = scaled_lr(head_lr, cfg.optim.get("lr_scaling", "none"),
                            cfg.optim.get("base_batch_size"), global_batch_size(cfg, world_size))
    return build_optimizer(model, **{**optim, "lr": effective_lr(cfg, world_size), "head_lr": head_lr})


def trainer_settings(cfg: DictConfig) -> TrainerSettings:
    """The ``trainer`` group as ``TrainerSettings`` (every key it has is a field: the group's
    schema is derived from them), plus ``data.max_bad_fraction``."""
    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    fields = {f.name for f in dataclasses.fields(TrainerSettings)} - {"max_bad_fraction"}
    unknown = sorted(set(t) - fields)
    if unknown:
        raise schema.UnknownConfigKey(f"unknown config key trainer.{unknown[0]} "
                                      f"(the keys of trainer are: {', '.join(sorted(fields))})")
    return TrainerSettings(**t, max_bad_fraction=cfg.data.max_bad_fraction)


@dataclasses.dataclass
class Training:
    """What the training loop needs, built by ``build_training`` from one config."""

    model: nn.Module  # the VideoClassifier on its device, wrapped in DDP under torchrun
    strategy: MemoryStrategy  # the model's: the one instance, which check_values validated
    data: DataBundle
    preflight_bad: list[str]  # videos the preflight found bad: training draws others
    precision: Precision
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    settings: TrainerSettings
    recipe: RecipeSettings
    plan: StepPlan
    lr: float  # optim.lr at the global batch (effective_lr)
    device: torch.device


def build_training(cfg: DictConfig, ctx: DistContext, out_dir: Path,
                   estimator: Callable[[DictConfig, int, str], Callable[[dict[str, Any]], StepMemory]],
                   ) -> Training:
    """Build a training run in the one order that works, each step's reason beside it: every
    value checked before any data is read, the same initial weights on every rank, the
    strategy's plan chosen before the optimizer sees the parameters, per-rank randomness only
    after DDP has broadcast rank 0's weights. ``out_dir`` is the run folder, checked before
    anything is built and given the lists of missing videos; ``estimator`` is ``plan_memory``'s."""
    strategy = check_values(cfg)  # every value, before any data is read
    # a shared folder resumed from: a linked run folder, links out of it, FIFOs, devices, and
    # what cannot be listed refused before any write (every rank: each writes or reads there)
    check_run_folder(out_dir, "write into")
    device = resolve_device(cfg.device, ctx)
    settings, recipe = trainer_settings(cfg), recipe_settings(cfg)
    precision = build_precision(cfg, device)
    sync_bn = use_sync_bn(cfg, ctx, device)
    seed_everything(cfg.seed, cfg.deterministic)  # the same initial weights on every rank
    data, bad = build_data_from_cfg(cfg, device, ctx.rank, ctx.world_size, report_dir=out_dir)
    classifier = build_model(cfg, data.num_classes, sync_bn=sync_bn,
                             class_names=data.class_names, strategy=strategy).to(device)
    plan_memory(cfg, classifier, device, data.num_classes, estimator)  # memory=auto: fails here
    optimizer = optimizer_from_cfg(cfg, classifier, ctx.world_size)
    model = wrap_ddp(classifier, device, ctx)  # broadcasts rank 0's parameters and buffers
    wait = float(cfg.data.worker_timeout)
    if ctx.enabled and wait > 0:  # a rank whose batch never comes fails every rank, not hangs it
        distributed.set_collective_timeout(wait + max(10.0, 0.1 * wait))
    if ctx.enabled:  # from here on, ranks draw different dropout masks (reproducibly)
        seed_everything(cfg.seed + ctx.rank, cfg.deterministic)
    plan = StepPlan.of(len(data.train), data.train.batch_size, settings,
                       global_batch_size(cfg, ctx.world_size))
    scheduler = warmup_cosine(optimizer, plan.total_steps, cfg.sched.warmup_steps,
                              cfg.sched.min_lr_ratio)
    return Training(model, classifier.strategy, data, bad, precision, optimizer, scheduler, settings, recipe,
                    plan, effective_lr(cfg, ctx.world_size), device)
