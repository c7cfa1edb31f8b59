"""``model.pretrained_path=FILE``: local image-model weights for the backbone, offline.

The file is an image model's state dict (timm's or torchvision's key names, the classifier
included or not), as ``.safetensors`` or as a ``.pth``/``.pt``/``.bin`` file read with
``torch.load(weights_only=True)`` (tensors only: no code runs). A dict wrapping the state dict
under ``state_dict`` / ``model`` / ``state_dict_ema`` / ``model_ema`` is unwrapped, and a
``module.`` prefix (DDP) is removed.

What is loaded goes into ``backbone.net`` (the image model inside the backbone contract):

* the classifier's keys (``backbone.classifier_prefixes()``: ``fc`` for ResNets, ``heads`` for
  torchvision ViTs, timm's ``pretrained_cfg["classifier"]``) are dropped;
* ``backbone.adapt_image_state_dict`` adapts the rest (timm: the model family's checkpoint
  filter, which resamples a ViT's position embedding to the model's grid);
* every other key must match: missing keys, unexpected keys and shape mismatches are an error
  that lists them (``num_batches_tracked`` counters may be absent).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from videotrain.engine.checkpoints import format as ckpt
from videotrain.untrusted import PATH_CHARS, open_regular, quoted, shown

log = logging.getLogger(__name__)

WRAPPER_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")
_SHOW = 8  # keys listed per kind in an error message


class PretrainedWeightsMismatch(ValueError):
    """``model.pretrained_path`` holds weights that do not fit the backbone."""


def read_state_dict(path: str | Path, key: str = "model.pretrained_path") -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` or ``torch.save`` weights file, unwrapped (see the
    module docstring). ``key`` is the config key that named the file, which every error names
    (``model.pretrained_path``, ``model.init_from``). The file must be a regular file (it may
    sit behind links, as in a model cache; a FIFO or device is refused, not read)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{key}: file not found: {shown(p)}")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            open_regular(p, what=key, follow=True).close()  # not a FIFO or device
            obj: Any = load_file(str(p), device="cpu")
            ckpt.check_tensors(obj, p)
        else:  # weights_only, bounded records and tensors, the refused global named
            obj = ckpt.load(p, map_location="cpu", follow=True)
    except Exception as err:  # noqa: BLE001 - corrupt file, pickled code, unknown format
        raise ValueError(f"{key}={quoted(str(p), PATH_CHARS)}: cannot read weights "
                         f"({type(err).__name__}: {shown(str(err), 400)}); expected a "
                         ".safetensors file or a torch.save'd state dict") from err
    while isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        key = next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), dict)), None)
        if key is None:
            break
        obj = obj[key]
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"{key}={quoted(str(p), PATH_CHARS)}: no state dict (tensor mapping) in "
                         "the file")
    return tensors_of(obj)


def tensors_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a state dict, without the ``module.`` prefix a DDP wrapper adds."""
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def _listing(kind: str, keys: list[str]) -> str:
    """The first keys of a kind, each escaped and cut (a file's keys may be anyone's text)."""
    listed = ", ".join(shown(k) for k in keys[:_SHOW])
    listed += f", ... ({len(keys) - _SHOW} more)" if len(keys) > _SHOW else ""
    return f"{len(keys)} {kind}: {listed}"


def key_mismatches(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> list[str]:
    """What keeps ``state`` from loading into a module whose state dict is ``own``: its missing
    keys (BatchNorm's ``num_batches_tracked`` counters may be absent), unexpected keys and shape
    mismatches, each described with the first keys; empty when it fits."""
    missing = sorted(k for k in own if k not in state and not k.endswith("num_batches_tracked"))
    unexpected = sorted(k for k in state if k not in own)
    shapes = sorted(f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in state
                    if k in own and state[k].shape != own[k].shape)
    return [_listing(kind, keys) for kind, keys in (
        ("missing keys", missing), ("unexpected keys", unexpected),
        ("shape mismatches (file vs model)", shapes)) if keys]


def load_backbone_weights(backbone: nn.Module, path: str | Path) -> dict[str, list[str]]:
    """Load the image weights at ``path`` into ``backbone.net``; returns what was dropped
    (``{"dropped": [classifier keys]}``). Raises ``PretrainedWeightsMismatch`` naming the
    missing, unexpected and mis-shaped keys."""
    net = getattr(backbone, "net", None)
    if not isinstance(net, nn.Module):
        raise TypeError(f"model.pretrained_path: {type(backbone).__name__} has no image model "
                        "(.net) to load weights into")
    state = read_state_dict(path)
    prefixes = tuple(backbone.classifier_prefixes()) if hasattr(backbone, "classifier_prefixes") else ()
    own = net.state_dict()

    def is_classifier(key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in prefixes) and key not in own

    dropped = sorted(k for k in state if is_classifier(k))
    state = {k: v for k, v in state.items() if k not in dropped}
    if hasattr(backbone, "adapt_image_state_dict"):
        state = backbone.adapt_image_state_dict(state)
    parts = key_mismatches(own, state)
    if parts:
        raise PretrainedWeightsMismatch(
            f"model.pretrained_path={quoted(str(path), PATH_CHARS)} does not fit {type(backbone).__name__} "
            f"({type(net).__name__}): " + "; ".join(parts)
            + ". The file must hold this image model's weights (classifier keys "
            f"{', '.join(prefixes) or '-'} are dropped).")
    net.load_state_dict(state, strict=False)  # only num_batches_tracked may be absent
    log.info("model.pretrained_path: loaded %d tensors from %s into the backbone%s", len(state),
             path, f" (dropped classifier keys: {', '.join(dropped)})" if dropped else "")
    return {"dropped": dropped}
