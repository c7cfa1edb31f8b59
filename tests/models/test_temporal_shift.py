"""TSM's temporal shift (``model.backbone.temporal_shift``): the shift itself, the shifted blocks,
order sensitivity, configs and errors, and evaluation in frame chunks."""

from __future__ import annotations

import copy

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from videotrain.config.build import CONFIG_DIR, build_model, clean_errors, validate
from videotrain.memory.base import encode_all_frames, set_clip_length
from videotrain.memory.estimate import eval_chunk
from videotrain.models.backbones import resnet
from videotrain.models.heads import TConvHead
from videotrain.models.temporal_shift import TemporalShift, temporal_shift
from videotrain.models.timm_backbone import timm_backbone
from videotrain.models.video import VideoClassifier

TINY_TIMM_RESNET = {"channels": (8, 16, 32, 64), "stem_width": 8, "zero_init_last": False}


def _backbone(shift: float = 0.25) -> torch.nn.Module:
    torch.manual_seed(0)
    return resnet(layers=[1, 1, 1, 1], grid=2, temporal_shift=shift)


def test_shift_moves_the_right_channels_one_frame_each_way_with_zero_padding() -> None:
    b, t, c = 2, 4, 8
    x = torch.arange(b * t * c * 2 * 3, dtype=torch.float32).view(b * t, c, 2, 3) + 1  # no zeros
    out = temporal_shift(x, t, 0.25).view(b, t, c, 2, 3)  # fold = 2
    clip = x.view(b, t, c, 2, 3)
    for i in range(t):
        # channels 0, 1: from the next frame (zeros after the last)
        want = clip[:, i + 1, :2] if i + 1 < t else torch.zeros_like(clip[:, i, :2])
        assert torch.equal(out[:, i, :2], want), i
        # channels 2, 3: from the previous frame (zeros before the first)
        want = clip[:, i - 1, 2:4] if i > 0 else torch.zeros_like(clip[:, i, 2:4])
        assert torch.equal(out[:, i, 2:4], want), i
        assert torch.equal(out[:, i, 4:], clip[:, i, 4:]), i  # the rest stays
    # clips do not leak into each other: clip 1's first frame got zeros, not clip 0's last frame
    assert torch.count_nonzero(out[1, 0, 2:4]) == 0


def test_shift_of_zero_channels_is_the_identity_and_partial_clips_are_refused() -> None:
    x = torch.randn(6, 4, 2, 2)
    assert temporal_shift(x, 3, 0.1) is x  # int(4 * 0.1) = 0 channels
    with pytest.raises(ValueError, match="whole clips of 4 frames"):
        temporal_shift(x, 4, 0.25)
    with pytest.raises(RuntimeError, match="clip length is not set"):
        TemporalShift(0.25)(x)


def test_shifted_block_is_the_torchvision_block_with_a_shifted_branch_input() -> None:
    """The reference: torchvision's own BasicBlock forward, with the shift as a pre-hook on
    conv1 (the branch's first layer); the identity path sees the unshifted input."""
    bb = _backbone()
    for i in (0, 1):  # layer1[0] (identity skip), layer2[0] (downsample skip)
        blk = bb.blocks()[i]
        plain = copy.deepcopy(blk)
        del plain.forward  # torchvision's BasicBlock.forward again
        plain.conv1.register_forward_pre_hook(lambda _m, args: (temporal_shift(args[0], 3, 0.25),))
        set_clip_length(bb, 3)
        x = torch.randn(6, blk.conv1.in_channels, 8, 8)
        torch.testing.assert_close(blk(x), plain(x), rtol=0, atol=0)


def _features(backbone: torch.nn.Module, video: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return encode_all_frames(backbone, video).features  # (B, T, D)


def test_shift_makes_the_backbone_see_order_and_without_it_frames_are_independent() -> None:
    video = torch.randn(2, 6, 3, 32, 32)
    reverse = video.flip(1)
    shifted, plain = _backbone(0.125).eval(), _backbone(0.0).eval()
    # without the shift: per-frame, so reversing the clip reverses the features, nothing more
    torch.testing.assert_close(_features(plain, reverse), _features(plain, video).flip(1))
    # with it, a frame's features depend on its neighbours, in order
    diff = (_features(shifted, reverse) - _features(shifted, video).flip(1)).abs().max()
    assert diff > 1e-3
    # and the same weights (state dict keys are unchanged) give the per-frame model at shift 0
    assert shifted.state_dict().keys() == plain.state_dict().keys()


def test_shift_zero_changes_nothing_in_the_blocks() -> None:
    bb = _backbone(0.0)
    assert not bb.mixes_frames
    assert all("forward" not in blk.__dict__ and not hasattr(blk, "temporal_shift") for blk in bb.blocks())


@pytest.mark.parametrize("chunk", [1, 5, 9])
def test_eval_in_frame_chunks_equals_one_forward_with_the_shift(chunk: int) -> None:
    """Chunks are rounded down to whole clips (at least one), so evaluation in chunks gives the
    same logits as one forward over every frame."""
    bb = _backbone()
    model = VideoClassifier(bb, TConvHead(bb.feature_dim, 4, hidden_dim=16)).eval()
    video = torch.randn(3, 4, 3, 32, 32)  # (B, T, C, H, W)
    calls: list[int] = []
    bb.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[0]))
    with torch.no_grad():
        whole = model(video)
        model.eval_frame_chunk = chunk
        chunked = model(video)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    assert calls[0] == 12 and all(n % 4 == 0 for n in calls[1:]) and sum(calls[1:]) == 12


def test_auto_eval_chunk_is_whole_clips() -> None:
    bb = _backbone()
    model = VideoClassifier(bb, TConvHead(bb.feature_dim, 4, hidden_dim=16)).eval()
    budget = 4 * 2**20  # bytes: room for a few frames only
    chunk = eval_chunk(model, (4, 5, 3, 64, 64), budget)
    assert chunk % 5 == 0 and 5 <= chunk < 20


def test_timm_resnet_takes_the_shift_and_other_timm_models_are_refused() -> None:
    torch.manual_seed(0)
    bb = timm_backbone("resnet10t", kwargs=TINY_TIMM_RESNET, temporal_shift=0.125).eval()
    assert bb.mixes_frames and all(isinstance(b.temporal_shift, TemporalShift) for b in bb.blocks())
    video = torch.randn(1, 4, 3, 32, 32)
    assert (_features(bb, video.flip(1)) - _features(bb, video).flip(1)).abs().max() > 1e-4
    with pytest.raises(ValueError, match="temporal_shift.*ResNet blocks only"):
        timm_backbone("convnext_atto", kwargs={"dims": (8, 16, 32, 64), "depths": (1, 1, 1, 1)},
                      temporal_shift=0.125)


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return validate(compose(config_name="config", overrides=list(overrides)))


@pytest.mark.parametrize("backbone", ["resnet10", "resnet18", "resnet50", "timm"])
def test_the_default_resnet10_shifts_and_the_other_configs_do_not(backbone: str) -> None:
    cfg = _cfg(f"model/backbone={backbone}")
    assert cfg.model.backbone.temporal_shift == (0.125 if backbone == "resnet10" else 0.0)


def test_config_values_are_checked(capsys) -> None:
    cfg = _cfg("model.backbone.temporal_shift=0.125", "model.head.hidden_dim=8")
    model = build_model(cfg, 4)
    assert model.backbone.mixes_frames and model.backbone.temporal_shift == 0.125
    with pytest.raises(ConfigCompositionException):  # the schema's type
        _cfg("model.backbone.temporal_shift=abc")
    with pytest.raises(SystemExit) as exit_info, clean_errors():  # Hydra's wrapper taken off
        build_model(_cfg("model.backbone.temporal_shift=0.6"), 4)
    assert exit_info.value.code == 2
    assert "error: model.backbone.temporal_shift must be a fraction" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown config key model.backbone.temporal_shift"):
        _cfg("model/backbone=vit_tiny", "+model.backbone.temporal_shift=0.125")


def test_sbp_with_the_shift_builds_and_with_recompute_is_one_error_line(capsys) -> None:
    """SBP runs on the shifted backbone through the lockstep code, built with the model; composed
    with recomputation (record/apply, which cannot shift) it cannot, which is one error line."""
    cfg = _cfg("model.backbone.temporal_shift=0.125", "memory=sbp")
    assert build_model(cfg, 4).strategy._traced[1] is not None  # the lockstep code
    cfg = _cfg("model.backbone.temporal_shift=0.125", "memory=sbp", "memory.recompute=blocks")
    with pytest.raises(SystemExit) as exit_info, clean_errors():
        build_model(cfg, 4)
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: memory.recompute does not compose"), err
    assert "model.backbone.temporal_shift=0" in err[0]
