"""``python -m videotrain.eval checkpoint=PATH [overrides]``: evaluate a trained model the way
papers report it, with ``eval.clips`` temporal clips x ``eval.crops`` spatial crops per video
(Kinetics convention 10 x 3) and the views' softmax aggregated by ``eval.aggregate``.

It writes ``eval.json`` (clip- and video-level top-1/top-5, mean class accuracy, the views,
skipped videos), ``per_class.csv`` and ``confusion.png`` into the Hydra run directory. The
same evaluation runs at the end of training with ``trainer.test_after_fit=true``.

Which model: when the checkpoint sits in a training run's folder (``RUN/checkpoints/``), the
run's ``config.yaml`` is the base and only the overrides given to this command replace parts
of it, so ``checkpoint=PATH`` alone evaluates what was trained (on its own val split).
Otherwise the config is composed as usual and must describe the trained model.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from videotrain.data.loaders import DataBundle, check_bad_fraction
from videotrain.engine import checkpoint as ckpt
from videotrain.engine.evaluate import evaluate
from videotrain.engine.precision import Precision
from videotrain.metrics.accuracy import AGGREGATES, MultiViewAccuracy
from videotrain.metrics.eval_report import write_eval_report
from videotrain.run import CONFIG_DIR, build_data_from_cfg, build_model, resolve_device

log = logging.getLogger(__name__)


@dataclass
class EvalSettings:
    """The ``eval`` config group."""

    clips: int = 10  # temporal clips per video, evenly spaced
    crops: int = 3  # spatial crops per clip: 1 = centre, 3 = left/centre/right (or top/.../bottom)
    aggregate: str = "mean"  # how the views' softmax becomes the video's scores
    batch_size: int = 1  # videos per forward (each is clips x crops views)

    def __post_init__(self) -> None:
        for key in ("clips", "crops", "batch_size"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"eval.{key} must be >= 1, got {getattr(self, key)}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"eval.aggregate must be one of {', '.join(AGGREGATES)}, "
                             f"got {self.aggregate!r}")


def eval_settings(cfg: DictConfig) -> EvalSettings:
    return EvalSettings(**OmegaConf.to_container(cfg.eval, resolve=True))


def build_eval_data(cfg: DictConfig, device: torch.device) -> tuple[DataBundle, list[str]]:
    """The configured dataset with ``eval.clips x eval.crops`` views per val video; training
    files are not stat-ed (only the class list is read from the train annotations)."""
    s = eval_settings(cfg)
    return build_data_from_cfg(cfg, device, val_clips=s.clips, val_crops=s.crops,
                               val_batch_size=s.batch_size, preflight_train=False)


def run_eval(cfg: DictConfig, model: torch.nn.Module, data: DataBundle, bad: list[str],
             out_dir: str | Path, device: torch.device, precision: Precision,
             checkpoint: str | None = None) -> dict[str, Any]:
    """Evaluate ``model`` on ``data.val``; writes the report into ``out_dir``, returns the
    summary that ``eval.json`` holds."""
    s = eval_settings(cfg)
    meter = MultiViewAccuracy((1, 5), data.num_classes, s.aggregate)
    skipped = set(bad)
    val_paths = {p for p, _ in data.val.dataset.index.paths}

    def on_skipped(paths: list[str]) -> None:
        skipped.update(paths)
        check_bad_fraction(len(skipped & val_paths), len(val_paths), data.val.dataset.index.source,
                           float(cfg.data.max_bad_fraction))

    m = evaluate(model, data.val, precision, device, progress=bool(cfg.trainer.progress),
                 on_skipped=on_skipped, meter=meter)
    summary = {
        "checkpoint": checkpoint, "split": "val", "source": data.val.dataset.index.source,
        "clips": s.clips, "crops": s.crops, "views": s.clips * s.crops, "aggregate": s.aggregate,
        "video_top1": m["val_top1"], "video_top5": m["val_top5"],
        "clip_top1": m["val_clip_top1"], "clip_top5": m["val_clip_top5"],
        "mean_class_acc": m["val_mean_class_acc"], "loss": m["val_loss"],
        "videos": m["val_videos"], "num_classes": data.num_classes,
        "skipped_videos": len(skipped), "skipped_paths": sorted(skipped),
        "num_frames": int(cfg.data.num_frames), "crop_size": int(cfg.data.crop_size),
    }
    write_eval_report(out_dir, summary, meter.confusion, data.class_names)
    log.info("eval (%d clips x %d crops, %s): video top-1 %.4f top-5 %.4f, clip top-1 %.4f, "
             "mean class acc %.4f over %d videos; written to %s", s.clips, s.crops, s.aggregate,
             summary["video_top1"], summary["video_top5"], summary["clip_top1"],
             summary["mean_class_acc"], summary["videos"], out_dir)
    return summary


def find_run_config(checkpoint: Path) -> Path | None:
    """``config.yaml`` of the training run a checkpoint belongs to (``RUN/checkpoints/x``)."""
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if (folder / "config.yaml").is_file():
            return folder / "config.yaml"
    return None


def apply_overrides(base: DictConfig, composed: DictConfig, overrides: list[str]) -> DictConfig:
    """``base`` with the parts named by command-line ``overrides`` (``data.root=...``,
    ``model/backbone=resnet18``) taken from ``composed``, and ``eval``/``checkpoint`` always."""
    out = OmegaConf.create(OmegaConf.to_container(base, resolve=True))
    keys = ["eval", "checkpoint"]
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~").replace("/", ".")
        if not key.startswith("hydra"):
            keys.append(key)
    for key in keys:
        value = OmegaConf.select(composed, key, throw_on_missing=False)
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        OmegaConf.update(out, key, value, merge=False, force_add=True)
    return out


def evaluate_checkpoint(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Load ``cfg.checkpoint`` into the configured model and run the multi-view evaluation."""
    if not cfg.get("checkpoint"):
        raise ValueError("checkpoint=PATH is required (e.g. checkpoint=outputs/.../checkpoints/last.ckpt)")
    path = Path(str(cfg.checkpoint)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: file not found: {path}")
    device = resolve_device(cfg.device)
    precision = Precision(cfg.trainer.precision, device)
    eval_settings(cfg)  # bad eval.* values fail before any data is read
    data, bad = build_eval_data(cfg, device)
    model = build_model(cfg, data.num_classes)
    state = ckpt.load(path, map_location="cpu")
    try:
        model.load_state_dict(state["model"] if "model" in state else state)
    except RuntimeError as err:
        raise ValueError(f"checkpoint {path} does not fit the configured model (model/backbone, "
                         f"model/head and the number of classes must match training): {err}") from err
    model.to(device)
    return run_eval(cfg, model, data, bad, out_dir, device, precision, checkpoint=str(path))


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    if cfg.get("checkpoint"):
        saved = find_run_config(Path(str(cfg.checkpoint)).expanduser())
        if saved is not None:
            log.info("model and data settings from %s (overridden by the command line)", saved)
            cfg = apply_overrides(OmegaConf.load(saved), cfg, list(hc.overrides.task))
    log.info("evaluation settings: %s", asdict(eval_settings(cfg)))
    summary = evaluate_checkpoint(cfg, hc.runtime.output_dir)
    return summary["video_top1"]


if __name__ == "__main__":
    main()
