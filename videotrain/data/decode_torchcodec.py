"""Clip decoding with torchcodec (``data.decoder=torchcodec``): the same frames as PyAV's
``decode.VideoFile`` for the same windows and frame indices, through torchcodec's batch API.

Optional because it loads the system's FFmpeg libraries. Its exact-seek scan gives every
frame's index and timestamp at open, so a constant-frame-rate window's kept frames are known
by index and one ``get_frames_at`` call decodes them; a window the timestamps cannot settle,
and a variable-rate stream, take the exact path (``get_frames_played_in_range``). Media budgets
are checked as for PyAV: the frame count and size at open, each batch's RGB bytes before the
call that makes them, frames scaled to the transform's short side as they come. Details and
known differences: docs/design/internals.md#torchcodec-decoding."""

from __future__ import annotations

import errno
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from videotrain.data.clip_sampling import uniform_indices
from videotrain.data.media_budget import (
    ReadBudget,
    check_frame_count,
    check_frame_size,
    limit_ffmpeg_allocations,
    out_size,
    scratch_bytes,
)
from videotrain.data.transforms import resize_frames

INSTALL_HINT = (
    'data.decoder=torchcodec needs the optional torchcodec extra (pip install -e ".[torchcodec]") '
    "and the system FFmpeg shared libraries, major version 4 to 9 (apt-get install ffmpeg, or "
    "its libavcodec, libavformat, libavutil, libavfilter, libavdevice, libswscale and "
    "libswresample packages); or set data.decoder=pyav (the default), which needs neither"
)

EPS = 1e-6  # in frames: a window edge this close to a frame's predicted time counts as on it
TIME_EPS = 1e-9  # in seconds: the same, for timestamps compared directly
RATE_TOLERANCE = 0.01  # relative: the header's frame rate against the scanned average
# Where a constant-rate stream's timestamps lie, in seconds: exactly on the grid (0: MP4, AVI)
# or on it rounded to whole milliseconds (Matroska/WebM's default timestamp unit).
LATTICES = (0.0, 1e-3)
# Source-size RGB one get_frames_at call returns when its frames are resized after it (4K: two
# frames a call, 1080p: ten); without a short side the batch is what the read returns anyway.
BATCH_BYTES = 64 * 2**20

_CPP_PREFIX = re.compile(r"^[\w:]+, \S+\.(?:cpp|h):\d+, ")  # "Fn, /src/File.cpp:41, message"


class DecoderUnavailable(ValueError):
    """``data.decoder=torchcodec`` but torchcodec (or the FFmpeg it loads) cannot be imported: a
    config value this machine cannot run, so the apps report it as one ``error:`` line, rc 2."""


def require_torchcodec() -> Any:
    """torchcodec's ``VideoDecoder`` class, or a ``DecoderUnavailable`` saying what to install.

    Importing fails with an ``ImportError`` when the package is missing, and with a
    ``RuntimeError``/``OSError`` when the FFmpeg libraries it loads are missing or too new."""
    try:
        from torchcodec.decoders import VideoDecoder
    except Exception as err:  # any import failure means "not usable here"
        cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise DecoderUnavailable(f"{INSTALL_HINT} ({type(err).__name__}: {cause})") from err
    return VideoDecoder


class TorchCodecVideo:
    """An open video file read with torchcodec; the interface of ``decode.VideoFile``.

    Use as a context manager; times are seconds from the stream's start (its header's start
    time, as PyAV counts them).
    """

    def __init__(self, path: str, threads: int = 1) -> None:
        video_decoder = require_torchcodec()
        limit_ffmpeg_allocations("torchcodec")  # the FFmpeg it loaded; before its scan at open
        self.path = path
        if not os.path.exists(path):  # the same exception as PyAV's
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        try:
            self.decoder = video_decoder(path, seek_mode="exact", dimension_order="NHWC",
                                         num_ffmpeg_threads=threads)
        except RuntimeError as err:  # drop the C++ source location from FFmpeg's message
            raise RuntimeError(_CPP_PREFIX.sub("", str(err))) from err
        m = self.decoder.metadata
        self.num_frames = int(m.num_frames or 0)
        if self.num_frames < 1:
            raise ValueError("no video frames")
        check_frame_count(self.num_frames, "its scan counts")
        self.width, self.height = int(m.width or 0), int(m.height or 0)
        check_frame_size(self.width, self.height, "the header declares frames of")
        self.first = float(m.begin_stream_seconds)  # the first frame's timestamp (scanned)
        self.end = float(m.end_stream_seconds)  # the last frame's timestamp + its duration
        header_start = m.begin_stream_seconds_from_header
        self.start = float(header_start) if header_start is not None else 0.0
        # Seconds per frame: the header's rate, where the scan agrees with it (a variable-rate
        # stream's seldom does), else the scanned average; checked again on decoded timestamps.
        scanned = (self.end - self.first) / self.num_frames
        rate = float(m.average_fps_from_header or 0.0)
        self.step = 1.0 / rate if rate > 0 else scanned
        constant = scanned <= 0 or abs(self.step / scanned - 1.0) < RATE_TOLERANCE
        if self.step <= 0:  # one frame without a duration nor a rate: any step will do
            self.step = 1.0
        # the LATTICES the timestamps may lie on; decoded timestamps rule some out
        self.lattices: tuple[float, ...] = LATTICES if constant else ()
        header = m.duration_seconds_from_header  # the header first, as VideoFile does
        self.duration: float | None = float(header) if header is not None else self.end - self.start

    def measure_duration(self) -> float:
        """Known from the scan at open: the end of the last frame."""
        self.duration = self.end - self.start
        return self.duration

    def frame_count(self) -> int:
        return self.num_frames

    def _decode(self, indices: Sequence[int], short_side: int | None = None,
                ) -> tuple[dict[int, np.ndarray], dict[int, float]]:
        """Each distinct index's frame ``(H, W, 3)`` (short side scaled to ``short_side``) and
        timestamp, from one batch call, or from batches of ``BATCH_BYTES`` each resized."""
        unique = sorted({int(i) for i in indices})
        if not unique:
            return {}, {}
        frame_bytes = max(scratch_bytes(self.width, self.height, short_side), 1)
        per = len(unique) if short_side is None else max(BATCH_BYTES // frame_bytes, 1)
        ReadBudget().expect(len(unique) + len(indices), *out_size(self.width, self.height, short_side),
                            f"{len(unique)} distinct frames",  # the frames, then the clips
                            scratch_bytes(self.width, self.height, short_side, min(per, len(unique))))
        frames: dict[int, np.ndarray] = {}
        times: dict[int, float] = {}
        for lo in range(0, len(unique), per):
            chunk = unique[lo:lo + per]
            batch = self.decoder.get_frames_at(chunk)
            data = batch.data  # (n, H, W, 3) uint8
            if short_side is not None:  # (n, 3, H, W) channels last, as the dataset lays clips out
                data = resize_frames(data.permute(0, 3, 1, 2), short_side).permute(0, 2, 3, 1)
            data = data.numpy()
            pts = batch.pts_seconds.tolist()
            frames.update((i, data[k]) for k, i in enumerate(chunk))
            times.update((i, float(pts[k])) for k, i in enumerate(chunk))
        return frames, times

    def frames_at(self, indices: Sequence[Sequence[int]],
                  short_side: int | None = None) -> list[np.ndarray]:
        """The frames at each list of indices, as uint8 ``(T, H, W, 3)`` arrays."""
        clips = [[min(int(i), self.num_frames - 1) for i in clip] for clip in indices]
        frames, _ = self._decode([i for clip in clips for i in clip], short_side)
        return [np.stack([frames[i] for i in clip]) for clip in clips]

    def _time_of(self, i: int, quantum: float) -> float:
        """Frame ``i``'s predicted timestamp: on the grid, rounded to ``quantum`` (if not 0)."""
        t = self.first + i * self.step
        return math.floor(t / quantum + 0.5) * quantum if quantum else t

    def _first_index_at(self, t: float, quantum: float) -> int:
        """The first frame at or after ``t`` seconds, as predicted (``N`` if none)."""
        t += self.start
        i = min(max(math.ceil((t - self.first) / self.step - EPS), 0), self.num_frames)
        if quantum:  # rounding moves a timestamp by up to half a quantum: settle it
            while i > 0 and self._time_of(i - 1, quantum) >= t - TIME_EPS:
                i -= 1
            while i < self.num_frames and self._time_of(i, quantum) < t - TIME_EPS:
                i += 1
        return i

    def _window_indices(self, start: float, end: float, num_frames: int,
                        quantum: float = 0.0) -> list[int]:
        """The kept frames of ``[start, end)``, chosen as ``VideoFile.clips`` chooses them; an
        empty window (past the real end) takes the last ``num_frames`` frames before it."""
        lo, hi = self._first_index_at(start, quantum), self._first_index_at(end, quantum)
        inside = range(lo, hi)
        if not inside:
            inside = range(max(lo - num_frames, 0), lo) or range(lo, min(lo + 1, self.num_frames))
        return [inside[k] for k in uniform_indices(len(inside), num_frames).tolist()]

    def _exact_window(self, start: float, end: float, num_frames: int,
                      short_side: int | None = None) -> np.ndarray:
        """The window's frames found by timestamp (a variable-frame-rate stream), the kept
        ones scaled to ``short_side``."""
        lo = max(start + self.start, self.first)
        hi = min(end + self.start, self.end)
        if lo < hi:
            average = (self.end - self.first) / self.num_frames  # the range's frames, estimated
            ReadBudget().expect(math.ceil((hi - lo) / average) + 1 if average > 0 else self.num_frames,
                                self.width, self.height, "the frames of one clip window")
            batch = self.decoder.get_frames_played_in_range(lo, hi)
            frames, pts = batch.data, batch.pts_seconds  # (n, H, W, 3), (n,)
            if hi >= self.end:  # the range stops before the end: add the last frame
                last = self.decoder.get_frames_at([self.num_frames - 1])
                if not len(pts) or last.pts_seconds[0] > pts[-1]:
                    frames, pts = torch.cat([frames, last.data]), torch.cat([pts, last.pts_seconds])
            t = pts - self.start  # it starts with the frame on screen at ``lo``: keep those from it
            frames = frames[(t >= start - TIME_EPS) & (t < end - TIME_EPS)]  # (n', H, W, 3)
            if len(frames):
                kept = frames[uniform_indices(len(frames), num_frames)]  # (T, H, W, 3)
                if short_side is not None:
                    kept = resize_frames(kept.permute(0, 3, 1, 2), short_side).permute(0, 2, 3, 1)
                return kept.numpy()
        return self.frames_at([self._window_indices(start, end, num_frames)], short_side)[0]

    def clips(self, windows: Sequence[tuple[float, float]], num_frames: int,
              short_side: int | None = None) -> list[np.ndarray]:
        """``num_frames`` frames evenly spaced over the frames in each ``[start, end)`` window,
        as uint8 ``(T, H, W, 3)`` arrays in the order of ``windows``, short side scaled to
        ``short_side`` (None: as decoded)."""
        picks = [{q: self._window_indices(s, e, num_frames, q) for q in self.lattices}
                 for s, e in windows]  # per window, the kept frames on each possible lattice
        frames, pts = self._decode([i for p in picks for pick in p.values() for i in pick], short_side)
        self.lattices = tuple(q for q in self.lattices  # those the decoded timestamps lie on
                              if all(abs(t - self._time_of(i, q)) <= TIME_EPS for i, t in pts.items()))
        out = []
        for (s, e), pick in zip(windows, picks, strict=True):
            choices = {tuple(pick[q]) for q in self.lattices}
            if len(choices) == 1:
                out.append(np.stack([frames[i] for i in choices.pop()]))
            else:  # off every lattice (variable rate), or they disagree on this window (rare)
                out.append(self._exact_window(s, e, num_frames, short_side))
        return out

    def close(self) -> None:
        self.decoder = None  # torchcodec frees the file with the decoder object

    def __enter__(self) -> TorchCodecVideo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
