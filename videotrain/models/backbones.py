"""Spatial backbones: torchvision image models turned into per-frame feature extractors (timm
models: ``videotrain.models.timm_backbone``; local weights: ``videotrain.models.weights``).

Every backbone honours one small contract (the ``FrameBackbone`` base), so memory strategies
never need ``isinstance`` checks on torchvision classes:

* ``forward(frames)``: ``(N, C, H, W) -> (N, D)``, one feature vector per frame;
* ``feature_dim``: ``D``;
* ``blocks()``: the residual / encoder blocks in execution order, which is where block-level
  SBP and per-block checkpointing attach.

``grid`` > 1 pools the last feature map to a ``grid x grid`` map instead of one global average
(ResNets only). A global average throws away *where* things are, which makes motion direction
hard to see for a per-frame model; a small grid keeps coarse position at little cost.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchvision import models
from torchvision.models.resnet import BasicBlock, ResNet
from torchvision.models.vision_transformer import VisionTransformer


class PretrainedWeightsUnavailable(RuntimeError):
    """Raised when ``model.pretrained`` is set but the weights cannot be fetched."""


class FrameBackbone(nn.Module):
    """Base class of the backbone contract; subclasses set ``feature_dim`` and ``net``."""

    feature_dim: int

    def blocks(self) -> list[nn.Module]:
        raise NotImplementedError

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
    """A torchvision ResNet without its classifier; features are ``C * grid**2`` wide."""

    def __init__(self, net: ResNet, grid: int = 1) -> None:
        super().__init__()
        net.fc = nn.Identity()
        net.avgpool = nn.AdaptiveAvgPool2d(grid)
        self.net = net
        self.grid = grid
        last = net.layer4[-1]
        width = (last.conv3 if hasattr(last, "conv3") else last.conv2).out_channels  # Bottleneck | Basic
        self.feature_dim = int(width) * grid * grid

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
    layers: list[int] | None = None,
) -> ResNetBackbone:
    """torchvision ``resnet18``/``resnet50`` (``depth``), or a BasicBlock ResNet with custom
    ``layers`` per stage (e.g. ``[1, 1, 1, 1]``, a CPU-friendly ResNet-10)."""
    if layers is not None:
        if pretrained:
            raise ValueError("model.pretrained: torchvision has no weights for a custom `layers` ResNet")
        if len(layers) != 4 or min(layers) < 1:
            raise ValueError(f"model.backbone.layers must be 4 positive ints, got {layers}")
        return ResNetBackbone(ResNet(BasicBlock, list(layers)), grid)
    if depth not in (18, 34, 50, 101, 152):
        raise ValueError(f"model.backbone.depth must be 18, 34, 50, 101 or 152, got {depth}")
    name = f"resnet{depth}"
    return ResNetBackbone(_load_weights(getattr(models, name), name, pretrained), grid)


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
