"""Clip transforms built from torchvision.transforms.v2 (which handles video tensors).

Input to every transform: a uint8 clip ``(T, C, H, W)``. The same random parameters apply to
every frame of a clip, because v2 treats a ``tv_tensors.Video`` as one sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_transform(
    short_side: int,
    crop_size: int,
    scale: Sequence[float] = (0.25, 1.0),
    hflip: bool = True,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    randaugment: tuple[int, int] = (0, 9),
    random_erasing: float = 0.0,
) -> v2.Compose:
    """Short-side scale, random resized crop, optional flip, RandAugment, normalize, random
    erasing -> (T, C, crop, crop).

    ``hflip`` must be off when left/right is part of the label (the synthetic task).
    ``randaugment``: (ops per clip, magnitude of 31 bins); 0 ops = off. ``random_erasing``: the
    probability of erasing one box. Both draw one set of parameters per clip, applied to every
    frame (the clip is one ``tv_tensors.Video``), so augmentation never flickers in time.
    """
    steps: list[v2.Transform] = [
        v2.Resize(short_side, antialias=True),
        v2.RandomResizedCrop(crop_size, scale=tuple(scale), antialias=True),
    ]
    if hflip:
        steps.append(v2.RandomHorizontalFlip())
    ops, magnitude = randaugment
    if ops > 0:
        steps.append(v2.RandAugment(num_ops=ops, magnitude=magnitude))  # on uint8 frames
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    if random_erasing > 0:
        steps.append(v2.RandomErasing(p=random_erasing, value=0))  # 0: the mean, once normalized
    return v2.Compose([v2.Lambda(_as_video), *steps, v2.Lambda(_as_plain)])


def _as_video(clip: torch.Tensor) -> tv_tensors.Video:
    return tv_tensors.Video(clip)


def _as_plain(clip: torch.Tensor) -> torch.Tensor:
    return clip.as_subclass(torch.Tensor)


class SpatialCrops(torch.nn.Module):
    """``num_crops`` square crops evenly spaced along the long side (1 = centre, 3 = the
    left/centre/right convention of Kinetics evaluation). Returns (crops, T, C, s, s)."""

    def __init__(self, size: int, num_crops: int) -> None:
        super().__init__()
        if num_crops < 1:
            raise ValueError(f"data.val_crops must be >= 1, got {num_crops}")
        self.size, self.num_crops = size, num_crops

    def forward(self, clip: torch.Tensor) -> torch.Tensor:  # (T, C, H, W)
        h, w = clip.shape[-2:]
        s = self.size
        if self.num_crops == 1:
            offsets = [((h - s) // 2, (w - s) // 2)]
        elif w >= h:
            offsets = [((h - s) // 2, round(i * (w - s) / (self.num_crops - 1))) for i in range(self.num_crops)]
        else:
            offsets = [(round(i * (h - s) / (self.num_crops - 1)), (w - s) // 2) for i in range(self.num_crops)]
        return torch.stack([clip[..., y : y + s, x : x + s] for y, x in offsets])


def eval_transform(
    short_side: int,
    crop_size: int,
    num_crops: int = 1,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> v2.Compose:
    """Short-side scale, ``num_crops`` spatial crops, normalize -> (crops, T, C, s, s)."""
    if crop_size > short_side:
        raise ValueError(f"data.crop_size={crop_size} exceeds data.short_side={short_side}")
    return v2.Compose(
        [
            v2.Resize(short_side, antialias=True),
            SpatialCrops(crop_size, num_crops),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(list(mean), list(std)),
        ]
    )
