"""Clip decoding with PyAV: seek to each clip, decode only up to its end, convert only the
frames that are kept.

Not ``pytorchvideo.data.EncodedVideo``: it reads the whole file first, converts every frame of
a window to RGB, and decodes the whole video when the header has no duration (every WebM).
Here the file is opened in place, frames stay YUV until the kept ones are converted, and
windows are visited in time order so overlapping evaluation clips decode once. Every video is
held to the media budgets (``media_budget``; over one, ``VideoTooLarge``), and each kept frame
is scaled to the transform's short side as it becomes RGB. ``data.decoder=torchcodec`` swaps in
``decode_torchcodec.TorchCodecVideo`` (same methods, same frames). Errors are the dataset's to
handle (a skipped ``BadVideo``). Why: docs/design/internals.md#pyav-decoding."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import av
import numpy as np
import torch

from videotrain.data.clip_sampling import uniform_indices
from videotrain.data.media_budget import (
    ReadBudget,
    VideoTooLarge,
    check_frame_count,
    check_frame_size,
    limit_ffmpeg_allocations,
    out_size,
    scratch_bytes,
)
from videotrain.data.transforms import resize_frames
from videotrain.untrusted.bounds import MAX_DECODED_BYTES, MAX_VIDEO_FRAMES

# Seek forward (to the keyframe before a window) only when the window starts this much past
# the last decoded frame; closer windows are reached faster by decoding on.
SEEK_GAP_S = 1.0
# A read whose decoded frames would take more than this share of MAX_DECODED_BYTES waiting in
# one clip window, as the headers tell (4K at 30 fps: 72 frames of 12 MiB for a 2.1 s window),
# chooses its kept frames as they arrive (``VideoFile._clips_as_they_come``); smaller ones keep
# the path that needs no prediction (and decodes each window once, whatever its timestamps).
WAITING_SHARE = 0.5
EPS = 1e-6  # in frames: a window's end this close to a predicted frame time counts as on it


DECODERS = ("pyav", "torchcodec")


def _rgb(frame: av.VideoFrame, short_side: int | None = None) -> np.ndarray:
    """One decoded frame as ``(H, W, 3)`` uint8 RGB, its short side scaled to ``short_side``
    (None: as decoded). ``reformat`` then ``to_ndarray`` gives the same pixels as
    ``to_ndarray(format="rgb24")`` in about a third of the time (PyAV 18: 0.22 against 0.71 ms
    for a 340x256 frame on this project's CPU; docs/data.md)."""
    rgb = frame.reformat(format="rgb24").to_ndarray()
    if short_side is None:
        return rgb
    # (1, 3, H, W) laid out as the dataset lays out a clip's frames (channels last), so the
    # kernel and its result are those of the transform's resize of the clip
    small = resize_frames(torch.from_numpy(rgb[None]).permute(0, 3, 1, 2), short_side)
    return small[0].permute(1, 2, 0).numpy()


def _stacked(frames: Sequence[av.VideoFrame], budget: ReadBudget,
             short_side: int | None = None) -> np.ndarray:
    """``frames`` as one uint8 ``(T, H, W, 3)`` array (resized to ``short_side``), its bytes
    counted against ``budget`` before it is made (each frame converted straight into it)."""
    first = frames[0]
    width, height = out_size(first.width, first.height, short_side)
    budget.convert(len(frames), width, height, scratch_bytes(first.width, first.height, short_side))
    out = np.empty((len(frames), height, width, 3), dtype=np.uint8)
    for k, frame in enumerate(frames):
        out[k] = _rgb(frame, short_side)  # another size than the first's is an error, as in np.stack
    return out


def _yuv_bytes(frame: av.VideoFrame) -> int:
    """What a decoded frame holds while it waits to be chosen."""
    return sum(plane.buffer_size for plane in frame.planes)


class ClipSource(Protocol):
    """What the dataset reads a video through (``VideoFile``, ``TorchCodecVideo``). Frames come
    back as uint8 ``(T, H, W, 3)`` arrays, their short side scaled to ``short_side`` where one
    is given (the transform's: ``transforms.frame_short_side``); times are seconds from the
    stream's start."""

    duration: float | None  # from the headers; None until ``measure_duration``

    def measure_duration(self) -> float: ...

    def clips(self, windows: Sequence[tuple[float, float]], num_frames: int,
              short_side: int | None = None) -> list[np.ndarray]: ...

    def frame_count(self) -> int: ...

    def frames_at(self, indices: Sequence[Sequence[int]],
                  short_side: int | None = None) -> list[np.ndarray]: ...

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


class _Window:
    """A clip window read as its frames arrive (``VideoFile._clips_as_they_come``): ``count``,
    the frames the rate predicts in it; ``picks``, which of them are kept (ordinal in the
    window -> places in the clip); ``seen``, the frames in it so far."""

    def __init__(self, i: int, end: float, count: int, num_frames: int) -> None:
        self.i, self.end, self.count, self.seen = i, end, count, 0
        self.picks: dict[int, list[int]] = {}
        for j, k in enumerate(uniform_indices(count, num_frames).tolist() if count else []):
            self.picks.setdefault(k, []).append(j)
        self.num_frames = num_frames
        self.out: np.ndarray | None = None

    def put(self, j: int, rgb: np.ndarray, size: tuple[int, int], budget: ReadBudget) -> None:
        if self.out is None:  # its clip, counted before it is made
            budget.convert(self.num_frames, *size, budget.scratch)
            self.out = np.empty((self.num_frames, *rgb.shape), dtype=np.uint8)
        self.out[j] = rgb  # another size than the first's is an error, as in np.stack

    def complete(self) -> bool:
        """Ended with the frames predicted (and so every kept one in its place)."""
        return self.count > 0 and self.seen == self.count and self.out is not None

    def drop(self, budget: ReadBudget) -> None:
        if self.out is not None:
            budget.release(self.num_frames, self.out.shape[2], self.out.shape[1])
            self.out = None


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

    def clips(self, windows: Sequence[tuple[float, float]], num_frames: int,
              short_side: int | None = None) -> list[np.ndarray]:
        """``num_frames`` frames evenly spaced over the frames in each ``[start, end)`` window,
        as uint8 ``(T, H, W, 3)`` arrays in the order of ``windows``, each frame's short side
        scaled to ``short_side`` as it becomes RGB (None: as decoded).

        A window with no frame in it (past the real end of a stream whose header overstates
        its length) falls back to the last frames decoded before it, or to the whole video.
        The RGB frames asked for are refused before decoding when they exceed the budget.
        Where the decoded frames of a window would not fit waiting to be chosen
        (``WAITING_SHARE``: 4K), the kept ones are chosen as they arrive. The windows that
        cannot settle that way (a stream that ends inside one, timestamps off the rate), and
        every window of a smaller video, are read holding their decoded frames until they
        end, counted as they arrive. Both ways keep the same frames.
        """
        budget = self._budget = ReadBudget()
        width, height = out_size(self.width, self.height, short_side)
        budget.expect(len(windows) * num_frames, width, height,
                      f"{len(windows)} clip(s) of {num_frames} frames",
                      scratch_bytes(self.width, self.height, short_side))
        out: list[np.ndarray | None] = [None] * len(windows)
        order = sorted(range(len(windows)), key=lambda j: windows[j][0])
        if self._waiting_bytes(windows, num_frames) > WAITING_SHARE * MAX_DECODED_BYTES:
            order = self._clips_as_they_come(windows, order, num_frames, short_side, out)
        if order:
            self._clips_waiting(windows, order, num_frames, short_side, out)
        return out  # type: ignore[return-value]

    def _waiting_bytes(self, windows: Sequence[tuple[float, float]], num_frames: int) -> int:
        """What the decoded frames of the longest window (and the ``num_frames`` kept before
        it) would take waiting to be chosen, as the headers tell; 0 where they do not say."""
        if not (windows and self.rate and self.time_base and self.width and self.height):
            return 0
        longest = max(end - start for start, end in windows)
        frames = min(math.ceil(max(longest, 0.0) * self.rate), MAX_VIDEO_FRAMES) + num_frames
        fmt = self.stream.codec_context.format
        bits = (fmt.padded_bits_per_pixel if fmt is not None else 0) or 24
        return frames * self.width * self.height * bits // 8

    def _clips_waiting(self, windows: Sequence[tuple[float, float]], order: Sequence[int],
                       num_frames: int, short_side: int | None, out: list) -> None:
        """The windows ``order`` (by start) read by holding each window's decoded frames until
        it ends, then converting the kept ones (into ``out``)."""
        budget = self._budget
        buffer: list[tuple[float, av.VideoFrame]] = []  # decoded, at or after the last window
        before: deque[av.VideoFrame] = deque(maxlen=num_frames)  # the last ones before it
        frames = None  # (time, frame) iterator since the last seek
        last_t, exhausted = -math.inf, False
        held = 0  # bytes of the frames in buffer and before
        for i in order:
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
            out[i] = _stacked([inside[k] for k in keep], budget, short_side)
            # the next window starts at or after this one: frames before it are not needed
            buffer = [(t, f) for t, f in buffer if t >= start]
            held = sum(_yuv_bytes(f) for _, f in buffer) + sum(_yuv_bytes(f) for f in before)
        budget.hold(0)

    def _clips_as_they_come(self, windows: Sequence[tuple[float, float]], order: Sequence[int],
                            num_frames: int, short_side: int | None, out: list) -> list[int]:
        """Read the windows ``order`` (by start) holding no decoded frame: at a window's first
        frame, the frame rate predicts how many it holds, so which ones are kept; each kept
        one is converted as it arrives, every other dropped. A window settles (into ``out``)
        when it ends with as many frames as predicted: then its kept frames are exactly those
        ``_clips_waiting`` keeps. Returns those that did not settle (by start), for
        ``_clips_waiting``: a stream that ends inside a window or before it, timestamps off the
        rate or out of order. Seeks as ``_clips_waiting`` does."""
        budget, step = self._budget, 1.0 / self.rate
        pending, active, missed = deque(order), [], []
        frames, last_t, exhausted, decided = None, -math.inf, False, None
        while pending or active:
            if not active and pending[0] != decided:  # the next window: seek as _clips_waiting
                decided = pending[0]  # does, once for each window it reaches
                start = windows[decided][0]
                if frames is None or (start > last_t + SEEK_GAP_S and not exhausted):
                    frames, last_t, exhausted = self._decode_from(start), -math.inf, False
            item = None if exhausted else next(frames, None)
            if item is None or item[0] < last_t:  # the end, or timestamps out of order
                settled = [w for w in active if item is None and w.complete()]
                for w in settled:
                    out[w.i] = w.out
                for w in active:
                    if w not in settled:
                        missed.append(w.i)
                        w.drop(budget)
                missed += pending
                break
            t, frame = item
            last_t = t
            while pending and windows[pending[0]][0] <= t:  # windows this frame opens
                i = pending.popleft()
                count = max(math.ceil((windows[i][1] - t) / step - EPS), 0)  # grid times < end
                active.append(_Window(i, windows[i][1], min(count, MAX_VIDEO_FRAMES + 1), num_frames))
            rgb, still = None, []
            for w in active:
                if t >= w.end:  # it has ended
                    if w.complete():
                        out[w.i] = w.out
                    else:
                        missed.append(w.i)
                        w.drop(budget)
                    continue
                still.append(w)
                for j in w.picks.get(w.seen, ()):
                    if rgb is None:
                        size = out_size(frame.width, frame.height, short_side)
                        budget.convert(0, 0, 0, scratch_bytes(frame.width, frame.height, short_side))
                        rgb = _rgb(frame, short_side)
                    w.put(j, rgb, size, budget)
                w.seen += 1
            active = still
        budget.convert(0, 0, 0)  # no frame on its way any more
        return sorted(missed, key=lambda j: windows[j][0])

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

    def frames_at(self, indices: Sequence[Sequence[int]],
                  short_side: int | None = None) -> list[np.ndarray]:
        """The frames at each list of (presentation-order) ``indices``, as uint8 ``(T, H, W, 3)``
        arrays (short side scaled to ``short_side``): one pass from the start that stops after
        the last index and converts only the chosen frames. An index past the real end (a
        miscounted stream) gets the last frame."""
        wanted = {int(i) for clip in indices for i in clip}
        last_needed = max(wanted)
        total = sum(len(clip) for clip in indices)
        budget = self._budget = ReadBudget()  # the distinct frames kept, then the clips made
        budget.expect(len(wanted) + total, *out_size(self.width, self.height, short_side),
                      f"{len(indices)} clip(s) of {total // max(len(indices), 1)} frames",
                      scratch_bytes(self.width, self.height, short_side))

        def convert(frame: av.VideoFrame) -> np.ndarray:
            budget.convert(1, *out_size(frame.width, frame.height, short_side),
                           scratch_bytes(frame.width, frame.height, short_side))
            return _rgb(frame, short_side)  # (h, w, 3)

        kept: dict[int, np.ndarray] = {}
        last: tuple[int, av.VideoFrame] | None = None
        for ordinal, (_, frame) in enumerate(self._decode_from(0.0)):
            if ordinal in wanted:
                kept[ordinal] = convert(frame)
            last = ordinal, frame
            if ordinal >= last_needed:
                break
        if last is None:
            raise ValueError("no frames decoded")
        if last[0] < last_needed and last[0] not in kept:  # the stream ended early
            kept[last[0]] = convert(last[1])
        h, w = next(iter(kept.values())).shape[:2]
        budget.convert(total, w, h)
        return [np.stack([kept[min(int(i), last[0])] for i in clip]) for clip in indices]

    def close(self) -> None:
        self.container.close()

    def __enter__(self) -> VideoFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
