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


def trainer_settings(cfg: DictConfig) -> TrainerSettings:
    t = cfg.trainer
    return TrainerSettings(
        max_epochs=t.max_epochs, max_steps=t.max_steps, grad_accum=t.grad_accum,
        grad_clip=t.grad_clip, label_smoothing=t.label_smoothing,
        log_every_n_steps=t.log_every_n_steps, checkpoint_every_n_steps=t.checkpoint_every_n_steps,
        val_every_n_epochs=t.val_every_n_epochs, max_bad_fraction=cfg.data.max_bad_fraction,
        progress=t.progress, test_after_fit=t.test_after_fit,
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
        if settings.test_after_fit:  # the paper-style evaluation: eval.clips x eval.crops views
            from videotrain.eval import build_eval_data, run_eval  # (it imports this module)

            test_data, test_bad = build_eval_data(cfg, device)
            test = run_eval(cfg, model, test_data, test_bad, out_dir, device, precision,
                            checkpoint=str(trainer.ckpt_dir / "last.ckpt"))
            results["test"] = test
            results.update({f"test_{k}": test[k] for k in
                            ("video_top1", "video_top5", "clip_top1", "mean_class_acc")})
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        logger.finish(results)
        return results
    except BaseException:
        logger.finish()
        raise
