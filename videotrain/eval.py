"""``python -m videotrain.eval checkpoint=PATH [overrides]``: evaluate a trained model the way
papers report it, with ``eval.clips`` temporal clips x ``eval.crops`` spatial crops per video
(Kinetics convention 10 x 3) and the views' softmax aggregated by ``eval.aggregate``.

It writes ``eval.json`` (clip- and video-level top-1/top-5, mean class accuracy, the views,
skipped videos), ``per_class.csv`` and ``confusion.png`` into the Hydra run directory. The
same evaluation runs at the end of training with ``trainer.test_after_fit=true``.

Which model: when the checkpoint sits in a training run's folder (``RUN/checkpoints/``), the
run's ``config.yaml`` is the base and only the overrides given to this command replace parts
of it, so ``checkpoint=PATH`` alone evaluates what was trained (on its own val split). A
checkpoint outside its run folder brings its run's config itself (every videotrain checkpoint
stores it), which is used the same way. Without either, or with ``run_config=false``, the
config is composed as usual and must describe the trained model; the checkpoint then supplies
only the weights.

The file is read with ``torch.load(weights_only=True)`` (``videotrain.engine.checkpoint.load``)
before anything else: a file that needs arbitrary unpickling is refused, and nothing in it runs.
Either config goes through ``videotrain.config_files`` (``run_config``) before anything of
it is used: a ``_target_`` the shipped config groups do not build, or a key the
schema does not have, is refused naming the key (``RefusedConfig``, exit status 2).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn

from videotrain.build import (
    CONFIG_DIR,
    build_eval_data,
    build_model,
    build_precision,
    check_values,
    clean_errors,
    eval_settings,
    resolve_device,
    validate,
)
from videotrain.config_files import checked_config, read_config_file
from videotrain.engine import checkpoint as ckpt
from videotrain.engine.class_order import check_class_order
from videotrain.engine.evaluate import multi_view_test
from videotrain.models.finetune import trained_state

log = logging.getLogger(__name__)


def find_run_config(checkpoint: Path) -> Path | None:
    """``config.yaml`` of the training run a checkpoint belongs to (``RUN/checkpoints/x``)."""
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if (folder / "config.yaml").is_file():
            return folder / "config.yaml"
    return None


def run_config(cfg: DictConfig, overrides: list[str], keep: tuple[str, ...] = (),
               state: dict[str, Any] | None = None) -> tuple[DictConfig, Path | None]:
    """The config of the run that wrote ``cfg.checkpoint``, the one reader of a trained run's
    config (eval, predict, export): its run folder's ``config.yaml``, else the config stored in
    the checkpoint ``state``, with the command line's ``overrides`` and the app's own nodes
    (``keep``) taken from ``cfg``. Either file's config is checked first
    (``videotrain.config_files``: refused, naming the key, before anything of it is built or
    resolved). With ``run_config=false`` neither is read: ``cfg`` (the command line's config
    groups) describes the model and the checkpoint supplies only the weights. Returns the config
    and the run folder (None when the checkpoint is not in one), whose ``results.json`` names
    the classes."""
    path = Path(str(cfg.checkpoint)).expanduser()
    saved = find_run_config(path)
    run_dir = saved.parent if saved is not None else None
    stored = state.get("config") if state is not None else None
    if not cfg.get("run_config", True):
        if saved is not None or stored is not None:
            log.info("run_config=false: the model and data are this command line's config groups "
                     "(%s is not read); the checkpoint supplies the weights",
                     saved or f"the config stored in {path}")
        return cfg, run_dir
    if saved is not None:
        source, base = str(saved), read_config_file(saved)
    elif stored is not None:
        source = f"the config stored in {path}"
        base = checked_config(stored, source)
    else:
        return cfg, run_dir
    log.info("model and data settings from %s (overridden by the command line)", source)
    return apply_overrides(base, cfg, overrides, keep), run_dir


def apply_overrides(base: DictConfig, composed: DictConfig, overrides: list[str],
                    keep: tuple[str, ...] = ()) -> DictConfig:
    """``base`` with the parts named by command-line ``overrides`` (``data.root=...``,
    ``model/backbone=resnet18``) taken from ``composed``, and ``eval``/``checkpoint`` and the
    app's own nodes (``keep``) always."""
    out = OmegaConf.create(OmegaConf.to_container(base, resolve=True))
    keys = ["eval", "checkpoint", *keep]
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~").replace("/", ".")
        if not key.startswith("hydra"):
            keys.append(key)
    for key in keys:
        value = OmegaConf.select(composed, key, throw_on_missing=False)
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        OmegaConf.update(out, key, value, merge=False, force_add=True)
    return out


def read_checkpoint(cfg: DictConfig) -> tuple[Path, dict[str, Any]]:
    """``cfg.checkpoint``'s path and contents, read with ``torch.load(weights_only=True)``
    (``videotrain.engine.checkpoint.load``): a file that needs arbitrary unpickling is refused
    (``UnsafeCheckpointError``) and nothing in it runs. Call it before reading any data."""
    if not cfg.get("checkpoint"):
        raise ValueError("checkpoint=PATH is required (e.g. checkpoint=outputs/.../checkpoints/last.ckpt)")
    path = Path(str(cfg.checkpoint)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: file not found: {path}")
    blob = ckpt.load(path, map_location="cpu")
    if not isinstance(blob, dict):
        raise ValueError(f"checkpoint {path} holds a {type(blob).__name__}, not a state dict or "
                         "a videotrain checkpoint")
    return path, blob


def model_state(blob: dict[str, Any]) -> dict[str, Any]:
    """The weights a videotrain checkpoint ships (its EMA's when the run kept one, see
    ``recipe.ema_decay``), or the plain state dict it is."""
    return trained_state(blob)[0]


def load_trained_weights(model: nn.Module, blob: dict[str, Any], path: Path) -> None:
    """The checkpoint's weights into ``model``, with its evaluation memory budget: the training
    steps' measured peaks (``eval.frame_chunk=auto`` stays within what training needed)."""
    peaks = blob.get("peaks") or []  # MB
    if peaks:
        model.eval_memory_budget = max(peaks[1:] or peaks) * 2**20
    state, kind = trained_state(blob)
    if kind == "EMA weights":
        log.info("checkpoint %s: loading its EMA weights (the run's recipe.ema_decay)", path)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"checkpoint {path} does not fit the configured model (model/backbone, "
                         f"model/head and the number of classes must match training): {err}") from err


def evaluate_checkpoint(cfg: DictConfig, out_dir: str | Path,
                        checkpoint: tuple[Path, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Load ``cfg.checkpoint`` (or the ``(path, contents)`` already read by ``read_checkpoint``)
    into the configured model and run the multi-view evaluation."""
    path, blob = checkpoint or read_checkpoint(cfg)  # first, before any data is read
    check_values(cfg)
    device = resolve_device(cfg.device)
    precision = build_precision(cfg, device)
    settings = eval_settings(cfg)  # bad eval.* values fail before any data is read
    data, bad = build_eval_data(cfg, device, report_dir=out_dir)
    # a head trained on another numbering of the classes would score every video wrongly
    check_class_order(blob, path, data.class_names, cfg.data.get("layout"), "evaluate")
    model = build_model(cfg, data.num_classes, init=False)
    load_trained_weights(model, blob, path)
    model.to(device)
    return multi_view_test(model, data, bad, settings, precision, device, out_dir,
                           max_bad_fraction=float(cfg.data.max_bad_fraction),
                           progress=bool(cfg.trainer.progress), checkpoint=str(path),
                           num_frames=int(cfg.data.num_frames), crop_size=int(cfg.data.crop_size))


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    with clean_errors():
        return evaluate(validate(cfg), list(hc.overrides.task), hc.runtime.output_dir)


def evaluate(cfg: DictConfig, overrides: list[str], out_dir: str | Path) -> float:
    """What the command runs: the checkpoint (``weights_only``), then its run's checked config
    (``run_config``) with the command line's ``overrides`` over it, then
    ``evaluate_checkpoint``; returns the video top-1."""
    checkpoint = read_checkpoint(cfg)
    cfg, _ = run_config(cfg, overrides, state=checkpoint[1])
    log.info("evaluation settings: %s", asdict(eval_settings(cfg)))
    summary = evaluate_checkpoint(cfg, out_dir, checkpoint)
    return summary["video_top1"]


if __name__ == "__main__":
    main()
