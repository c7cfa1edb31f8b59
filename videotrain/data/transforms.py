"""Clip transforms built from torchvision.transforms.v2 (which handles video tensors), and the
normalization that turns their output into the model's input on the device.

Input to every transform: a uint8 clip ``(T, C, H, W)``; the output is uint8 too. The same
random parameters apply to every frame of a clip, because v2 treats a ``tv_tensors.Video`` as
one sample. Scaling to [0, 1] and normalizing with mean/std happen on the training device
(:func:`clips_to_device`), not in the loader's workers: a uint8 batch is a quarter of the float
one through the workers' shared memory, the pinned copy and the host-to-device copy, and on a
GPU the normalization is one elementwise kernel instead of two float passes per clip on a CPU.

The first step of both transforms, the short side scaled to ``data.short_side``, is also made
by the decoders, one frame at a time as it becomes RGB (:func:`frame_short_side`,
:func:`resize_frames`): one read of a 1080p or 4K video then holds frames of the output's
size, not the source's (docs/data.md, "Media budgets"). The transform's own step is then a
no-op (torchvision returns a frame already at its size as it is), and a frame resized alone is
the same frame resized in its clip, bit for bit (tests/data/test_transforms.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from torchvision import tv_tensors
from torchvision.transforms import InterpolationMode, v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MEAN_PIXEL = tuple(round(255 * m) for m in IMAGENET_MEAN)  # what random erasing paints: ~0 once normalized


def train_transform(
    short_side: int,
    crop_size: int,
    scale: Sequence[float] = (0.25, 1.0),
    hflip: bool = True,
    randaugment: tuple[int, int] = (0, 9),
    random_erasing: float = 0.0,
) -> v2.Compose:
    """Short-side scale, random resized crop, optional flip, RandAugment, random erasing ->
    uint8 (T, C, crop, crop).

    ``hflip`` must be off when left/right is part of the label (the synthetic task).
    ``randaugment``: (ops per clip, magnitude of 31 bins); 0 ops = off. ``random_erasing``: the
    probability of erasing one box. Both draw one set of parameters per clip, applied to every
    frame (the clip is one ``tv_tensors.Video``), so augmentation never flickers in time. An
    erased box holds the mean pixel (:data:`MEAN_PIXEL`), which normalizes to about 0.
    """
    steps: list[v2.Transform] = [
        short_side_resize(short_side),
        v2.RandomResizedCrop(crop_size, scale=tuple(scale), antialias=True),
    ]
    if hflip:
        steps.append(v2.RandomHorizontalFlip())
    ops, magnitude = randaugment
    if ops > 0:
        steps.append(v2.RandAugment(num_ops=ops, magnitude=magnitude))  # on uint8 frames
    if random_erasing > 0:
        steps.append(v2.RandomErasing(p=random_erasing, value=list(MEAN_PIXEL)))
    return v2.Compose([v2.Lambda(tv_tensors.Video), *steps, v2.ToPureTensor()])


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


def eval_transform(short_side: int, crop_size: int, num_crops: int = 1) -> v2.Compose:
    """Short-side scale, ``num_crops`` spatial crops -> uint8 (crops, T, C, s, s)."""
    if crop_size > short_side:
        raise ValueError(f"data.crop_size={crop_size} exceeds data.short_side={short_side}")
    return v2.Compose([short_side_resize(short_side), SpatialCrops(crop_size, num_crops)])


def short_side_resize(short_side: int) -> v2.Resize:
    """The first step of :func:`train_transform` and :func:`eval_transform`: the short side
    scaled to ``short_side`` (bilinear, antialiased), the other in proportion."""
    return v2.Resize(short_side, antialias=True)


def frame_short_side(transform: object) -> int | None:
    """The short side ``transform`` first scales every frame to, when its first step is
    :func:`short_side_resize`'s (the transforms of this module); else None.

    The dataset hands it to the decoders, which then make that step per frame as it becomes
    RGB (:func:`resize_frames`). Any other transform (a custom callable, another first step)
    gets its frames at the source's size, as before."""
    steps = list(transform.transforms) if isinstance(transform, v2.Compose) else [transform]
    steps = [s for s in steps if not (isinstance(s, v2.Lambda) and s.lambd is tv_tensors.Video)]
    first = steps[0] if steps else None
    if (type(first) is v2.Resize and first.size is not None and len(first.size) == 1
            and first.max_size is None and first.antialias is True
            and getattr(first.interpolation, "value", first.interpolation) == "bilinear"):
        return int(first.size[0])
    return None


def resized_size(height: int, width: int, short_side: int) -> tuple[int, int]:
    """``(height, width)`` of a ``height x width`` frame once :func:`short_side_resize` has
    scaled it (torchvision's rule: the long side rounded down)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(short_side * long / short)
    return (new_long, short_side) if width <= height else (short_side, new_long)


def resize_frames(frames: torch.Tensor, short_side: int) -> torch.Tensor:
    """uint8 frames ``(N, C, H, W)`` scaled as :func:`short_side_resize` scales a clip: the
    same torchvision kernel, which resizes each frame on its own, so that frames resized one
    by one as they are decoded equal the clip resized whole. Frames at the size already are
    returned as they are."""
    return v2.functional.resize(frames, [short_side], interpolation=InterpolationMode.BILINEAR,
                                antialias=True)


@lru_cache(maxsize=8)
def _affine(device: torch.device, mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(shift, scale)``, each (C, 1, 1) float32 on ``device``: ``(x / 255 - m) / s`` as
    ``shift + x * scale``, made once per device."""
    shift = torch.tensor([-m / s for m, s in zip(mean, std, strict=True)]).view(-1, 1, 1)
    scale = torch.tensor([1.0 / (255.0 * s) for s in std]).view(-1, 1, 1)
    return shift.to(device), scale.to(device)


def clips_to_device(video: torch.Tensor, device: torch.device, mean: Sequence[float] = IMAGENET_MEAN,
                    std: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """A loader's uint8 clips ``(..., C, H, W)`` (any leading dims: (B, T), (B, V, T), (V, T))
    as the model's input on ``device``: float32, scaled to [0, 1] and normalized with
    ``mean``/``std``. The uint8 batch is copied (``non_blocking``: asynchronous from pinned
    memory) and normalized there in one ``addcmul``, which reads the uint8 input directly.
    A floating-point ``video`` is taken as normalized already and only moved."""
    x = video.to(device, non_blocking=True)
    if x.is_floating_point():
        return x
    if x.dtype != torch.uint8:
        raise TypeError(f"clips must be uint8 frames or normalized floats, got {x.dtype}")
    shift, scale = _affine(x.device, tuple(mean), tuple(std))
    return torch.addcmul(shift, x, scale)  # (..., C, H, W) float32
