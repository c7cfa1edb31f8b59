"""Shared tiny models and measuring tools for the memory-strategy tests (exposed as ``kit``)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from videotrain.memory import StochasticBackprop
from videotrain.models.backbones import FrameBackbone, resnet, vit
from videotrain.models.heads import MeanHead, TConvHead
from videotrain.models.video import VideoClassifier

B, T, PX, K = 2, 8, 32, 5


def tiny_resnet() -> FrameBackbone:
    torch.manual_seed(0)
    return resnet(layers=[1, 1, 1, 1])


def tiny_vit() -> FrameBackbone:
    torch.manual_seed(0)
    return vit(image_size=PX, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)


# timm models at tiny widths (the real model names, shrunk through timm.create_model's kwargs):
# a ResNet (BatchNorm), a ConvNeXt (LayerNorm2d, depthwise convs) and a ViT (patch 16: 2x2 tokens)
TIMM_TINY: dict[str, tuple[str, dict]] = {
    "timm_resnet": ("resnet10t", {"channels": (8, 16, 32, 64), "stem_width": 8,
                                  "zero_init_last": False}),  # BN weight 0 would hide the branch
    "timm_convnext": ("convnext_atto", {"dims": (8, 16, 32, 64), "depths": (1, 1, 1, 1),
                                      "ls_init_value": 1.0}),  # 1e-6 would hide the branch
    "timm_vit": ("vit_tiny_patch16_224", {"depth": 2, "embed_dim": 32, "num_heads": 2}),
}
TIMM = tuple(TIMM_TINY)  # the names, for parametrizations


def tiny_timm(key: str) -> FrameBackbone:
    from videotrain.models.timm_backbone import timm_backbone

    torch.manual_seed(0)
    name, kwargs = TIMM_TINY[key]
    return timm_backbone(name, kwargs=kwargs)


BACKBONES: dict[str, Callable[[], FrameBackbone]] = {
    "resnet": tiny_resnet, "vit": tiny_vit,
    **{key: (lambda key=key: tiny_timm(key)) for key in TIMM_TINY},
}


def make_head(dim: int, kind: str = "tconv") -> nn.Module:
    torch.manual_seed(1)
    return TConvHead(dim, K, hidden_dim=16) if kind == "tconv" else MeanHead(dim, K)


def model_pair(backbone: str, strategy, head: str = "tconv") -> tuple[VideoClassifier, VideoClassifier]:
    """(plain e2e model, model with ``strategy``) from identical initial weights, in train mode."""
    bb = BACKBONES[backbone]()
    hd = make_head(bb.feature_dim, head)
    ref = VideoClassifier(copy.deepcopy(bb), copy.deepcopy(hd))
    return ref.train(), VideoClassifier(bb, hd, strategy).train()


def shifted_pair(strategy) -> tuple[VideoClassifier, VideoClassifier]:
    """(e2e model, model with ``strategy``), both ResNets with a temporal shift of 1/4 of the
    channels each way (``model.backbone.temporal_shift``)."""
    torch.manual_seed(0)
    bb = resnet(layers=[1, 1, 1, 1], temporal_shift=0.25)
    head = make_head(bb.feature_dim)
    ref = VideoClassifier(copy.deepcopy(bb), copy.deepcopy(head))
    return ref.train(), VideoClassifier(bb, head, strategy).train()


class RecordApply(StochasticBackprop):
    """Frame SBP on record/apply (``videotrain.memory.sbp.split``) whatever the backbone: the path
    an untraceable backbone takes, as the oracle the lockstep code is compared with."""

    def _lockstep_graph(self, backbone: nn.Module) -> None:
        return None


def video(seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 3, PX, PX, generator=g).requires_grad_(requires_grad)  # (B,T,C,H,W)


def labels() -> torch.Tensor:
    return torch.arange(B) % K


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One forward + backward of cross-entropy; returns the logits ``(B, K)``."""
    logits = model(x)
    nn.functional.cross_entropy(logits.float(), labels()).backward()
    return logits.detach()


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def bn_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in module.named_buffers()}


def assert_close_dicts(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def row_detach(x: torch.Tensor, keep_rows_mask: torch.Tensor) -> torch.Tensor:
    """Rows (leading dim) outside ``keep_rows_mask (N,)`` lose their gradient."""
    mask = keep_rows_mask.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, x, x.detach())


def detach_bn_inputs(module: nn.Module, keep_rows_mask: torch.Tensor) -> list:
    """Pre-hooks making dropped rows constants at every BN input of ``module``."""
    return [
        m.register_forward_pre_hook(lambda _m, args: (row_detach(args[0], keep_rows_mask),))
        for m in module.modules()
        if isinstance(m, _BatchNorm)
    ]


def saved_bytes(fn: Callable[[], object], exclude: nn.Module) -> int:
    """Unique storage bytes autograd saves while running ``fn`` (parameters of ``exclude``
    are not activations and are left out)."""
    params = {p.untyped_storage().data_ptr() for p in exclude.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def python_calls(fn: Callable[[], object]) -> int:
    """The Python function calls one call of ``fn`` makes (``sys.setprofile``): a host-work
    count that is the same on a loaded CI machine, where time is not."""
    calls = [0]

    def count(frame, event, arg) -> None:  # noqa: ANN001
        if event == "call":
            calls[0] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


@pytest.fixture
def kit() -> SimpleNamespace:
    return SimpleNamespace(**{
        name: obj for name, obj in globals().items()
        if not name.startswith("_") and name not in ("pytest", "kit")
    })
