"""Synthetic action-recognition data written as real MP4 files.

The default task has two strokes: in the first half of a clip a red square moves left or right,
in the second a blue square moves up or down; the class is the pair of directions (4 classes).
Reversing either stroke maps one class onto another with the same set of frames, so an
order-blind model is at chance (0.25) by construction and only a head that uses frame order can
solve it. ``SyntheticSpec.task`` picks another task of the same construction
(``temporal_tasks.py``).

Files are written with PyAV, deterministically for a seed, in the layout of each supported
dataset (``layouts.py``), so the readers are tested on files that no reader wrote. Why this
task, and the layouts: ``docs/design/internals.md``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import av
import numpy as np

from videotrain.data.temporal_tasks import BLUE, RED, TASKS, texture
from videotrain.untrusted import shown
from videotrain.untrusted.files import atomic_writer

# each setting's range (what the synthetic tasks use is far inside), and the raw pixels of the
# whole set: the default is 0.08 GiB, the accuracy suite's 0.3 GiB
SYNTHETIC_LIMITS: dict[str, tuple[float, float]] = {
    "train_per_class": (1, 100_000), "val_per_class": (1, 100_000), "num_frames": (2, 1_000),
    "size": (8, 1_024), "object_size": (1, 1_024), "travel": (0.0, 1.0), "fps": (1, 1_000),
    "seed": (0, 2**63 - 1),
}
MAX_SYNTHETIC_BYTES = 16 << 30

CLASSES: tuple[str, ...] = ("right_then_down", "right_then_up", "left_then_down", "left_then_up")
TASK_NAMES: tuple[str, ...] = ("two_strokes", *TASKS)


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that determines the generated files; its hash names the cache folder."""

    train_per_class: int = 64
    val_per_class: int = 16
    num_frames: int = 20  # frames per video; the first half is the red stroke, the rest blue
    size: int = 64  # frame height and width in pixels
    object_size: int = 12
    travel: float = 0.45  # stroke length as a fraction of the frame size
    fps: int = 10
    seed: int = 0
    task: str = "two_strokes"  # or a task of the accuracy suite (``temporal_tasks.TASKS``)

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:
            raise ValueError(f"data.synthetic.task must be one of {', '.join(TASK_NAMES)}, got "
                             f"{shown(self.task)}")
        for key, (low, high) in SYNTHETIC_LIMITS.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"data.synthetic.{key} must be a number in [{low}, {high}], got "
                                 f"{shown(value)} (the generator's sizes are bounded: a config "
                                 "could otherwise render for hours and fill the disk)")
        frames = (self.train_per_class + self.val_per_class) * len(self.classes) * self.num_frames
        if frames * self.size * self.size * 3 > MAX_SYNTHETIC_BYTES:
            raise ValueError(
                f"data.synthetic: {frames} frames of {self.size}x{self.size} px are "
                f"{frames * self.size * self.size * 3 / 2**30:.1f} GiB of pixels to render, more "
                f"than the generator's bound of {MAX_SYNTHETIC_BYTES / 2**30:.0f} GiB; lower "
                "data.synthetic.train_per_class, val_per_class, num_frames or size")

    @property
    def classes(self) -> tuple[str, ...]:
        return CLASSES if self.task == "two_strokes" else TASKS[self.task].classes

    def digest(self) -> str:
        fields: dict = asdict(self)
        if fields["task"] == "two_strokes":  # the default task keeps the folder name it had
            del fields["task"]
        else:  # a task's drawing changes with its version, not with the spec's fields
            fields["task_version"] = TASKS[self.task].version
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:10]


def render_clip(spec: SyntheticSpec, label: int, rng: np.random.Generator) -> np.ndarray:
    """Render one clip of class ``label`` of ``spec.task``; returns uint8 frames (T, H, W, 3)."""
    if spec.task != "two_strokes":
        return TASKS[spec.task].render(spec, label, rng)
    horiz_sign = 1 if label in (0, 1) else -1  # red: right (+x) or left (-x)
    vert_sign = 1 if label in (0, 2) else -1  # blue: down (+y) or up (-y)
    size, obj = spec.size, spec.object_size
    travel = spec.travel * size
    half = spec.num_frames // 2
    background = texture(rng, size)
    frames = np.empty((spec.num_frames, size, size, 3), dtype=np.uint8)

    def track(sign: int) -> tuple[float, float]:
        lo = 0.0 if sign > 0 else travel
        hi = size - obj - (travel if sign > 0 else 0.0)
        return rng.uniform(lo, hi), rng.uniform(0, size - obj)  # (along, across)

    red_along, red_across = track(horiz_sign)
    blue_along, blue_across = track(vert_sign)
    for t in range(spec.num_frames):
        frame = background.copy()
        if t < half:
            x = red_along + horiz_sign * travel * t / max(half - 1, 1)
            y, colour = red_across, RED
        else:
            s = t - half
            y = blue_along + vert_sign * travel * s / max(spec.num_frames - half - 1, 1)
            x, colour = blue_across, BLUE
        x0, y0 = int(round(x)), int(round(y))
        frame[y0 : y0 + obj, x0 : x0 + obj] = colour
        frames[t] = frame.astype(np.uint8)
    return frames


# the container of each suffix: PyAV writes into a file object, which names no format itself
CONTAINERS = {".mp4": "mp4", ".avi": "avi", ".webm": "webm", ".mkv": "matroska", ".mov": "mov"}


def write_video(path: Path, frames: np.ndarray, fps: int, root: Path | None = None) -> None:
    """Encode uint8 (T, H, W, 3) frames to ``path`` with PyAV; the codec follows the suffix as in
    the real datasets: ``.mp4`` H.264 (MPEG-4 part 2 without libx264), ``.avi`` MPEG-4 part 2
    (UCF101 and HMDB51 are XviD AVIs), ``.webm`` VP8 (Something-Something v2). Written through
    the one writer (``root``: the folder being generated, below which no link is followed), so
    ``path`` is either the whole video or what stood there before."""
    suffix = path.suffix.lower()
    if suffix not in CONTAINERS:
        raise ValueError(f"a synthetic video is one of {', '.join(CONTAINERS)}, not "
                         f"{shown(suffix)}")
    if suffix == ".webm":
        codec = "libvpx"
    elif suffix == ".mp4" and "libx264" in av.codecs_available:
        codec = "libx264"
    else:
        codec = "mpeg4"
    with (atomic_writer(path, root) as f,
          av.open(f, mode="w", format=CONTAINERS[suffix]) as container):
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "12", "preset": "veryfast", "threads": "1"}
        elif codec == "libvpx":
            stream.bit_rate = 4_000_000
            stream.options = {"crf": "8", "threads": "1"}
        elif suffix == ".avi":
            stream.bit_rate = 4_000_000
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


class Clip(NamedTuple):
    split: str  # train | val
    i: int  # index within its class and split
    label: int
    frames: np.ndarray  # (T, H, W, 3) uint8


def render_all(spec: SyntheticSpec) -> Iterator[Clip]:
    """Every clip of the dataset, in the fixed order that makes the files a function of the
    spec (whatever the layout they are written in)."""
    rng = np.random.default_rng(spec.seed)
    for split, per_class in (("train", spec.train_per_class), ("val", spec.val_per_class)):
        for i in range(per_class):
            for label in range(len(spec.classes)):
                yield Clip(split, i, label, render_clip(spec, label, rng))
