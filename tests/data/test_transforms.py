"""The loaders' clips stay uint8; ``clips_to_device`` makes them the model's input. The
transforms' first step (the short side scaled) is what the decoders make per frame as they
decode it: the same size and the same pixels as the transform's resize of the whole clip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.transforms import v2

from videotrain.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    clips_to_device,
    eval_transform,
    frame_short_side,
    resize_frames,
    resized_size,
    short_side_resize,
    train_transform,
)
from videotrain.metrics.dispatch import aten_ops

CPU = torch.device("cpu")


@pytest.mark.parametrize("shape", [(2, 4, 3, 8, 8), (2, 3, 4, 3, 8, 8), (3, 4, 3, 8, 8)])
def test_clips_to_device_is_torchvisions_scale_and_normalize(shape: tuple[int, ...]) -> None:
    """(B, T, C, H, W) training, (B, V, T, C, H, W) evaluation, (V, T, C, H, W) prediction:
    the channel is dim -3 in all three."""
    clips = torch.randint(0, 256, shape, dtype=torch.uint8)
    want = v2.Normalize(list(IMAGENET_MEAN), list(IMAGENET_STD))(v2.ToDtype(torch.float32, scale=True)(clips))
    got = clips_to_device(clips, CPU)
    assert got.dtype == torch.float32 and got.shape == clips.shape
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_clips_to_device_is_one_op_and_leaves_normalized_floats_alone() -> None:
    clips = torch.randint(0, 256, (2, 4, 3, 8, 8), dtype=torch.uint8)
    clips_to_device(clips, CPU)  # the (shift, scale) constants are made once per device
    with aten_ops() as ops:
        clips_to_device(clips, CPU)
    assert dict(ops) == {"aten.addcmul": 1}  # reads the uint8 input: no float copy first
    normalized = torch.randn(2, 4, 3, 8, 8)
    assert clips_to_device(normalized, CPU) is normalized
    with pytest.raises(TypeError, match="uint8 frames or normalized floats, got torch.int16"):
        clips_to_device(clips.to(torch.int16), CPU)


def test_transforms_keep_uint8_a_quarter_of_the_bytes() -> None:
    clip = torch.randint(0, 256, (4, 3, 40, 48), dtype=torch.uint8)  # (T, C, H, W)
    train = train_transform(40, 32, (0.5, 1.0), hflip=True, randaugment=(2, 9), random_erasing=0.5)(clip)
    val = eval_transform(40, 32, num_crops=3)(clip)
    assert train.dtype == val.dtype == torch.uint8
    assert train.shape == (4, 3, 32, 32) and val.shape == (3, 4, 3, 32, 32)


# ------------------------------------------------- the first step, made by the decoders per frame
def _frames(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """``n`` uint8 ``(H, W, 3)`` frames like video: smooth gradients, noise, motion."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(xx / 9.0) * 90 + 128, np.cos(yy / 7.0) * 90 + 128, (xx + yy) % 256], -1)
    return np.stack([np.clip(np.roll(base, 3 * t, axis=1) + rng.normal(0, 20, base.shape), 0, 255)
                     for t in range(n)]).astype(np.uint8)


def test_frame_short_side_is_the_transforms_first_resize() -> None:
    """The decoders resize only for this module's transforms; for anything else they return
    frames at the source's size (and the transform does what it does)."""
    assert frame_short_side(eval_transform(128, 112, 3)) == 128
    assert frame_short_side(train_transform(64, 32)) == 64
    assert frame_short_side(short_side_resize(40)) == 40
    others = [lambda clip: clip, v2.Compose([v2.CenterCrop(32), short_side_resize(16)]),
              v2.Compose([v2.Resize(16, interpolation=v2.InterpolationMode.NEAREST)]),
              v2.Compose([v2.Resize(16, antialias=False)]), v2.Compose([v2.Resize((16, 20))]),
              v2.Compose([v2.Resize(16, max_size=20, antialias=True)])]
    assert [frame_short_side(t) for t in others] == [None] * len(others)


@settings(max_examples=200, deadline=None)
@given(height=st.integers(1, 300), width=st.integers(1, 300), short=st.integers(1, 200))
def test_resized_size_is_the_size_torchvision_makes(height: int, width: int, short: int) -> None:
    """What the read budget counts before decoding is the size the resize returns."""
    frame = torch.zeros((1, 3, height, width))  # the size rule is the dtype's: float, no AVX kernel
    assert tuple(short_side_resize(short)(frame).shape[-2:]) == resized_size(height, width, short)


@pytest.mark.parametrize("size", [(1080, 1920), (2160, 3840), (240, 320), (128, 171), (320, 240),
                                  (80, 100), (127, 255), (128, 128)])
def test_frames_resized_one_by_one_are_the_clip_resized(size: tuple[int, int]) -> None:
    """A frame resized alone as it is decoded (``resize_frames``, the ``(1, 3, H, W)`` layout
    the decoders give it) equals the same frame in the transform's resize of the clip, bit for
    bit: 1080p, 4K, smaller, the short side already the target (returned as it is),
    portrait, upscaled, odd sizes."""
    frames = _frames(2 if size[0] > 1080 else 4, *size)  # (T, H, W, 3)
    clip = short_side_resize(128)(torch.from_numpy(frames).permute(0, 3, 1, 2))  # as the dataset
    alone = torch.cat([resize_frames(torch.from_numpy(f[None]).permute(0, 3, 1, 2), 128)
                       for f in frames])
    assert alone.shape == clip.shape and min(clip.shape[-2:]) == 128
    assert torch.equal(alone, clip)
    if min(size) == 128:  # no work: the frame itself
        one = torch.from_numpy(frames[:1]).permute(0, 3, 1, 2)
        assert resize_frames(one, 128) is one
    # and the transform's own step is then a no-op: the same tensors as before
    assert torch.equal(eval_transform(128, 112, 3)(alone), eval_transform(128, 112, 3)(
        torch.from_numpy(frames).permute(0, 3, 1, 2)))
