"""Config -> objects -> training. The only module (with the CLI entry points) that reads the
Hydra config; everything it calls takes plain arguments.

Under torchrun (or SLURM tasks through submitit) every process calls ``train`` with the same
config: it joins the process group, shards the data by rank, wraps the model in DDP, and only
rank 0 writes ``config.yaml``, ``metrics.jsonl``, checkpoints, ``results.json`` and wandb.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from videotrain.data.loaders import DataBundle, build_data
from videotrain.engine import distributed
from videotrain.engine.distributed import SINGLE_PROCESS, Comm, DistContext
from videotrain.engine.optim import build_optimizer, scaled_lr, warmup_cosine
from videotrain.engine.precision import Precision
from videotrain.engine.trainer import Trainer, TrainerSettings, plan_steps
from videotrain.memory.base import SelfPlanning
from videotrain.metrics.logger import MetricsLogger
from videotrain.models.video import VideoClassifier

log = logging.getLogger(__name__)

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")

# `${launch_time:%H-%M-%S}` in hydra.run.dir / hydra.sweep.dir: Hydra's `${now:...}`, except
# that all DDP ranks agree on it (rank 0's clock), so they share one output directory.
OmegaConf.register_new_resolver("launch_time", distributed.launch_time, use_cache=True, replace=True)


def job_dirname(overrides: str, limit: int = 160) -> str:
    """A multirun job's folder name from its overrides (``hydra.job.override_dirname``): kept
    as is up to ``limit`` characters, else cut and suffixed with a hash of the whole, so that
    long override lists stay under the filesystem's 255-byte name limit and stay distinct."""
    name = overrides.replace("/", "_")  # `model/backbone=x` must not become a sub-folder
    if len(name) <= limit:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return f"{name[:limit - 11]}~{digest}"


OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)


def resolve_device(name: str, ctx: DistContext = SINGLE_PROCESS) -> torch.device:
    return distributed.resolve_device(name, ctx)


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def build_model(cfg: DictConfig, num_classes: int, sync_bn: bool = False) -> VideoClassifier:
    """Backbone (``model/backbone``), head (``model/head``) and strategy (``memory``).

    ``sync_bn`` converts BatchNorm layers to SyncBatchNorm *before* the strategy prepares the
    backbone, so that wrappers the strategy installs (checkpointed blocks) see the final layers.
    """
    backbone = instantiate(cfg.model.backbone, pretrained=cfg.model.get("pretrained"))
    head = instantiate(cfg.model.head, in_dim=backbone.feature_dim, num_classes=num_classes)
    if sync_bn:
        if cfg.memory.get("bn_policy") == "full_batch":
            raise ValueError("trainer.sync_bn=true does not combine with memory=sbp "
                             "memory.bn_policy=full_batch (it records per-process BN statistics); "
                             "use memory.bn_policy=frozen or trainer.sync_bn=false")
        backbone = nn.SyncBatchNorm.convert_sync_batchnorm(backbone)
        head = nn.SyncBatchNorm.convert_sync_batchnorm(head)
    strategy = instantiate(cfg.memory)
    return VideoClassifier(backbone, head, strategy)


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


def wrap_ddp(model: nn.Module, device: torch.device, ctx: DistContext) -> nn.Module:
    """DDP over the whole classifier (one process per device). Every strategy gives every
    parameter a gradient in every training step (SBP backpropagates kept frames through the
    whole backbone, frame dropout computes only kept frames, recomputation is non-reentrant), so
    neither ``find_unused_parameters`` nor ``static_graph`` is needed."""
    if not ctx.enabled:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def plan_memory(cfg: DictConfig, model: VideoClassifier, precision: Precision,
                device: torch.device, num_classes: int) -> dict[str, Any] | None:
    """Let a self-planning strategy (``memory=auto``) profile the configured model and batch
    and choose its plan, before training. A no-op (None) for every other strategy. Raises
    ``NoPlanFits`` (a ``ValueError``) when no plan fits the budget."""
    if not isinstance(model.strategy, SelfPlanning):
        return None
    from videotrain.memory.profile import StepProbe

    d = cfg.data
    probe = StepProbe(
        model, lambda m: optimizer_from_cfg(cfg, m), precision, device,
        video_shape=(d.batch_size, d.num_frames, 3, d.crop_size, d.crop_size),
        num_classes=num_classes, grad_clip=cfg.trainer.grad_clip,
        label_smoothing=cfg.trainer.label_smoothing, seed=cfg.seed,
    )
    return model.strategy.plan(probe)


def build_data_from_cfg(cfg: DictConfig, device: torch.device, rank: int = 0,
                        world_size: int = 1, **extra: Any) -> tuple[DataBundle, list[str]]:
    """``build_data`` from ``cfg.data``; ``extra`` overrides some of its arguments (the
    evaluation command's views per video, for instance)."""
    for key in cfg.data:
        if OmegaConf.is_missing(cfg.data, key):
            raise ValueError(f"data.{key} is required for data={cfg.data.name} (e.g. data.{key}=...)")
    d = OmegaConf.to_container(cfg.data, resolve=True, throw_on_missing=True)
    assert isinstance(d, dict)
    # every data key is a build_data argument (tests/test_configs.py checks it)
    return build_data(**{**d, "seed": cfg.seed, "rank": rank, "world_size": world_size,
                         "pin_memory": device.type == "cuda", **extra})


def global_batch_size(cfg: DictConfig, world_size: int = 1) -> int:
    """Clips per optimizer step over all processes: what the learning rate sees."""
    return cfg.data.batch_size * cfg.trainer.grad_accum * world_size


def effective_lr(cfg: DictConfig, world_size: int = 1) -> float:
    """``optim.lr``, scaled to the global batch as ``optim.lr_scaling`` says (never implicitly)."""
    return scaled_lr(cfg.optim.lr, cfg.optim.get("lr_scaling", "none"),
                     cfg.optim.get("base_batch_size"), global_batch_size(cfg, world_size))


def optimizer_from_cfg(cfg: DictConfig, model: nn.Module, world_size: int = 1) -> torch.optim.Optimizer:
    """The ``optim`` group -> optimizer, at ``effective_lr``."""
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    optim.pop("lr_scaling", None)
    optim.pop("base_batch_size", None)
    return build_optimizer(model, **{**optim, "lr": effective_lr(cfg, world_size)})


def trainer_settings(cfg: DictConfig) -> TrainerSettings:
    t = cfg.trainer
    return TrainerSettings(
        max_epochs=t.max_epochs, max_steps=t.max_steps, grad_accum=t.grad_accum,
        grad_clip=t.grad_clip, label_smoothing=t.label_smoothing,
        log_every_n_steps=t.log_every_n_steps, checkpoint_every_n_steps=t.checkpoint_every_n_steps,
        val_every_n_epochs=t.val_every_n_epochs, max_bad_fraction=cfg.data.max_bad_fraction,
        progress=t.progress, test_after_fit=t.test_after_fit, cpu_metered_steps=t.cpu_metered_steps,
    )


def train(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Train and validate as configured; rank 0 writes config, metrics.jsonl and results.json.

    Joins the process group that torchrun or a submitit SLURM job describes (and leaves it at
    the end if it joined it here); with one process this is plain single-device training.
    """
    ctx, owns_group = distributed.init_from_env()
    try:
        return _train(cfg, Path(out_dir), ctx)
    finally:
        if owns_group:
            distributed.shutdown()


def _train(cfg: DictConfig, out_dir: Path, ctx: DistContext) -> dict[str, Any]:
    comm = Comm(ctx)
    device = resolve_device(cfg.device, ctx)
    settings = trainer_settings(cfg)  # validate cheap settings before generating data
    precision = Precision.from_config(cfg.trainer, device)
    sync_bn = use_sync_bn(cfg, ctx, device)
    global_batch, lr = global_batch_size(cfg, ctx.world_size), effective_lr(cfg, ctx.world_size)
    seed_everything(cfg.seed, cfg.deterministic)  # the same initial weights on every rank
    data, bad = build_data_from_cfg(cfg, device, ctx.rank, ctx.world_size)
    model = build_model(cfg, data.num_classes, sync_bn=sync_bn).to(device)
    plan_memory(cfg, model, precision, device, data.num_classes)  # memory=auto: fails here, before training
    optimizer = optimizer_from_cfg(cfg, model, ctx.world_size)
    model = wrap_ddp(model, device, ctx)  # broadcasts rank 0's parameters and buffers
    if ctx.enabled:  # from here on, ranks draw different dropout masks (reproducibly)
        seed_everything(cfg.seed + ctx.rank, cfg.deterministic)
    runtime = {"world_size": ctx.world_size, "global_batch_size": global_batch, "lr": lr}
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    logger = MetricsLogger(out_dir, enabled=ctx.is_main, wandb_mode=cfg.logger.wandb.mode,
                           wandb_project=cfg.logger.wandb.project, run_name=out_dir.name,
                           config={**OmegaConf.to_container(cfg, resolve=True), "runtime": runtime})
    try:
        if cfg.sched.name != "cosine":
            raise ValueError(f"sched.name must be 'cosine', got {cfg.sched.name!r}")
        _, total_steps = plan_steps(len(data.train), settings)
        scheduler = warmup_cosine(optimizer, total_steps, cfg.sched.warmup_steps,
                                  cfg.sched.min_lr_ratio)
        trainer = Trainer(model, optimizer, scheduler, data, precision, settings, out_dir, logger,
                          device, comm=comm, preflight_bad=bad)
        if ctx.is_main:
            log.info("training %s on %s x %d process(es): %d steps (%d per epoch), global batch %d "
                     "(%d per process x %d accumulated x %d), lr %g (optim.lr_scaling=%s), output in %s",
                     trainer.strategy.describe(), device, ctx.world_size, trainer.total_steps,
                     trainer.steps_per_epoch, global_batch, cfg.data.batch_size,
                     cfg.trainer.grad_accum, ctx.world_size, lr, cfg.optim.get("lr_scaling", "none"), out_dir)
        results = trainer.fit()
        results["lr"] = lr
        results["class_names"] = data.class_names
        digests = comm.all_gather(distributed.param_digest(trainer.module))
        results["replicas_in_sync"] = len(set(digests)) == 1
        results["param_digests"] = digests  # one per rank
        if not results["replicas_in_sync"]:
            log.error("DDP replicas ended with different parameters: %s", digests)
        if isinstance(trainer.strategy, SelfPlanning):
            results["memory_plan"] = trainer.strategy.plan_report()
        if settings.test_after_fit and ctx.enabled:
            log.warning("trainer.test_after_fit runs in single-process runs only; evaluate this "
                        "run with: python -m videotrain.eval checkpoint=%s",
                        trainer.ckpt_dir / "last.ckpt")
        elif settings.test_after_fit:  # the paper-style evaluation: eval.clips x eval.crops views
            from videotrain.eval import build_eval_data, run_eval  # (it imports this module)

            test_data, test_bad = build_eval_data(cfg, device)
            test = run_eval(cfg, trainer.module, test_data, test_bad, out_dir, device, precision,
                            checkpoint=str(trainer.ckpt_dir / "last.ckpt"))
            results["test"] = test
            results.update({f"test_{k}": test[k] for k in
                            ("video_top1", "video_top5", "clip_top1", "mean_class_acc")})
        if ctx.is_main:
            (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        logger.finish(results)
        comm.barrier()  # nobody leaves (and tears the group down) before rank 0 has written
        return results
    except BaseException:
        logger.finish()
        raise
