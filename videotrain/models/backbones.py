"""Spatial backbones: torchvision image models turned into per-frame feature extractors (timm
models: ``videotrain.models.timm_backbone``; local weights: ``videotrain.models.weights``).

Every backbone honours one small contract (``FrameBackbone``), so memory strategies never need
``isinstance`` checks on torchvision classes: ``forward(frames)`` maps ``(N, C, H, W) -> (N, D)``;
``feature_dim`` is ``D``; ``blocks()`` lists the residual / encoder blocks in execution order
(where per-block recomputation and TSM's shift attach); ``set_clip_length(T)`` gives the frames
per clip of the next calls, used only by a backbone whose frames interact (``mixes_frames``),
which must then see whole clips in time order.

``grid`` > 1 pools the last feature map to a ``grid x grid`` map instead of one global average
(ResNets only), so that a per-frame model keeps the coarse position that motion needs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx, nn
from torchvision import models
from torchvision.models.resnet import BasicBlock, ResNet
from torchvision.models.vision_transformer import VisionTransformer

from videotrain.models.temporal_shift import (
    FrameTracer,
    add_temporal_shift,
    check_fraction,
    set_num_frames,
)


class PretrainedWeightsUnavailable(RuntimeError):
    """Raised when ``model.pretrained`` is set but the weights cannot be fetched."""


class FrameBackbone(nn.Module):
    """Base class of the backbone contract; subclasses set ``feature_dim`` and ``net``."""

    feature_dim: int
    temporal_shift: float = 0.0  # TSM's shift, fraction of channels each way (0: frames independent)

    def blocks(self) -> list[nn.Module]:
        raise NotImplementedError

    @property
    def mixes_frames(self) -> bool:
        """Whether the frames of a clip interact inside the backbone (then it must see whole
        clips, in time order; frame SBP meets its kept and dropped frames at each shift)."""
        return self.temporal_shift > 0

    def set_clip_length(self, num_frames: int) -> None:
        """Frames per clip of the next calls (``N = B * num_frames``); a no-op without a shift."""
        if self.mixes_frames:
            set_num_frames(self, num_frames)

    def fx_tracer(self) -> fx.Tracer:
        """The ``torch.fx`` tracer for this backbone (temporal shifts stay leaves)."""
        return FrameTracer()

    # Loading image-model weights into ``self.net`` (``model.pretrained_path``,
    # ``videotrain.models.weights``): the classifier's state-dict prefixes, which are dropped,
    # and a hook that adapts a checkpoint's keys or shapes to the model.
    def classifier_prefixes(self) -> tuple[str, ...]:
        return ()

    def adapt_image_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, D)
        raise NotImplementedError


def _load_weights(builder: Callable[..., nn.Module], name: str, pretrained: str | bool | None):
    """Build torchvision model ``name``, with weights when asked; offline gives a clear error.

    ``pretrained``: None/False (from scratch), True or ``"DEFAULT"``, or a member name of the
    model's weights enum (e.g. ``"IMAGENET1K_V1"``).
    """
    if not pretrained:
        return builder(weights=None)
    key = "DEFAULT" if pretrained is True else str(pretrained)
    enum = models.get_model_weights(name)
    try:
        weights = enum[key]
    except KeyError:
        members = ", ".join(["DEFAULT", *enum.__members__])
        raise ValueError(f"model.pretrained={key!r} is not a {enum.__name__} member ({members})") from None
    try:
        return builder(weights=weights)
    except Exception as err:  # URLError, SSL errors, HTTP errors, corrupt cache ...
        raise PretrainedWeightsUnavailable(
            f"model.pretrained={key!r}: could not load torchvision weights {weights} for {name} "
            f"({type(err).__name__}: {err}). If this machine is offline, copy the file to "
            f"{weights.url.rsplit('/', 1)[-1]!r} under $TORCH_HOME/hub/checkpoints, or set "
            f"model.pretrained=null to train from scratch."
        ) from err


class ResNetBackbone(FrameBackbone):
    """A torchvision ResNet without its classifier; features are ``C * grid**2`` wide;
    ``temporal_shift`` > 0 adds TSM's residual shift to every block
    (``videotrain.models.temporal_shift``)."""

    def __init__(self, net: ResNet, grid: int = 1, temporal_shift: float = 0.0) -> None:
        super().__init__()
        net.fc = nn.Identity()
        net.avgpool = nn.AdaptiveAvgPool2d(grid)
        self.net = net
        self.grid = grid
        last = net.layer4[-1]
        width = (last.conv3 if hasattr(last, "conv3") else last.conv2).out_channels  # Bottleneck | Basic
        self.feature_dim = int(width) * grid * grid
        self.temporal_shift = check_fraction(temporal_shift)
        if self.temporal_shift:
            add_temporal_shift(self.blocks(), self.temporal_shift, "this ResNet")

    def blocks(self) -> list[nn.Module]:
        return [b for layer in (self.net.layer1, self.net.layer2, self.net.layer3, self.net.layer4) for b in layer]

    def classifier_prefixes(self) -> tuple[str, ...]:
        return ("fc",)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, D)
        return self.net(frames)


class ViTBackbone(FrameBackbone):
    """A torchvision VisionTransformer without its head; the class token is the feature."""

    def __init__(self, net: VisionTransformer) -> None:
        super().__init__()
        net.heads = nn.Identity()
        self.net = net
        self.feature_dim = int(net.hidden_dim)

    def blocks(self) -> list[nn.Module]:
        return list(self.net.encoder.layers)

    def classifier_prefixes(self) -> tuple[str, ...]:
        return ("heads",)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, D)
        return self.net(frames)


def resnet(
    depth: int = 18, pretrained: str | bool | None = None, grid: int = 1,
    layers: list[int] | None = None, temporal_shift: float = 0.0,
) -> ResNetBackbone:
    """torchvision ``resnet18``/``resnet50`` (``depth``), or a BasicBlock ResNet with custom
    ``layers`` per stage (e.g. ``[1, 1, 1, 1]``, a CPU-friendly ResNet-10). ``temporal_shift``:
    TSM's fraction of channels shifted each way in every residual block (0.125 in TSM; 0 = off)."""
    if layers is not None:
        if pretrained:
            raise ValueError("model.pretrained: torchvision has no weights for a custom `layers` ResNet")
        if len(layers) != 4 or min(layers) < 1:
            raise ValueError(f"model.backbone.layers must be 4 positive ints, got {layers}")
        return ResNetBackbone(ResNet(BasicBlock, list(layers)), grid, temporal_shift)
    if depth not in (18, 34, 50, 101, 152):
        raise ValueError(f"model.backbone.depth must be 18, 34, 50, 101 or 152, got {depth}")
    name = f"resnet{depth}"
    check_fraction(temporal_shift)  # before any download
    return ResNetBackbone(_load_weights(getattr(models, name), name, pretrained), grid, temporal_shift)


def vit(
    image_size: int = 224,
    patch_size: int = 16,
    num_layers: int = 12,
    num_heads: int = 12,
    hidden_dim: int = 768,
    mlp_dim: int = 3072,
    dropout: float = 0.0,
    pretrained: str | bool | None = None,
) -> ViTBackbone:
    """A torchvision VisionTransformer; the defaults are ``vit_b_16``."""
    if pretrained:
        if (image_size, patch_size, num_layers, hidden_dim) != (224, 16, 12, 768):
            raise ValueError("model.pretrained: torchvision weights exist only for vit_b_16 at 224 px")
        return ViTBackbone(_load_weights(models.vit_b_16, "vit_b_16", pretrained))
    net = VisionTransformer(
        image_size=image_size,
        patch_size=patch_size,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        mlp_dim=mlp_dim,
        dropout=dropout,
    )
    return ViTBackbone(net)
