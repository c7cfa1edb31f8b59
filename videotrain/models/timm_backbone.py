"""``model/backbone=timm``: any timm image model as the per-frame backbone.

``timm.create_model(name, num_classes=0)`` gives pooled features ``(N, C, H, W) -> (N, D)``;
ViT-family models take ``dynamic_img_size=True`` so any frame size works. The backbone
contract: ``blocks()`` found by the layouts timm models share (``blocks``, ``stages[i].blocks``,
``stages[i]``, ``layer1..4``), and ``fx_tracer()``, a tracer that knows timm's untraceable
modules (timm's own notrace registry), so the recompute planner and SBP's lockstep code can
trace timm models. Weights: ``model.pretrained`` (timm's hub) or ``model.pretrained_path``
(local, offline). Details: docs/design/internals.md#timm-backbones."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from videotrain.models.backbones import FrameBackbone, PretrainedWeightsUnavailable
from videotrain.models.temporal_shift import FrameTracer, add_temporal_shift, check_fraction


def _timm() -> Any:
    try:
        import timm
    except ImportError as err:  # a dependency of the package; missing only in a broken install
        raise ImportError("model/backbone=timm needs the timm package (pip install 'timm>=1.0')") from err
    return timm


class TimmTracer(FrameTracer):
    """``torch.fx`` tracer with timm's notrace registry: the registered modules stay leaves
    (one ``call_module`` node) and the registered functions are wrapped (one ``call_function``
    node), as in ``timm.layers.create_feature_extractor``.

    Self-attention modules (timm's ``Attention`` and look-alikes with ``qkv`` and ``proj``
    projections) are leaves too, like torchvision's ``nn.MultiheadAttention``: traced through,
    the q/k/v split gives the recompute planner ~30 tensors and many parallel paths per ViT
    block, and its exact DP over lower sets becomes slow (vit_tiny_patch16_224: 364 tensors,
    over the lower-set cap, ~3 min to plan on a CPU, against 196 tensors, exact, ~13 s)."""

    def __init__(self) -> None:
        from timm.layers import _fx

        super().__init__(autowrap_functions=tuple(_fx.get_notrace_functions()))
        self._leaves = tuple(_fx.get_notrace_modules())

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (isinstance(m, self._leaves) or is_attention(m)
                or super().is_leaf_module(m, module_qualified_name))


def is_attention(m: nn.Module) -> bool:
    """A self-attention module with ``qkv`` and ``proj`` linear projections (timm's)."""
    return isinstance(getattr(m, "qkv", None), nn.Linear) and isinstance(getattr(m, "proj", None), nn.Linear)


def find_blocks(net: nn.Module) -> list[nn.Module]:
    """The residual / transformer blocks of a timm model, in execution order (see the module
    docstring for the layouts); empty when none of them applies."""

    def seq(m: Any) -> list[nn.Module] | None:
        return list(m) if isinstance(m, nn.Sequential | nn.ModuleList) and len(m) else None

    if (found := seq(getattr(net, "blocks", None))) is not None:
        if all(seq(b) for b in found):  # stages of blocks (EfficientNet, MobileNet)
            return [blk for stage in found for blk in stage]
        return found
    stages = seq(getattr(net, "stages", None))
    if stages is not None:
        out: list[nn.Module] = []
        for stage in stages:
            inner = seq(getattr(stage, "blocks", None))
            out += inner if inner is not None else (seq(stage) or [])
        if out:
            return out
    layers = [getattr(net, f"layer{i}", None) for i in range(1, 5)]
    if all(seq(layer) for layer in layers):
        return [b for layer in layers for b in layer]
    return []


class TimmBackbone(FrameBackbone):
    """A timm model built with ``num_classes=0``: pooled features per frame."""

    def __init__(self, net: nn.Module, name: str, temporal_shift: float = 0.0) -> None:
        super().__init__()
        self.net = net
        self.name = name
        self.feature_dim = int(getattr(net, "head_hidden_size", None) or net.num_features)
        self.temporal_shift = check_fraction(temporal_shift)
        if self.temporal_shift:  # ResNet blocks only (a clear error for the others)
            add_temporal_shift(self.blocks(), self.temporal_shift, f"timm model {name!r}")

    def blocks(self) -> list[nn.Module]:
        found = find_blocks(self.net)
        if not found:
            raise TypeError(
                f"timm model {self.name!r} ({type(self.net).__name__}): no blocks found (looked for "
                "net.blocks, net.stages[i].blocks, net.stages[i] and net.layer1..layer4); what works "
                "per block (memory.policy=blocks, model.backbone.temporal_shift) cannot use it"
            )
        return found

    def classifier_prefixes(self) -> tuple[str, ...]:
        """State-dict prefixes of the image classifier (dropped when loading image weights)."""
        cls = (getattr(self.net, "pretrained_cfg", None) or {}).get("classifier") or ()
        return tuple([cls] if isinstance(cls, str) else cls)

    def adapt_image_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model family's own checkpoint filter (timm's ``checkpoint_filter_fn``: original
        checkpoints' key names, position embeddings resampled to this model's grid), if any."""
        import sys

        fn = getattr(sys.modules.get(type(self.net).__module__), "checkpoint_filter_fn", None)
        if not callable(fn):
            return state
        try:
            return dict(fn(state, self.net))
        except Exception:  # noqa: BLE001 - a filter that does not apply: load the keys as they are
            return state

    def fx_tracer(self) -> fx.Tracer:
        return TimmTracer()

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, D)
        return self.net(frames)


def _create(timm: Any, name: str, pretrained: bool, kwargs: dict[str, Any], dynamic: bool) -> nn.Module:
    """``timm.create_model``, asking for ``dynamic_img_size`` where the model takes it."""
    if dynamic and "dynamic_img_size" not in kwargs and "img_size" not in kwargs:
        try:
            return timm.create_model(name, pretrained=pretrained, num_classes=0,
                                     dynamic_img_size=True, **kwargs)
        except TypeError as err:  # a model without the option (CNNs take any size anyway)
            if "dynamic_img_size" not in str(err):
                raise
    return timm.create_model(name, pretrained=pretrained, num_classes=0, **kwargs)


def _plain(value: Any) -> Any:
    """Config containers as plain dicts and tuples: a list from the config (``dims: [8, 16]``)
    reaches timm as an OmegaConf ``ListConfig``, which some models' ops refuse
    (``split_with_sizes`` in ConvNeXt)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return tuple(_plain(v) for v in value)
    return value


def timm_backbone(
    name: str,
    pretrained: bool | str | None = None,
    dynamic_img_size: bool = True,
    drop_path_rate: float = 0.0,
    kwargs: Mapping[str, Any] | None = None,
    temporal_shift: float = 0.0,
) -> TimmBackbone:
    """timm model ``name`` as a per-frame backbone.

    ``pretrained``: None/False (from scratch); True or ``"DEFAULT"`` (timm's default weights for
    ``name``); any other string is a timm pretrained tag (``name.TAG``, e.g. ``"augreg_in21k"``).
    ``dynamic_img_size``: build ViT-family models for any input size (ignored by models without
    the option, and when ``kwargs`` fixes ``img_size``). ``drop_path_rate``: stochastic depth
    (the recipe's drop-path), drawn per frame, since the backbone sees a clip's frames as a batch
    of images. ``kwargs``: more ``timm.create_model`` arguments (``depth``, ``embed_dim``, ...).
    ``temporal_shift``: TSM's residual shift in every block, as for ``resnet`` (timm ResNets only).
    """
    timm = _timm()
    if not name:
        raise ValueError("model.backbone.name: a timm model name is required (e.g. resnet18, "
                         "convnext_atto, vit_tiny_patch16_224; timm.list_models() lists them)")
    kwargs = _plain(dict(kwargs or {}))
    for reserved, key in (("num_classes", "videotrain"), ("pretrained", "model.pretrained"),
                          ("drop_path_rate", "model.backbone.drop_path_rate")):
        if reserved in kwargs:
            raise ValueError(f"model.backbone.kwargs.{reserved} is set by {key}; remove it")
    if not 0.0 <= drop_path_rate < 1.0:
        raise ValueError(f"model.backbone.drop_path_rate must be in [0, 1), got {drop_path_rate}")
    if drop_path_rate:
        kwargs["drop_path_rate"] = drop_path_rate
    check_fraction(temporal_shift)  # before any download
    base = name.split(".", 1)[0]
    if not timm.is_model(base):
        close = timm.list_models(f"*{base[:6]}*")[:8]
        raise ValueError(f"model.backbone.name={name!r} is not a timm model"
                         + (f" (similar: {', '.join(close)})" if close else ""))
    if not pretrained:
        return TimmBackbone(_create(timm, name, False, kwargs, dynamic_img_size), name, temporal_shift)
    full = name
    if pretrained is not True and str(pretrained) not in ("DEFAULT", "true", "True"):
        full = f"{base}.{pretrained}"  # a pretrained tag
    tags = timm.list_pretrained(f"{base}.*")
    if not tags or ("." in full and full not in tags):
        raise ValueError(f"model.pretrained={pretrained!r}: timm has no such weights for {base!r}; "
                         f"available: {', '.join(tags) or 'none'} (true = the first)")
    try:
        net = _create(timm, full, True, kwargs, dynamic_img_size)
    except TypeError:
        raise  # a bad model.backbone.kwargs argument, not a download error
    except Exception as err:  # no network, hub errors, HTTP errors, corrupt cache ...
        raise PretrainedWeightsUnavailable(
            f"model.pretrained={pretrained!r}: could not load timm weights for {full!r} "
            f"({type(err).__name__}: {err}). If this machine is offline, save the weights "
            f"(.safetensors or .pth) elsewhere and set model.pretrained=null "
            f"model.pretrained_path=FILE, or set model.pretrained=null to train from scratch."
        ) from err
    return TimmBackbone(net, full, temporal_shift)
