"""Load a trained run: the one loader behind eval, predict and export (as MMAction2's
``init_recognizer`` is behind its tools), so all three read a checkpoint alike.

1. the checkpoint, ``weights_only`` (:func:`read_checkpoint`), before anything else;
2. its config by one rule (:func:`run_config`): the run folder's ``config.yaml``, else the
   checkpoint's, else the command line's; a file's config is checked
   (``config.files.checked_config``) and, unless this user sealed it, only its model part is
   read; ``run_config=false`` reads neither;
3. the model (:func:`trained_model`), built as plain e2e without initial weights, then the
   checkpoint's weights (its EMA's when the run kept one).
Why this order: docs/design/internals.md#loading-a-trained-run."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from videotrain.config.build import build_model, resolve_device
from videotrain.config.files import (
    MAX_CONFIG_BYTES,
    checked_config,
    listed_keys,
    model_part,
    parse_config_bytes,
)
from videotrain.data.loaders import READER_OPTIONS, read_index, resolve_root
from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.checkpoints.class_order import saved_class_names
from videotrain.models.finetune import trained_state
from videotrain.models.video import VideoClassifier
from videotrain.models.weights import key_mismatches
from videotrain.untrusted import (
    check_run_folder,
    is_regular,
    is_sealed_config,
    is_sealed_file,
    read_bytes,
    read_json,
    shown,
)
from videotrain.untrusted.bounds import (
    ANY,
    MAX_CLASSES,
    MAX_NAME_CHARS,
    MAX_RESULTS_BYTES,
    Map,
    Optional,
    Seq,
    Str,
)

log = logging.getLogger(__name__)

E2E = {"_target_": "videotrain.memory.e2e.EndToEnd"}
# results.json as this module reads it (for its class names); its size is bounded before
# reading, its values before parsing (untrusted.formats.read_json)
RESULTS = Map({"class_names": Optional(Seq(Str(MAX_NAME_CHARS), MAX_CLASSES))}, extra=ANY)


# ---------------------------------------------------------------------- the checkpoint
def read_checkpoint(cfg: DictConfig) -> tuple[Path, dict[str, Any]]:
    """``cfg.checkpoint``'s path and contents, read with ``torch.load(weights_only=True)``
    (``videotrain.engine.checkpoints.format.load``): a file that needs arbitrary unpickling is refused
    (``UnsafeCheckpointError``) and nothing in it runs. Call it before reading any data."""
    if not cfg.get("checkpoint"):
        raise ValueError("checkpoint=PATH is required (e.g. checkpoint=outputs/.../checkpoints/last.ckpt)")
    path = Path(str(cfg.checkpoint)).expanduser()
    if not os.path.lexists(path):
        raise FileNotFoundError(f"checkpoint: file not found: {shown(path)}")
    run_dir = run_folder(path)
    if run_dir is not None:  # a shared run folder: its own files only, before reading any
        check_run_folder(run_dir, "read from")
    blob = ckpt.load(path, map_location="cpu")  # a regular file only, no FIFO or device
    if not isinstance(blob, dict):
        raise ValueError(f"checkpoint {shown(path)} holds a {type(blob).__name__}, not a state "
                         "dict or a videotrain checkpoint")
    return path, blob


# ---------------------------------------------------------------------- the run's config
def find_run_config(checkpoint: Path) -> Path | None:
    """``config.yaml`` of the training run a checkpoint belongs to (``RUN/checkpoints/x``).
    A ``config.yaml`` that is a link, FIFO or device is returned too, and refused when read
    (never silently passed over for the checkpoint's stored config)."""
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if os.path.lexists(folder / "config.yaml"):
            return folder / "config.yaml"
    return None


def run_folder(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint sits in (the folder of its ``config.yaml``), or None."""
    found = find_run_config(checkpoint)
    return found.parent if found is not None else None


def _synthetic_root_from_file(base: DictConfig, composed: DictConfig,
                              overrides: list[str]) -> None:
    """A config read from a file does not choose where data is generated: for synthetic data
    its ``data.root`` is replaced by this command line's (null: the user's own cache,
    ``$VIDEOTRAIN_CACHE``), unless the command line sets ``data.root`` itself."""
    data = base.get("data")
    if not isinstance(data, DictConfig) or data.get("name") != "synthetic":
        return
    if any(o.split("=", 1)[0].lstrip("+~") == "data.root" for o in overrides):
        return  # apply_overrides takes the user's value
    mine = OmegaConf.select(composed, "data.root", default=None) \
        if OmegaConf.select(composed, "data.name", default=None) == "synthetic" else None
    if data.get("root") not in (None, mine):
        log.info("data.root of the run's config (%s) is not used: synthetic data is generated "
                 "into this command line's data.root or the cache", shown(data.get("root")))
    with open_dict(base):
        base.data.root = mine


def run_config(cfg: DictConfig, overrides: list[str], keep: tuple[str, ...] = (),
               state: dict[str, Any] | None = None,
               scores_data: bool = False) -> tuple[DictConfig, Path | None]:
    """The config of the run that wrote ``cfg.checkpoint``, the one reader of a trained run's
    config (eval, predict, export): its run folder's ``config.yaml``, else the config stored in
    the checkpoint ``state``, with the command line's ``overrides`` and the app's own nodes
    (``keep``) taken from ``cfg``. Either file's config is checked first
    (``videotrain.config.files``: refused, naming the key, before anything of it is built or
    resolved). Only a config this user sealed (``videotrain.untrusted.own``: their own run) is used whole;
    of any other only what defines the model is (``config_files.model_part``; ``scores_data``,
    eval: a dataset that differs from the run's is refused). With ``run_config=false`` neither
    is read: ``cfg`` (the command line's config groups) describes the model and the checkpoint
    supplies only the weights. Returns the config and the run folder (None when the checkpoint
    is not in one), whose ``results.json`` names the classes."""
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
        source, data = shown(saved), read_bytes(saved, MAX_CONFIG_BYTES, "config file")
        base = parse_config_bytes(data, source)  # checked before its seal is
        own = is_sealed_file(saved, data)
    elif stored is not None:
        source = f"the config stored in {shown(path)}"
        base = checked_config(stored, source)  # bounded before it is serialized for the seal
        own = is_sealed_config(stored, state.get("config_seal") if state is not None else None)
    else:
        return cfg, run_dir
    if own:
        _synthetic_root_from_file(base, cfg, overrides)
        log.info("model and data settings from %s (your own run: its seal is yours; overridden "
                 "by the command line)", source)
        return apply_overrides(base, cfg, overrides, keep), run_dir
    mine, unused = model_part(base, cfg, overrides, source, scores_data)
    log.info("%s is not sealed by you (someone else's run, or one from before runs were "
             "sealed): the model from it, all else from this command line%s "
             "(docs/cluster.md#configs-read-from-files)", source,
             f"; not used: {listed_keys(unused, 12)}" if unused else "")
    return apply_overrides(mine, cfg, [], keep), run_dir  # mine has the overrides already


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


@dataclasses.dataclass
class OpenedRun:
    """A checkpoint read (``state``, from ``path``) and the config that describes its model
    (``cfg``, by :func:`run_config`'s rule); ``run_dir`` is its run folder, if it is in one."""

    cfg: DictConfig
    path: Path
    state: dict[str, Any]
    run_dir: Path | None


def open_run(cfg: DictConfig, overrides: list[str], keep: tuple[str, ...] = (),
             scores_data: bool = False) -> OpenedRun:
    """``cfg.checkpoint`` read (``weights_only``, first) and its run's checked config with the
    command line's ``overrides`` (and the app's own nodes ``keep``) over it: steps 1 and 2 of
    the module docstring, what eval, predict and export all start with (``scores_data``: eval,
    see :func:`run_config`)."""
    path, state = read_checkpoint(cfg)
    cfg, run_dir = run_config(cfg, overrides, keep, state, scores_data)
    return OpenedRun(cfg, path, state, run_dir)


# ---------------------------------------------------------------------- the model
def model_state(blob: dict[str, Any]) -> dict[str, Any]:
    """The weights a videotrain checkpoint ships (its EMA's when the run kept one, see
    ``recipe.ema_decay``), or the plain state dict it is."""
    return trained_state(blob)[0]


def checkpoint_classes(state: dict[str, Any], path: Path) -> int:
    """The number of classes the checkpoint's head scores (rows of ``head.fc.weight``)."""
    weight = state.get("head.fc.weight")  # every head ends in a Linear `fc`: (K, D)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"checkpoint {shown(path)}: cannot tell the number of classes (no "
                         "head.fc.weight of 2 dimensions)")
    if not 0 < weight.shape[0] <= MAX_CLASSES:  # checkpoint.load checked it stores its values
        raise ValueError(f"checkpoint {shown(path)}: head.fc.weight has {weight.shape[0]} rows; "
                         f"a head scores 1 to {MAX_CLASSES} classes")
    return int(weight.shape[0])


def load_trained_weights(model: VideoClassifier, blob: dict[str, Any], path: Path) -> None:
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
        raise ValueError(f"checkpoint {shown(path)} does not fit the configured model "
                         "(model/backbone, model/head and the number of classes must match "
                         f"training): {shown(str(err), 600)}") from err


def check_shapes(cfg: DictConfig, state: dict[str, Any], path: Path, num_classes: int) -> None:
    """The configured model built on the meta device (no memory) and its keys and shapes
    compared with the checkpoint's weights ``state``, so that nothing real is built from a
    checkpoint that does not fit it; the error names the keys at fault (escaped)."""
    with torch.device("meta"):
        skeleton = build_model(cfg, num_classes, init=False)
    parts = key_mismatches(skeleton.state_dict(), state)
    if parts:
        raise ValueError(f"checkpoint {shown(path)} does not fit the configured model "
                         "(model/backbone, model/head and the number of classes must match "
                         f"training): {'; '.join(parts)}")


def trained_model(cfg: DictConfig, blob: dict[str, Any], path: Path, device: torch.device,
                  num_classes: int | None = None) -> VideoClassifier:
    """``cfg``'s model with the checkpoint's weights, in evaluation mode on ``device``: built
    plain e2e and without initial weights (step 3 of the module docstring). ``num_classes``
    defaults to the checkpoint's head; eval passes the dataset's, so a dataset with another
    number of classes stops here naming the checkpoint."""
    if num_classes is None:
        num_classes = checkpoint_classes(model_state(blob), path)
    cfg = copy.deepcopy(cfg)  # the caller's config keeps its memory group
    with open_dict(cfg):
        cfg.memory = E2E
    check_shapes(cfg, model_state(blob), path, num_classes)  # before any real allocation
    model = build_model(cfg, num_classes, init=False)
    load_trained_weights(model, blob, path)
    return model.to(device).eval()


# ---------------------------------------------------------------------- the classes
def class_names_of(cfg: DictConfig, run_dir: Path | None, num_classes: int,
                   blob: dict[str, Any] | None = None) -> list[str]:
    """The class names of the run: the checkpoint's, else ``results.json``'s, else the
    dataset's (for an HMDB51 checkpoint from before checkpoints recorded them, in the order it
    was trained with), else placeholders."""
    saved = (blob or {}).get("class_names")
    if _names(saved, num_classes):
        return list(saved)
    results = run_dir / "results.json" if run_dir is not None else None
    if results is not None and is_regular(results):
        # a regular file, bounded; an error names the file, the line or key, never the text
        found = read_json(results, RESULTS, MAX_RESULTS_BYTES, "results.json")
        names = found.get("class_names") if isinstance(found, dict) else None
        if _names(names, num_classes):
            return list(names)
    try:
        d = cfg.data
        root = resolve_root(d.name, d.get("root"), OmegaConf.to_container(d.get("synthetic")) if
                            d.get("synthetic") is not None else None, d.layout)
        options = {k: d.get(k) for k in READER_OPTIONS.get(d.layout, ())}
        names = read_index(d.layout, root, "train", d.get("num_classes"), options).class_names
        if len(names) == num_classes:
            known, _ = saved_class_names(blob or {}, list(names), d.layout)
            return known or list(names)
        log.warning("the dataset has %d classes, the checkpoint %d", len(names), num_classes)
    except Exception as err:  # noqa: BLE001 - the dataset may not be on this machine
        log.warning("class names unknown (no results.json next to the checkpoint, and the "
                    "dataset's annotations could not be read: %s); using class_<i>",
                    shown(str(err), 300))
    return [f"class_{i}" for i in range(num_classes)]


def _names(names: Any, num_classes: int) -> bool:
    """``names`` is a list of ``num_classes`` strings (what a checkpoint or results.json
    records); they are shown escaped wherever they are printed (``untrusted.shown``)."""
    return (isinstance(names, list) and len(names) == num_classes
            and all(isinstance(n, str) for n in names))


# ---------------------------------------------------------------------- all of it
@dataclasses.dataclass
class TrainedModel:
    """A checkpoint's model, ready for inference, with the config that describes it."""

    cfg: DictConfig
    model: VideoClassifier
    class_names: list[str]
    state: dict[str, Any]
    path: Path


def load_trained(cfg: DictConfig, overrides: list[str], keep: tuple[str, ...] = (),
                 device: str | None = None) -> TrainedModel:
    """``cfg.checkpoint``'s model (evaluation mode, on ``device``, default ``cfg.device``), its
    run's config and its class names: the whole module docstring, for predict and export."""
    run = open_run(cfg, overrides, keep)
    num_classes = checkpoint_classes(model_state(run.state), run.path)
    model = trained_model(run.cfg, run.state, run.path, resolve_device(device or run.cfg.device),
                          num_classes)
    names = class_names_of(run.cfg, run.run_dir, num_classes, run.state)
    return TrainedModel(run.cfg, model, names, run.state, run.path)
