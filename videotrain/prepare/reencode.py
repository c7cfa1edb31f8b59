"""Re-encode videos to a short side and a keyframe interval fit for random access (PyAV only:
no ffmpeg binary needed, the ``av`` wheel bundles FFmpeg).

Why: Kinetics clips as downloaded are mostly cut with ffmpeg's libx264 defaults, whose
keyframe interval (250 frames) exceeds a 10 s clip, so the decoder can only seek to the first
frame and a random 2.56 s training window costs decoding 6.3 s of video on average. With a
keyframe every second (``-g`` = the frame rate) decoding starts at most 1 s (on average 0.5 s)
before the window: 3.1 s, half the frames, for more bits (+48% on the bench's Kinetics-like
clips at 256 px, +21% with a keyframe every 2 s; docs/data.md#preparing-kinetics). A video is
decoded hundreds of times in training and stored once, so the default is 1 s
(``keyframe_s``). Resizing to the training resolution's neighbourhood (256 or 320 px short
side) once also saves decoding and resizing large frames every epoch.

Each output is written through the one writer (``videotrain.untrusted.files``): to a new file
under a temporary name in its folder, renamed when complete, so a killed or failed encode never
leaves a file at the final name (an existing output is complete, which is what makes a run
resumable: ``encode_all`` skips them), and a link at the name or below ``root`` (the output
folder) is never written through. Audio is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
from av.video.reformatter import Interpolation, VideoReformatter

from videotrain.untrusted.files import atomic_writer, is_regular, remove

KEYFRAME_SECONDS = 1.0  # keyframe interval: one per second of video


@dataclass(frozen=True)
class EncodeSettings:
    """What every output gets: ``short_side`` px (never upscaled), H.264 ``crf`` / ``preset``,
    a keyframe every ``keyframe_s`` seconds (``-g`` = that many frames)."""

    short_side: int = 320
    crf: int = 23
    preset: str = "veryfast"
    keyframe_s: float = KEYFRAME_SECONDS


@dataclass
class EncodeResult:
    src: str
    dst: str
    status: str  # encoded | skipped (already complete) | failed
    error: str | None = None
    seconds: float = 0.0


def output_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """``(width, height)`` with the short side at ``short_side`` (aspect kept, even numbers as
    yuv420p needs); a video already that small keeps its size (rounded down to even)."""
    scale = min(short_side / min(width, height), 1.0)
    even = lambda v: max(2, int(round(v * scale / 2)) * 2)  # noqa: E731
    return even(width), even(height)


def leftovers(dst: Path) -> list[Path]:
    """Partial files of ``dst`` that a killed run left behind: the one writer's temporary names
    (``.NAME.<random>.tmp``) and those of the versions before it (``.STEM.part-PID.SUFFIX``)."""
    return [*dst.parent.glob(f".{dst.name}.*.tmp"),
            *dst.parent.glob(f".{dst.stem}.part-*{dst.suffix}")]


def reencode(src: str | Path, dst: str | Path, settings: EncodeSettings,
             root: Path | None = None) -> None:
    """Decode ``src``'s first video stream and write it to ``dst`` (.mp4, H.264, yuv420p) at
    ``settings``; timestamps are kept (variable frame rates survive), audio is dropped.
    Raises on any decoding or encoding error, leaving nothing at ``dst``. ``root``: the output
    folder ``dst`` is in, below which no link is followed (the one writer)."""
    dst = Path(dst)
    for stale in leftovers(dst):
        remove(stale, root)
    with (atomic_writer(dst, root) as f,  # renamed to dst only when the block ends without error
          av.open(str(src), metadata_errors="ignore") as inp):
        if not inp.streams.video:
            raise ValueError("no video stream")
        ist = inp.streams.video[0]
        ist.thread_type = "AUTO"
        rate = ist.average_rate or ist.guessed_rate or Fraction(25)
        width, height = output_size(ist.codec_context.width, ist.codec_context.height,
                                    settings.short_side)
        frames = 0
        with av.open(f, mode="w", format="mp4") as out:
            ost = out.add_stream("libx264", rate=rate)
            ost.width, ost.height, ost.pix_fmt = width, height, "yuv420p"
            gop = max(1, round(float(rate) * settings.keyframe_s))
            ost.codec_context.gop_size = gop
            ost.options = {"crf": str(settings.crf), "preset": settings.preset,
                           "threads": "1", "keyint_min": str(gop)}
            tb = ist.time_base or Fraction(1, 90000)
            ost.codec_context.time_base = tb  # the input's clock: no timestamp is rounded
            scaler = VideoReformatter()  # one scaler for all frames (a new one costs more)
            last = None
            for frame in inp.decode(ist):
                pts = frame.pts if frame.pts is not None else (
                    0 if last is None else last + max(1, round(1 / (float(rate) * tb))))
                if last is not None and pts <= last:  # out of order or repeated
                    pts = last + 1
                last = pts
                image = scaler.reformat(frame, width=width, height=height, format="yuv420p",
                                        interpolation=Interpolation.AREA)
                image.pts, image.time_base = pts, tb
                for packet in ost.encode(image):
                    out.mux(packet)
                frames += 1
            for packet in ost.encode():
                out.mux(packet)
        if not frames:
            raise ValueError("no frames decoded")


def _job(args: tuple[str, str, EncodeSettings, Path | None]) -> EncodeResult:
    src, dst, settings, root = args
    t0 = time.perf_counter()
    try:
        reencode(src, dst, settings, root)
        return EncodeResult(src, dst, "encoded", seconds=time.perf_counter() - t0)
    except Exception as err:  # noqa: BLE001 - reported per file, the others go on
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return EncodeResult(src, dst, "failed", f"{type(err).__name__}: {message}",
                            time.perf_counter() - t0)


def encode_all(pairs: Iterable[tuple[str, str]], settings: EncodeSettings, workers: int = 1,
               progress: Callable[[EncodeResult, int, int], None] | None = None,
               root: Path | None = None) -> list[EncodeResult]:
    """Re-encode each ``(src, dst)`` pair that has no output yet, ``workers`` at a time
    (processes; each encoder runs one thread). Returns one result per pair, in order.
    ``root``: the output folder every ``dst`` is in (see ``reencode``)."""
    pairs = list(pairs)
    results: list[EncodeResult | None] = [None] * len(pairs)
    todo = []
    for i, (src, dst) in enumerate(pairs):
        # outputs appear only complete (renamed into place); a link there is no output of ours
        if is_regular(dst):
            results[i] = EncodeResult(src, dst, "skipped")
        else:
            todo.append(i)
    done = len(pairs) - len(todo)
    jobs = [(pairs[i][0], pairs[i][1], settings, root) for i in todo]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
            for i, res in zip(todo, pool.map(_job, jobs, chunksize=1), strict=True):
                results[i] = res
                done += 1
                if progress:
                    progress(res, done, len(pairs))
    else:
        for i, job in zip(todo, jobs, strict=True):
            results[i] = res = _job(job)
            done += 1
            if progress:
                progress(res, done, len(pairs))
    return results  # type: ignore[return-value]
