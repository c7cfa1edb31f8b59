"""The loaders' clips stay uint8; ``clips_to_device`` makes them the model's input."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2

from videotrain.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    clips_to_device,
    eval_transform,
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
