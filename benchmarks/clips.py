"""Clip sets shaped like the real datasets, for the data suite (``benchmarks/data.py``).

The synthetic training set (``data/synthetic.py``) is tiny and costs next to nothing to decode,
so it cannot tell how fast a loader feeds a model on Kinetics. These sets copy what makes real
files expensive to read: ``kinetics`` (10 s, 340x256, H.264 with one keyframe per clip, .mp4)
and ``ssv2`` (4 s, 427x240, VP9, .webm without a stream duration), their content textured and
moving so that the bit rate and the decoding cost are those of real footage.

Sets are written once, in parallel, into ``$VIDEOTRAIN_CACHE/bench-<name>-<hash>/`` in the
Kinetics layout, which both this project's reader and ``pytorchvideo.data.Kinetics`` read;
``val.csv`` lists the same videos. The encoders' settings: ``docs/design/internals.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

from videotrain.data.layouts import default_cache_root
from videotrain.data.synthetic import CONTAINERS
from videotrain.untrusted.files import atomic_writer, make_dirs, rename, write_text

NUM_CLASSES = 4


@dataclass(frozen=True)
class ClipSetSpec:
    """Everything that determines a clip set; its hash names the cache folder."""

    name: str  # kinetics | ssv2: which dataset the set imitates
    count: int  # videos
    seconds: float
    width: int
    height: int
    fps: int
    codec: str  # PyAV encoder name
    suffix: str  # container, by file extension
    gop: int  # keyframe interval cap, in frames
    crf: int
    preset: str | None = None  # libx264 preset; libvpx-vp9 uses cpu-used 4 ("good" deadline)
    seed: int = 0

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:10]

    @property
    def num_frames(self) -> int:
        return round(self.seconds * self.fps)


KINETICS_LIKE = ClipSetSpec("kinetics", 200, 10.0, 340, 256, 25, "libx264", ".mp4", gop=250,
                            crf=23, preset="medium")
SSV2_LIKE = ClipSetSpec("ssv2", 200, 4.0, 427, 240, 12, "libvpx-vp9", ".webm", gop=128, crf=32)
CLIP_SETS: dict[str, ClipSetSpec] = {"kinetics": KINETICS_LIKE, "ssv2": SSV2_LIKE}


def clip_set(name: str, count: int | None = None, **changes: Any) -> ClipSetSpec:
    """The named set's spec, with ``count`` videos and any other field changed (tests make
    tiny ones: ``clip_set("kinetics", 2, seconds=1.0)``)."""
    if name not in CLIP_SETS:
        raise ValueError(f"clip set must be one of {', '.join(CLIP_SETS)}, got {name!r}")
    spec = CLIP_SETS[name]
    return replace(spec, **({"count": count} if count else {}), **changes)


# ---------------------------------------------------------------------- content
def _value_noise(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A colour texture with detail at 64, 16, 4 and 1 px scales, (h, w, 3) float32."""
    out = np.full((h, w, 3), 128.0, dtype=np.float32)
    for cell, amp in ((64, 60.0), (16, 35.0), (4, 22.0), (1, 10.0)):
        coarse = rng.uniform(-1, 1, size=(h // cell + 2, w // cell + 2, 3)).astype(np.float32)
        out += amp * np.repeat(np.repeat(coarse, cell, 0), cell, 1)[:h, :w]
    return out


def render_frames(spec: ClipSetSpec, index: int):
    """The frames of video ``index``: uint8 ``(H, W, 3)`` arrays, one at a time.

    A texture twice the frame size is panned along a smooth random path (camera motion), two
    textured patches cross it at their own speeds, brightness drifts, and one of 8 grain
    frames is added to each frame."""
    rng = np.random.default_rng([spec.seed, index])
    h, w = spec.height, spec.width
    pad_y, pad_x = h // 2, w // 2
    scene = np.clip(_value_noise(rng, h + 2 * pad_y, w + 2 * pad_x), 0, 255)
    patches = [np.clip(_value_noise(rng, h // 4, w // 5), 0, 255).astype(np.uint8)
               for _ in range(2)]
    grain = rng.integers(0, 12, size=(8, h, w, 3), dtype=np.uint8)
    pan = rng.uniform(0.04, 0.12, size=2)  # camera path: cycles per second in x and y
    speed = rng.uniform(0.1, 0.3, size=4)  # patch paths
    phase = rng.uniform(0, 2 * np.pi, size=7)
    for t in range(spec.num_frames):
        s = t / spec.fps
        x = int(pad_x * (1 + np.sin(2 * np.pi * pan[0] * s + phase[0])))
        y = int(pad_y * (1 + np.sin(2 * np.pi * pan[1] * s + phase[1])))
        gain = 0.85 + 0.15 * np.sin(2 * np.pi * s / 7 + phase[2])
        frame = (scene[y : y + h, x : x + w] * gain).astype(np.uint8)
        for k, patch in enumerate(patches):
            ph, pw = patch.shape[:2]
            u = 0.5 + 0.5 * np.sin(2 * np.pi * speed[2 * k] * s + phase[3 + 2 * k])
            v = 0.5 + 0.5 * np.cos(2 * np.pi * speed[2 * k + 1] * s + phase[4 + 2 * k])
            px, py = int((w - pw) * u), int((h - ph) * v)
            frame[py : py + ph, px : px + pw] = patch
        frame += grain[t % len(grain)]  # wraps at 255 only where the texture is brightest
        yield frame


def encoder_options(spec: ClipSetSpec) -> dict[str, str]:
    """Encoder settings: the codec's defaults except one thread (the writer runs a process per
    core) and, for VP9, constant quality (``b=0`` + ``crf``)."""
    if spec.codec == "libx264":
        return {"preset": spec.preset or "medium", "crf": str(spec.crf), "threads": "1"}
    if spec.codec == "libvpx-vp9":
        return {"crf": str(spec.crf), "b": "0", "deadline": "good", "cpu-used": "4",
                "threads": "1", "row-mt": "0"}
    raise ValueError(f"no settings for encoder {spec.codec!r}")


def write_clip(path: Path, spec: ClipSetSpec, index: int, root: Path | None = None) -> int:
    """Encode video ``index`` to ``path`` (no audio); returns its size in bytes. Written by the
    one writer (a new file renamed over the name; ``root``: the set being generated, below which
    no link is followed), so ``path`` is either complete or absent."""
    with (atomic_writer(path, root) as f,  # the container from the suffix
          av.open(f, mode="w", format=CONTAINERS[path.suffix.lower()]) as container):
        stream = container.add_stream(spec.codec, rate=Fraction(spec.fps))
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        stream.codec_context.gop_size = spec.gop
        stream.options = encoder_options(spec)
        for frame in render_frames(spec, index):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return os.lstat(path).st_size


def _write_job(job: tuple[str, ClipSetSpec, int, Path | None]) -> int:
    path, spec, index, root = job
    return write_clip(Path(path), spec, index, root)


# ---------------------------------------------------------------------- the set on disk
def set_root(spec: ClipSetSpec, cache_dir: str | Path | None = None) -> Path:
    base = Path(cache_dir) if cache_dir else default_cache_root()
    return base / f"bench-{spec.name}-{spec.digest()}"


def relative_path(spec: ClipSetSpec, index: int) -> str:
    label = index % NUM_CLASSES
    return f"videos/class_{label}/{spec.name}_{index:05d}{spec.suffix}"


def ensure_clip_set(spec: ClipSetSpec, cache_dir: str | Path | None = None,
                    workers: int | None = None, log=None) -> Path:
    """Generate (once) and return the set's root. A finished set has ``spec.json`` (the spec,
    the generation time and the mean bit rate); an unfinished one is rebuilt in a temporary
    folder and renamed, so a killed generation never leaves a set that looks complete."""
    root = set_root(spec, cache_dir)
    if (root / "spec.json").exists():
        return root
    # the cache folder is the user's own (followed as given); the set's folder and all below it
    # are the project's: written by the one writer rooted there, no link followed
    parent = root.parent.resolve()
    tmp = parent / f"{root.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftovers (a link is not followed)
    rels = [relative_path(spec, i) for i in range(spec.count)]
    for folder in dict.fromkeys((tmp / rel).parent for rel in rels):
        make_dirs(folder, tmp)
    workers = workers or os.cpu_count() or 1
    if log:
        log(f"generating {spec.count} {spec.name}-like videos ({spec.seconds:g} s, "
            f"{spec.width}x{spec.height}, {spec.fps} fps, {spec.codec}) into {root} with "
            f"{workers} processes ...")
    t0 = time.perf_counter()
    jobs = [(str(tmp / rel), spec, i, tmp) for i, rel in enumerate(rels)]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
            sizes = list(pool.map(_write_job, jobs, chunksize=4))
    else:
        sizes = [_write_job(j) for j in jobs]
    elapsed = time.perf_counter() - t0
    lines = "".join(f"{rel} {i % NUM_CLASSES}\n" for i, rel in enumerate(rels))
    write_text(tmp / "train.csv", lines, tmp)
    write_text(tmp / "val.csv", lines, tmp)
    write_text(tmp / "classes.txt", "".join(f"class_{k}\n" for k in range(NUM_CLASSES)), tmp)
    kbps = sum(sizes) * 8 / (spec.count * spec.seconds) / 1000
    write_text(tmp / "spec.json", json.dumps(
        {**asdict(spec), "generation_s": elapsed, "workers": workers, "mean_kbps": kbps,
         "bytes": sum(sizes)}, indent=2) + "\n", tmp)
    if log:
        log(f"  {elapsed:.0f} s, mean bit rate {kbps:.0f} kb/s")
    try:
        rename(tmp, parent / root.name, root=parent)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


# Core-seconds to render and encode one frame at the full sets' sizes, measured on the 2-core
# CPU of docs/benchmarks.md (a Kinetics-like video: 1.2 s, an SSv2-like one: 0.6 s).
GENERATION_CORE_S = {"libx264": 1.2 / 250, "libvpx-vp9": 0.6 / 48}


def generation_estimate(spec: ClipSetSpec, workers: int | None = None) -> float:
    """Seconds ``ensure_clip_set`` is expected to take for ``spec`` with ``workers`` processes."""
    per_frame = GENERATION_CORE_S.get(spec.codec, 0.01)
    workers = workers or os.cpu_count() or 1
    return spec.count * spec.num_frames * per_frame / min(workers, max(spec.count, 1))


def set_info(root: Path) -> dict[str, Any]:
    """What ``ensure_clip_set`` recorded about a set (spec, generation time, bit rate)."""
    return json.loads((root / "spec.json").read_text())


def probe(path: str | Path) -> dict[str, Any]:
    """Codec, size, frame rate, frame count and keyframe positions of a video file (decodes
    it all; for tests and checks)."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        keyframes, frames = [], 0
        for frame in container.decode(stream):
            if frame.key_frame:
                keyframes.append(frames)
            frames += 1
        return {"codec": stream.codec_context.name, "width": stream.width,
                "height": stream.height, "fps": float(stream.average_rate or 0),
                "pix_fmt": stream.codec_context.pix_fmt, "frames": frames,
                "keyframes": keyframes, "format": container.format.name,
                "audio_streams": len(container.streams.audio)}
