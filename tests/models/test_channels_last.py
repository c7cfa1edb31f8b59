"""trainer.channels_last: NHWC backbone weights and clips, through e2e, recompute
and evaluation, with the same numbers as NCHW; auto is on for CUDA and conv backbones only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from videotrain.config.build import build_model, compose_cfg
from videotrain.models.video import frames_channels_last, wants_channels_last

CL = torch.channels_last


def test_auto_is_on_for_cuda_and_conv_backbones_only() -> None:
    resnet = build_model(compose_cfg(["model/backbone=resnet18"]), num_classes=3).backbone
    vit = build_model(compose_cfg(["model/backbone=vit_tiny"]), num_classes=3).backbone
    assert wants_channels_last("auto", "cuda", resnet)
    assert not wants_channels_last("auto", "cpu", resnet)
    assert not wants_channels_last("auto", "cuda", vit)  # one conv: the patch embedding
    assert wants_channels_last(True, "cpu", vit) and not wants_channels_last(False, "cuda", resnet)
    with pytest.raises(ValueError, match="trainer.channels_last"):
        wants_channels_last("yes", "cuda", resnet)


def test_frames_layout_is_a_channels_last_view_per_frame() -> None:
    video = torch.randn(2, 3, 3, 5, 4)  # (B, T, C, H, W)
    cl = frames_channels_last(video)
    assert torch.equal(cl, video) and frames_channels_last(cl) is cl
    frames = cl.flatten(0, 1)  # (B*T, C, H, W), a view
    assert frames.data_ptr() == cl.data_ptr() and frames.is_contiguous(memory_format=CL)
    assert cl[:, 1].stride(1) == 1  # one frame of each clip: still C innermost


def _run(channels_last: bool, memory: list[str]) -> tuple[torch.nn.Module, list[bool], torch.Tensor]:
    cfg = compose_cfg(["model/backbone=resnet18", "model.backbone.temporal_shift=0",
                       f"trainer.channels_last={str(channels_last).lower()}", *memory])
    torch.manual_seed(0)
    model = build_model(cfg, num_classes=3).train()
    layouts: list[bool] = []
    for m in model.backbone.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(lambda mod, i, o: layouts.append(o.is_contiguous(memory_format=CL)))
    torch.manual_seed(1)
    video, labels = torch.randn(2, 3, 3, 32, 32), torch.tensor([0, 2])
    F.cross_entropy(model(video), labels).backward()
    model.eval()
    with torch.no_grad():
        logits = model(video)
    return model, layouts, logits


SBP = ["memory=sbp", "memory.keep_ratio=0.5"]


@pytest.mark.parametrize("memory", [["memory=e2e"],
                                    ["memory=recompute", "memory.policy=optimal", "memory.budget_frac=0.5"],
                                    SBP, [*SBP, "memory.recompute=optimal"]],
                         ids=["e2e", "checkpoint-optimal", "sbp-frame", "sbp-checkpoint"])
def test_channels_last_forced_on_cpu_matches_nchw(memory: list[str]) -> None:
    """Every conv output is channels_last in training (recompute included) and evaluation;
    gradients, BN running statistics and eval logits equal the NCHW run's (float tolerance:
    the kernels differ)."""
    nhwc, layouts, logits = _run(True, memory)
    nchw, plain_layouts, plain_logits = _run(False, memory)
    assert nhwc.channels_last and not nchw.channels_last
    assert layouts and all(layouts)
    assert not all(plain_layouts)  # (N, C, 1, 1) maps count as both layouts
    conv = next(m for m in nhwc.backbone.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=CL)
    for (name, a), b in zip(nhwc.named_parameters(), nchw.parameters(), strict=True):
        assert (a.grad - b.grad).norm() <= 1e-3 * b.grad.norm() + 1e-6, name
    for a, b in zip(nhwc.buffers(), nchw.buffers(), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6)
    assert torch.allclose(logits, plain_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_model_lays_out_its_input(channels_last: bool) -> None:
    """The layout is the model's, not the caller's: a clip with C innermost (as decoded frames
    come) runs NCHW with channels_last off, and a contiguous clip runs NHWC with it on."""
    model = build_model(compose_cfg(["model/backbone=resnet18", "model.backbone.temporal_shift=0",
                                     f"trainer.channels_last={str(channels_last).lower()}"]), num_classes=3)
    inputs: list[torch.Tensor] = []
    conv = next(m for m in model.backbone.modules() if isinstance(m, nn.Conv2d))
    conv.register_forward_hook(lambda _m, args, _o: inputs.append(args[0]))
    video = torch.randn(2, 3, 32, 32, 3).permute(0, 1, 4, 2, 3)  # (B, T, C, H, W), C innermost
    video = video if not channels_last else video.contiguous()
    model.train()(video).sum().backward()
    model.eval()(video)
    fmt = CL if channels_last else torch.contiguous_format
    assert len(inputs) == 2 and all(x.is_contiguous(memory_format=fmt) for x in inputs)


def test_cpu_default_stays_nchw() -> None:
    model = build_model(compose_cfg(["model/backbone=resnet18", "device=cpu"]), num_classes=3)
    assert not model.channels_last
