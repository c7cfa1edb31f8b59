"""Clip decoding with PyAV: seek to each clip, decode only up to its end, convert only the
frames that are kept.

Why not ``pytorchvideo.data.EncodedVideo`` (which the clip *samplers* still come from): its
PyAV backend (a) reads the whole file into memory before opening it, (b) converts every frame
of a clip window to an RGB tensor although a clip keeps ``num_frames`` of them (8 of 64 for an
8x8 Kinetics clip at 30 fps), and (c) decodes and holds the *whole* video when the stream
header has no duration, which is the case for every WebM file (Something-Something v2). Here
the file is opened in place, the duration falls back to the container's, frames stay in YUV
until the kept ones are converted, and windows are visited in time order so that
overlapping evaluation clips (10 clips of a 10 s video) are decoded once.

``data.decoder=torchcodec`` swaps this class for ``decode_torchcodec.TorchCodecVideo``, which
has the same methods and returns the same frames; ``open_video`` picks one by name.

Every video is held to the media budgets (``videotrain.data.media_budget``): the header's frame
size and frame count when it is opened, each decoded frame's size before it is kept or
converted, and what one read decodes and holds; over one, a ``VideoTooLarge``.

Errors are not handled here: the dataset turns any exception into a skipped ``BadVideo``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import av
import numpy as np

from videotrain.data.clip_sampling import uniform_indices
from videotrain.data.media_budget import (
    ReadBudget,
    VideoTooLarge,
    check_frame_count,
    check_frame_size,
    limit_ffmpeg_allocations,
)
from videotrain.untrusted.bounds import MAX_VIDEO_FRAMES

# Seek forward (to the keyframe before a window) only when the window starts this much past
# the last decoded frame; closer windows are reached faster by decoding on.
SEEK_GAP_S = 1.0


DECODERS = ("pyav", "torchcodec")


def _rgb(frame: av.VideoFrame) -> np.ndarray:
    """One decoded frame as ``(H, W, 3)`` uint8 RGB. ``reformat`` then ``to_ndarray`` gives the
    same pixels as ``to_ndarray(format="rgb24")`` in about a third of the time (PyAV 18: 0.22
    against 0.71 ms for a 340x256 frame on this project's CPU; docs/data.md)."""
    return frame.reformat(format="rgb24").to_ndarray()


def _stacked(frames: Sequence[av.VideoFrame], budget: ReadBudget) -> np.ndarray:
    """``frames`` as one uint8 ``(T, H, W, 3)`` array, its bytes counted against ``budget``
    before it is made (each frame converted straight into it: no second copy)."""
    first = frames[0]
    budget.convert(len(frames), first.width, first.height)
    out = np.empty((len(frames), first.height, first.width, 3), dtype=np.uint8)
    for k, frame in enumerate(frames):
        out[k] = _rgb(frame)  # a frame of another size than the first is an error, as in np.stack
    return out


def _yuv_bytes(frame: av.VideoFrame) -> int:
    """What a decoded frame holds while it waits to be chosen."""
    return sum(plane.buffer_size for plane in frame.planes)


class ClipSource(Protocol):
    """What the dataset reads a video through (``VideoFile``, ``TorchCodecVideo``). Frames come
    back as uint8 ``(T, H, W, 3)`` arrays; times are seconds from the stream's start."""

    duration: float | None  # from the headers; None until ``measure_duration``

    def measure_duration(self) -> float: ...

    def clips(self, windows: Sequence[tuple[float, float]], num_frames: int) -> list[np.ndarray]: ...

    def frame_count(self) -> int: ...

    def frames_at(self, indices: Sequence[Sequence[int]]) -> list[np.ndarray]: ...

    def close(self) -> None: ...


def check_decoder(decoder: str) -> None:
    """A ``ValueError`` naming ``data.decoder`` for an unknown decoder; for ``torchcodec``, a
    ``DecoderUnavailable`` naming the extra to install when it cannot be imported."""
    if decoder not in DECODERS:
        raise ValueError(f"data.decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    if decoder == "torchcodec":
        from videotrain.data.decode_torchcodec import require_torchcodec

        require_torchcodec()


def open_video(path: str, decoder: str = "pyav") -> ClipSource:
    """``path`` opened with ``data.decoder``'s backend (raises whatever opening raises)."""
    if decoder == "torchcodec":
        from videotrain.data.decode_torchcodec import TorchCodecVideo

        return TorchCodecVideo(path)
    check_decoder(decoder)
    return VideoFile(path)


class VideoFile:
    """An open video file: its duration and the frames of time windows.

    Use as a context manager; times are seconds from the first frame of the video stream.
    Files without timestamps or that cannot seek (raw elementary streams) are decoded from
    the start instead, with times counted from the frame rate.
    """

    def __init__(self, path: str, threads: int = 1) -> None:
        self.path, self.threads = path, threads
        self._count: int | None = None  # frames, once counted
        self._budget = ReadBudget()  # the current read's; each read starts a new one
        limit_ffmpeg_allocations("pyav")  # before the first av.open builds anything
        self._open()
        try:
            self.time_base = self.stream.time_base
            self.start = float(self.stream.start_time * self.time_base) if (
                self.stream.start_time is not None and self.time_base) else 0.0
            rate = self.stream.average_rate or self.stream.guessed_rate
            self.rate = float(rate) if rate else None
            self.duration = self._header_duration()
            self._check_header()
        except BaseException:
            self.container.close()
            raise

    def _check_header(self) -> None:
        """The media budgets against what the headers declare, before any frame is decoded:
        the frame size (0 where the header has none: each frame is checked when decoded) and
        the frame count, stated or implied by the duration and the rate."""
        context = self.stream.codec_context
        self.width, self.height = int(context.width or 0), int(context.height or 0)
        check_frame_size(self.width, self.height, "the header declares frames of")
        check_frame_count(self.stream.frames or 0, "the header declares")
        if self.duration is not None and self.rate:
            check_frame_count(self.duration * self.rate, "its duration and frame rate make")

    def _open(self) -> None:
        self.container = av.open(self.path, metadata_errors="ignore")
        if not self.container.streams.video:
            self.container.close()
            raise ValueError("no video stream")
        self.stream = self.container.streams.video[0]
        # frame threading trades latency for throughput; loader workers already run in
        # parallel, so one decoding thread each is the default
        self.stream.thread_type = "AUTO" if self.threads != 1 else "SLICE"
        self.stream.thread_count = self.threads
        self._at_start = True  # nothing decoded since opening
        self._untimed = False  # a frame without a timestamp was seen

    def _header_duration(self) -> float | None:
        """From the stream header, else the container's (WebM streams carry none)."""
        if self.stream.duration is not None and self.time_base:
            return float(self.stream.duration * self.time_base)
        if self.container.duration is not None:
            return max(self.container.duration / av.time_base - self.start, 0.0)
        return None  # only known after decoding: see ``measure_duration``

    def _decode_from(self, seconds: float):
        """Frames with their times, from the keyframe at or before ``seconds``, or from the
        start of the file when that is near, the file has no timestamps, or seeking fails."""
        if seconds > SEEK_GAP_S and not self._untimed and self.time_base:
            target = int(math.floor((seconds + self.start) / self.time_base))
            try:
                self.container.seek(max(target, 0), stream=self.stream, backward=True,
                                    any_frame=False)
                self._at_start = False
                return self._timed(self.container.decode(self.stream), from_start=False)
            except av.error.FFmpegError:
                pass  # not seekable: decode from the start
        if not self._at_start:  # reopening is the one rewind every input supports
            self.container.close()
            self._open()
        self._at_start = False
        return self._timed(self.container.decode(self.stream), from_start=True)

    def _timed(self, frames, from_start: bool):
        for ordinal, frame in enumerate(frames):
            if ordinal >= MAX_VIDEO_FRAMES:  # one pass sees each frame once: the video is longer
                raise VideoTooLarge(f"more than {MAX_VIDEO_FRAMES:,} frames decoded in one pass, "
                                    f"over the budget of {MAX_VIDEO_FRAMES:,} frames per video")
            self._budget.decoded(frame.width, frame.height)  # before it is kept or converted
            if frame.pts is not None and self.time_base:
                yield float(frame.pts * self.time_base) - self.start, frame
            elif from_start:  # no timestamps: count frames
                self._untimed = True
                yield ordinal / (self.rate or 1.0), frame
            else:  # after a seek, a frame count says nothing: start over
                self._untimed = True
                yield from self._decode_from(0.0)
                return

    def measure_duration(self) -> float:
        """Decode the whole stream once (files without any duration in their headers)."""
        self._budget = ReadBudget()
        last = 0.0
        for t, _ in self._decode_from(0.0):
            last = t + (1.0 / self.rate if self.rate else 0.0)
        self.duration = last
        return last

    def clips(self, windows: Sequence[tuple[float, float]], num_frames: int) -> list[np.ndarray]:
        """``num_frames`` frames evenly spaced over the frames in each ``[start, end)`` window,
        as uint8 ``(T, H, W, 3)`` arrays in the order of ``windows``.

        A window with no frame in it (past the real end of a stream whose header overstates
        its length) falls back to the last frames decoded before it, or to the whole video.
        The RGB frames asked for are refused before decoding when they exceed the budget;
        the decoded frames waiting in a window are counted as they arrive.
        """
        budget = self._budget = ReadBudget()
        budget.expect(len(windows) * num_frames, self.width, self.height,
                      f"{len(windows)} clip(s) of {num_frames} frames")
        out: list[np.ndarray | None] = [None] * len(windows)
        buffer: list[tuple[float, av.VideoFrame]] = []  # decoded, at or after the last window
        before: deque[av.VideoFrame] = deque(maxlen=num_frames)  # the last ones before it
        frames = None  # (time, frame) iterator since the last seek
        last_t, exhausted = -math.inf, False
        held = 0  # bytes of the frames in buffer and before
        for i in sorted(range(len(windows)), key=lambda j: windows[j][0]):
            start, end = windows[i]
            if frames is None or (start > last_t + SEEK_GAP_S and not exhausted):
                frames, last_t, exhausted = self._decode_from(start), -math.inf, False
                buffer, before, held = [], deque(maxlen=num_frames), 0
            while last_t < end and not exhausted:
                item = next(frames, None)
                if item is None:
                    exhausted = True
                    break
                last_t = item[0]
                held += _yuv_bytes(item[1])
                if last_t >= start:
                    buffer.append(item)
                else:
                    if len(before) == before.maxlen:  # the oldest one drops out
                        held -= _yuv_bytes(before[0])
                    before.append(item[1])
                budget.hold(held)
            inside = [f for t, f in buffer if start <= t < end]
            if not inside:  # e.g. the header overstates the duration
                inside = [*before, *(f for t, f in buffer if t < end)][-num_frames:]
                inside = inside or [f for _, f in buffer]
            if not inside:
                raise ValueError(f"no frames decoded in [{start:.3f}, {end:.3f}) s")
            keep = uniform_indices(len(inside), num_frames).tolist()
            out[i] = _stacked([inside[k] for k in keep], budget)
            # the next window starts at or after this one: frames before it are not needed
            buffer = [(t, f) for t, f in buffer if t >= start]
            held = sum(_yuv_bytes(f) for _, f in buffer) + sum(_yuv_bytes(f) for f in before)
        return out  # type: ignore[return-value]

    def frame_count(self) -> int:
        """The number of frames, counted from the packets (demuxed, not decoded): the header's
        count is missing from WebM and overstated by a truncated AVI. Counts what
        torchcodec's exact scan counts, so both decoders index the same frames."""
        if self._count is None:
            if not self._at_start:  # rewind: reopening is the one rewind every input supports
                self.container.close()
                self._open()
            count = 0
            for packet in self.container.demux(self.stream):
                count += 1 if packet.size and not packet.is_discard else 0
                if count > MAX_VIDEO_FRAMES:  # stop reading: the budget is spent
                    check_frame_count(count, "its packets hold more than")
            self._count = count
            self._at_start = False  # the demuxer is at the end: the next decode reopens
        return self._count

    def frames_at(self, indices: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """The frames at each list of (presentation-order) ``indices``, as uint8 ``(T, H, W, 3)``
        arrays: one pass from the start that stops after the last index and converts only the
        chosen frames. An index past the real end (a miscounted stream) gets the last frame."""
        wanted = {int(i) for clip in indices for i in clip}
        last_needed = max(wanted)
        total = sum(len(clip) for clip in indices)
        budget = self._budget = ReadBudget()  # the distinct frames kept, then the clips made
        budget.expect(len(wanted) + total, self.width, self.height,
                      f"{len(indices)} clip(s) of {total // max(len(indices), 1)} frames")
        kept: dict[int, np.ndarray] = {}
        last: tuple[int, av.VideoFrame] | None = None
        for ordinal, (_, frame) in enumerate(self._decode_from(0.0)):
            if ordinal in wanted:
                budget.convert(1, frame.width, frame.height)
                kept[ordinal] = _rgb(frame)  # (H, W, 3)
            last = ordinal, frame
            if ordinal >= last_needed:
                break
        if last is None:
            raise ValueError("no frames decoded")
        if last[0] < last_needed and last[0] not in kept:  # the stream ended early
            budget.convert(1, last[1].width, last[1].height)
            kept[last[0]] = _rgb(last[1])
        h, w = next(iter(kept.values())).shape[:2]
        budget.convert(total, w, h)
        return [np.stack([kept[min(int(i), last[0])] for i in clip]) for clip in indices]

    def close(self) -> None:
        self.container.close()

    def __enter__(self) -> VideoFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
