"""Config -> objects -> training. The only module (with the CLI entry points) that reads the
Hydra config; everything it calls takes plain arguments."""

from __future__ import annotations

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

from videotrain.data.loaders import DataBundle, build_data
from videotrain.engine.optim import build_optimizer, warmup_cosine
from videotrain.engine.precision import Precision
from videotrain.engine.trainer import Trainer, TrainerSettings, plan_steps
from videotrain.memory.base import SelfPlanning
from videotrain.metrics.logger import MetricsLogger
from videotrain.models.video import VideoClassifier

log = logging.getLogger(__name__)

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available; use device=auto or cpu")
    return device


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def build_model(cfg: DictConfig, num_classes: int) -> VideoClassifier:
    """Backbone (``model/backbone``), head (``model/head``) and strategy (``memory``)."""
    backbone = instantiate(cfg.model.backbone, pretrained=cfg.model.get("pretrained"))
    head = instantiate(cfg.model.head, in_dim=backbone.feature_dim, num_classes=num_classes)
    strategy = instantiate(cfg.memory)
    return VideoClassifier(backbone, head, strategy)


def plan_memory(cfg: DictConfig, model: VideoClassifier, precision: Precision,
                device: torch.device, num_classes: int) -> dict[str, Any] | None:
    """Let a self-planning strategy (``memory=auto``) profile the configured model and batch
    and choose its plan, before training. A no-op (None) for every other strategy. Raises
    ``NoPlanFits`` (a ``ValueError``) when no plan fits the budget."""
    if not isinstance(model.strategy, SelfPlanning):
        return None
    from videotrain.memory.profile import StepProbe

    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    d = cfg.data
    probe = StepProbe(
        model, lambda m: build_optimizer(m, **optim), precision, device,
        video_shape=(d.batch_size, d.num_frames, 3, d.crop_size, d.crop_size),
        num_classes=num_classes, grad_clip=cfg.trainer.grad_clip,
        label_smoothing=cfg.trainer.label_smoothing, seed=cfg.seed,
    )
    return model.strategy.plan(probe)


def build_data_from_cfg(cfg: DictConfig, device: torch.device, rank: int = 0,
                        world_size: int = 1) -> tuple[DataBundle, list[str]]:
    for key in cfg.data:
        if OmegaConf.is_missing(cfg.data, key):
            raise ValueError(f"data.{key} is required for data={cfg.data.name} (e.g. data.{key}=...)")
    d = OmegaConf.to_container(cfg.data, resolve=True, throw_on_missing=True)
    return build_data(
        name=d["name"], layout=d["layout"], root=d["root"], num_frames=d["num_frames"],
        sampling_rate=d["sampling_rate"], fps=d["fps"], short_side=d["short_side"],
        crop_size=d["crop_size"], train_scale=tuple(d["train_scale"]), hflip=d["hflip"],
        batch_size=d["batch_size"], val_batch_size=d["val_batch_size"],
        num_workers=d["num_workers"], val_clips=d["val_clips"], val_crops=d["val_crops"],
        max_bad_fraction=d["max_bad_fraction"], num_classes=d["num_classes"],
        synthetic=d.get("synthetic"), seed=cfg.seed, rank=rank, world_size=world_size,
        pin_memory=device.type == "cuda",
    )


def trainer_settings(cfg: DictConfig) -> TrainerSettings:
    t = cfg.trainer
    return TrainerSettings(
        max_epochs=t.max_epochs, max_steps=t.max_steps, grad_accum=t.grad_accum,
        grad_clip=t.grad_clip, label_smoothing=t.label_smoothing,
        log_every_n_steps=t.log_every_n_steps, checkpoint_every_n_steps=t.checkpoint_every_n_steps,
        val_every_n_epochs=t.val_every_n_epochs, max_bad_fraction=cfg.data.max_bad_fraction,
        progress=t.progress,
    )


def train(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Train and validate as configured; writes config, metrics.jsonl and results.json."""
    out_dir = Path(out_dir)
    device = resolve_device(cfg.device)
    settings = trainer_settings(cfg)  # validate cheap settings before generating data
    precision = Precision(cfg.trainer.precision, device)
    seed_everything(cfg.seed, cfg.deterministic)
    data, bad = build_data_from_cfg(cfg, device)
    model = build_model(cfg, data.num_classes).to(device)
    plan_memory(cfg, model, precision, device, data.num_classes)  # memory=auto: fails here, before training
    optimizer = build_optimizer(model, **OmegaConf.to_container(cfg.optim, resolve=True))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    logger = MetricsLogger(out_dir, wandb_mode=cfg.logger.wandb.mode,
                           wandb_project=cfg.logger.wandb.project, run_name=out_dir.name,
                           config=OmegaConf.to_container(cfg, resolve=True))
    try:
        if cfg.sched.name != "cosine":
            raise ValueError(f"sched.name must be 'cosine', got {cfg.sched.name!r}")
        _, total_steps = plan_steps(len(data.train), settings)
        scheduler = warmup_cosine(optimizer, total_steps, cfg.sched.warmup_steps,
                                  cfg.sched.min_lr_ratio)
        trainer = Trainer(model, optimizer, scheduler, data, precision, settings, out_dir, logger,
                          device, preflight_bad=bad)
        log.info("training %s on %s: %d steps (%d per epoch), output in %s",
                 trainer.strategy.describe(), device, trainer.total_steps,
                 trainer.steps_per_epoch, out_dir)
        results = trainer.fit()
        results["class_names"] = data.class_names
        if isinstance(trainer.strategy, SelfPlanning):
            results["memory_plan"] = trainer.strategy.plan_report()
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        logger.finish(results)
        return results
    except BaseException:
        logger.finish()
        raise
