"""Which frames of a video make a clip: ``data.sampler=random|segment``.

``random`` (the default) picks time *windows*: one random window of ``clip_duration`` seconds
at training time, ``num_clips`` windows spaced uniformly over the video at evaluation
(pytorchvideo's clip samplers); the decoder then takes ``num_frames`` frames evenly spaced over
the frames inside each window. A clip covers ``num_frames * sampling_rate`` source frames, a
fraction of a long video.

``segment`` is TSN's sparse sampling (Wang et al., 2016): the *whole* video is split into
``num_frames`` equal segments of frame indices and one frame is taken from each, a random one
at training time and the centre one at evaluation. Every clip sees the whole action, which is
what 2D-backbone + temporal-head models and Something-Something v2 (short videos whose label
depends on the whole motion) are trained with. With ``num_clips > 1`` evaluation clip ``c`` of
``K`` takes the frame at fraction ``(c + 0.5) / K`` of each segment (TSN's multi-clip test):
``K`` clips evenly offset within the segments, the centre for ``K = 1``.

Randomness comes from the global ``random``/``torch`` generators, which the dataset seeds per
sample from ``(seed, epoch, index)``: the same item gets the same frames in any worker.
"""

from __future__ import annotations

import torch
from pytorchvideo.data.clip_sampling import ConstantClipsPerVideoSampler, RandomClipSampler

SAMPLERS = ("random", "segment")


def check_sampler(sampler: str) -> None:
    """A ``ValueError`` naming ``data.sampler`` for an unknown sampler."""
    if sampler not in SAMPLERS:
        raise ValueError(f"data.sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")


def clip_windows(duration: float, clip_duration: float, train: bool,
                 num_clips: int = 1) -> list[tuple[float, float]]:
    """``data.sampler=random``: ``[start, end)`` windows in seconds: one random window
    (training) or ``num_clips`` uniformly spaced ones (evaluation)."""
    if train:
        infos = [RandomClipSampler(clip_duration)(0.0, duration, {})]
    else:
        sampler = ConstantClipsPerVideoSampler(clip_duration, num_clips)
        infos = [sampler(0.0, duration, {}) for _ in range(num_clips)]
    return [(float(i.clip_start_sec), float(i.clip_end_sec)) for i in infos]


def uniform_indices(length: int, num: int) -> torch.Tensor:
    """``num`` evenly spaced frame indices into ``length`` frames (repeats if too short): the
    frames a ``random`` window keeps of those inside it, in both decoders."""
    return torch.linspace(0, max(length - 1, 0), num).round().long()  # (num,)


def segment_indices(length: int, num_segments: int, train: bool, num_clips: int = 1,
                    generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """``data.sampler=segment``: frame indices into a video of ``length`` frames, one per
    segment, as ``(num_segments,)`` long tensors: one clip (training, a uniformly random frame
    of each segment) or ``num_clips`` clips (evaluation, evenly offset within the segments).

    Segment ``k`` holds the frames ``[k * length // T, (k + 1) * length // T)``: every frame is
    in exactly one segment and their sizes differ by at most one. A video shorter than ``T``
    frames has empty segments, which take the frame where they start (frames repeat).
    """
    if length < 1:
        raise ValueError(f"a video with {length} frames has no segments")
    bounds = torch.arange(num_segments + 1) * length // num_segments  # (T + 1,) segment starts
    starts, sizes = bounds[:-1], bounds[1:] - bounds[:-1]  # (T,), (T,)
    if train:
        fractions = [torch.rand(num_segments, generator=generator, dtype=torch.float64)]  # [0, 1)
    else:
        fractions = [torch.full((num_segments,), (c + 0.5) / num_clips, dtype=torch.float64)
                     for c in range(num_clips)]
    return [(starts + (f * sizes).long()).clamp_(max=length - 1) for f in fractions]
