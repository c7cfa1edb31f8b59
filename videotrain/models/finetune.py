"""Fine-tuning: ``model.init_from`` (start from a trained video model) and
``model.freeze_backbone`` (train the head only).

``model.init_from=CKPT`` reads a videotrain checkpoint (its EMA weights when it has them, see
``videotrain.engine.ema``) or a plain state dict of a ``VideoClassifier`` (``.safetensors`` or a
``torch.save`` file), always with ``torch.load(weights_only=True)``:

* the backbone's weights are loaded always, and must fit exactly (a different backbone is an
  error that lists the keys at fault);
* the head's weights are loaded when every shape matches, and otherwise the head keeps its fresh
  initialisation, reported in the log with the shapes that differ: the usual case of a Kinetics-400
  model fine-tuned on UCF101's 101 classes. When the head would be loaded, the checkpoint's
  classes must not be the dataset's in another order (``engine.class_order``: its recorded
  class names, or an HMDB51 checkpoint from before they were recorded): that is refused, since
  the head's rows would score the wrong classes.

Nothing else of the checkpoint (optimizer, schedule, step) is taken: fine-tuning is a new run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.checkpoints.class_order import check_class_order
from videotrain.models.weights import key_mismatches, read_state_dict, tensors_of
from videotrain.untrusted import PATH_CHARS, quoted, shown

log = logging.getLogger(__name__)

_SHOW = 6  # keys listed per kind in a message


class InitFromMismatch(ValueError):
    """``model.init_from`` holds a backbone that does not fit the configured one."""


def trained_state(blob: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """The weights a videotrain checkpoint ships (the EMA's when the run kept one, else the
    model's), or the plain state dict ``blob`` is; with a word on which it was."""
    if "ema_model" in blob:
        return blob["ema_model"], "EMA weights"
    if "model" in blob and isinstance(blob["model"], dict):
        return blob["model"], "model weights"
    return blob, "state dict"


def read_init_state(path: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of ``model.init_from``: a videotrain checkpoint or a plain state dict."""
    _, state, kind = _read_init(path)
    return state, kind


def _read_init(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """``read_init_state``, with the file's whole contents first ({} for safetensors)."""
    p = Path(str(path)).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model.init_from: file not found: {shown(p)}")
    if p.suffix == ".safetensors":  # its errors name model.init_from, not pretrained_path
        return {}, read_state_dict(p, "model.init_from"), "state dict"
    try:  # weights_only=True; refuses pickled code, FIFOs, inflating records
        blob = ckpt.load(p, map_location="cpu", follow=True)
    except ckpt.CheckpointError as err:
        raise type(err)(f"model.init_from: {err}") from err
    if not isinstance(blob, dict):
        raise ValueError(f"model.init_from={quoted(str(p), PATH_CHARS)} holds a {type(blob).__name__}, not a state "
                         "dict or a videotrain checkpoint")
    state, kind = trained_state(blob)
    return blob, tensors_of(state), kind


def _part(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _listing(keys: list[str]) -> str:
    return ", ".join(shown(k) for k in keys[:_SHOW]) + (f", ... ({len(keys) - _SHOW} more)" if len(keys) > _SHOW else "")


def init_from(model: nn.Module, path: str | Path, class_names: list[str] | None = None,
              layout: str | None = None) -> dict[str, Any]:
    """Load ``path`` into ``model`` (a ``VideoClassifier``) as the module docstring says;
    ``class_names`` (and ``layout``, ``data.layout``) are the dataset's, for the class-order
    check. Returns ``{"source", "weights", "head": "loaded" | "re-initialised", "head_mismatch"}``."""
    blob, state, kind = _read_init(path)
    backbone, head = _part(state, "backbone."), _part(state, "head.")
    if not backbone:
        raise InitFromMismatch(f"model.init_from={quoted(str(path), PATH_CHARS)} has no backbone.* weights: it must be a "
                               "videotrain checkpoint or a VideoClassifier state dict (for image-model "
                               "weights use model.pretrained_path)")
    parts = key_mismatches(model.backbone.state_dict(), backbone)
    if parts:
        raise InitFromMismatch(f"model.init_from={quoted(str(path), PATH_CHARS)}: its backbone does not fit the configured "
                               f"model/backbone: " + "; ".join(parts))
    model.backbone.load_state_dict(backbone, strict=False)  # only BN counters may be absent

    own_head = model.head.state_dict()
    mismatch = sorted(
        f"{k} {tuple(head[k].shape) if k in head else 'absent'} vs {tuple(v.shape)}"
        for k, v in own_head.items() if k not in head or head[k].shape != v.shape)
    extra = sorted(k for k in head if k not in own_head)
    if not mismatch and not extra:
        if class_names is not None:  # the head's rows must score the classes they are read as
            check_class_order(blob, f"model.init_from={path}", class_names, layout,
                              "fine-tune from", other_classes_ok=True)
        model.head.load_state_dict(head)
        log.info("model.init_from: loaded backbone and head (%s, %d tensors) from %s",
                 kind, len(backbone) + len(head), path)
        outcome = "loaded"
    else:
        log.warning("model.init_from: loaded the backbone (%s, %d tensors) from %s; the head was "
                    "re-initialised, since its shapes differ (file vs model: %s)", kind,
                    len(backbone), path, _listing(mismatch + [f"{k} (not in model)" for k in extra]))
        outcome = "re-initialised"
    return {"source": str(path), "weights": kind, "head": outcome, "head_mismatch": mismatch + extra}


def freeze_backbone(model: nn.Module) -> int:
    """Train the head only: the backbone's parameters stop requiring gradients and its
    BatchNorm statistics stop updating (``VideoClassifier`` keeps a frozen backbone in eval
    mode). Returns the number of frozen parameters."""
    frozen = 0
    for p in model.backbone.parameters():
        p.requires_grad_(False)
        frozen += p.numel()
    model.backbone_frozen = True
    model.train(model.training)  # applies eval mode to the backbone now
    return frozen
