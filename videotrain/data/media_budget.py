"""Media within bounds: what one video may cost before it is refused, for both decoders.

Why: a video is a file a stranger can make (a shared dataset folder, a file handed to
``predict``). A few KB of H.264 can declare 8192x8192 frames (12 GB once decoded to RGB), an MP4
header of 1.6 KB can declare fifty million frames (FFmpeg's index of them: 3.5 GB and 11 s in
``av.open``), and thousands of tiny solid frames can keep a decoder busy for minutes. The budgets
are ``videotrain.untrusted.bounds``' ``MAX_*`` constants; the decoders check them here:

* the header's frame size and frame count, when the file is opened (before anything is decoded);
* every decoded frame's size before it is converted to RGB (a header may lie);
* what one read of the video (``clips``, ``frames_at``, ``measure_duration``) decodes and holds:
  the frames it returns at the size they are returned (the decoders resize each frame to the
  transform's short side as it becomes RGB), the decoded frames waiting to be chosen;
* every single allocation FFmpeg makes (``av_max_alloc``), which bounds what ``av.open`` itself
  builds from a header, before any of the checks above can run.

A refusal is a ``VideoTooLarge`` (a ``ValueError``), which the dataset turns into a skipped
``BadVideo`` like any unreadable file, and ``predict`` into one ``error:`` line.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os

from videotrain.data.transforms import resized_size
from videotrain.untrusted.bounds import (
    MAX_DECODED_BYTES,
    MAX_DECODED_PIXELS,
    MAX_FFMPEG_ALLOC,
    MAX_FRAME_PIXELS,
    MAX_VIDEO_FRAMES,
)

log = logging.getLogger(__name__)

RESIZE_HINT = "resize the videos (python -m videotrain.prepare ... --resize 320; docs/data.md)"


class VideoTooLarge(ValueError):
    """A video over a media budget: refused before its frames are converted (the message says
    which budget, in numbers only: nothing read from the file is quoted)."""


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.0f} MiB"


def check_frame_size(width: int, height: int, source: str = "a decoded frame has") -> None:
    """Refuse frames over ``MAX_FRAME_PIXELS`` (``source``: where the size was read)."""
    if int(width) * int(height) > MAX_FRAME_PIXELS:
        raise VideoTooLarge(f"{source} {int(width)}x{int(height)} pixels, over the budget of "
                            f"{MAX_FRAME_PIXELS / 1e6:.1f} MP per frame; {RESIZE_HINT}")


def check_frame_count(frames: float, source: str) -> None:
    """Refuse a video of more than ``MAX_VIDEO_FRAMES`` frames (as ``source`` counts them)."""
    if frames > MAX_VIDEO_FRAMES:
        raise VideoTooLarge(f"{source} {int(frames):,} frames, over the budget of "
                            f"{MAX_VIDEO_FRAMES:,} frames per video")


def out_size(width: int, height: int, short_side: int | None) -> tuple[int, int]:
    """``(width, height)`` of a frame as a read returns it (0 stays 0: a header without one)."""
    if short_side is None or not width or not height:
        return int(width), int(height)
    h, w = resized_size(int(height), int(width), short_side)
    return w, h


def scratch_bytes(width: int, height: int, short_side: int | None, frames: int = 1) -> int:
    """The source-size RGB that ``frames`` frames pass through on their way to ``short_side``."""
    return int(frames) * int(width) * int(height) * 3 if short_side is not None else 0


class ReadBudget:
    """The pixels one read of a video decodes and the bytes it holds, refused past
    ``MAX_DECODED_PIXELS`` and ``MAX_DECODED_BYTES``. ``held``: decoded frames waiting to be
    chosen (YUV); ``rgb``: the RGB frames made for this read (returned, or kept to be), at the
    size they are returned (the transform's short side, where the decoder resizes them);
    ``scratch``: source-size RGB frames on their way to that size (one frame, or one batch)."""

    def __init__(self) -> None:
        self.pixels = 0
        self.held = 0
        self.rgb = 0
        self.scratch = 0

    def decoded(self, width: int, height: int) -> None:
        """One frame decoded: its size checked before it is converted or kept."""
        check_frame_size(width, height)
        self.pixels += int(width) * int(height)
        if self.pixels > MAX_DECODED_PIXELS:
            raise VideoTooLarge(f"one read decodes more than {MAX_DECODED_PIXELS / 1e9:.1f} "
                                f"gigapixels (the budget); {RESIZE_HINT}, or shorten them")

    def expect(self, frames: int, width: int, height: int, what: str, scratch: int = 0) -> None:
        """Refuse, before decoding, a read whose RGB frames alone would exceed the budget:
        ``frames`` of ``width`` x ``height`` (as returned; from the header, 0 when it has none:
        checked when made) and ``scratch`` bytes of source-size frames being resized."""
        need = int(frames) * int(width) * int(height) * 3 + int(scratch)
        if need > MAX_DECODED_BYTES:
            raise VideoTooLarge(f"{what} at {int(width)}x{int(height)} take {_mib(need)} as RGB, "
                                f"over the budget of {_mib(MAX_DECODED_BYTES)} per video; lower "
                                f"eval.clips or data.num_frames, or {RESIZE_HINT}")

    def hold(self, held_bytes: int) -> None:
        """The decoded frames now waiting to be chosen take ``held_bytes``."""
        self.held = int(held_bytes)
        self._check()

    def convert(self, frames: int, width: int, height: int, scratch: int = 0) -> None:
        """``frames`` RGB frames of ``width`` x ``height`` are about to be made, through
        ``scratch`` bytes of source-size RGB (freed once they are made: the next call's)."""
        self.rgb += int(frames) * int(width) * int(height) * 3
        self.scratch = int(scratch)
        self._check()

    def release(self, frames: int, width: int, height: int) -> None:
        """RGB frames made for this read and dropped (a clip read again another way)."""
        self.rgb -= int(frames) * int(width) * int(height) * 3

    def _check(self) -> None:
        total = self.held + self.rgb + self.scratch
        if total > MAX_DECODED_BYTES:
            raise VideoTooLarge(f"its frames take {_mib(total)} (decoded ones waiting to be "
                                f"chosen: {_mib(self.held)}, RGB: {_mib(self.rgb + self.scratch)}), "
                                f"over the budget of {_mib(MAX_DECODED_BYTES)} per video (frames "
                                f"too large or too many in one clip's time); {RESIZE_HINT}")


def _loaded_libavutil() -> list[str]:
    """The FFmpeg ``libavutil`` libraries mapped into this process (PyAV's bundled one, the
    system's that torchcodec loads), else PyAV's bundled copies found beside the package."""
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:  # the process's own
            for line in maps:
                path = line.rstrip("\n").partition("/")[2]
                if "libavutil" in path.rpartition("/")[2]:
                    found.append("/" + path)
    except OSError:  # not Linux: PyAV wheels keep their FFmpeg beside the package
        import av

        here = os.path.dirname(os.path.dirname(av.__file__))
        for pattern in ("av.libs/libavutil*", "av/.dylibs/libavutil*", "av.libs/avutil*.dll"):
            found += glob.glob(os.path.join(here, pattern))
    return sorted(set(found))


@functools.cache
def limit_ffmpeg_allocations(decoder: str) -> int:
    """Cap every single allocation of each loaded FFmpeg at ``MAX_FFMPEG_ALLOC``
    (``av_max_alloc``), once per ``decoder`` and process, after the decoder is imported; returns
    how many libraries were capped. Legitimate video needs at most a 4096x4096 frame's plane
    (16 MiB at 8 bits); a crafted header's frame index or an 8192x8192 plane fails to
    allocate, and the file fails to open or decode as a bad video."""
    capped = 0
    for path in _loaded_libavutil():
        try:
            lib = ctypes.CDLL(path)
            lib.av_max_alloc.argtypes, lib.av_max_alloc.restype = [ctypes.c_size_t], None
        except (OSError, AttributeError):  # not loadable, or not an FFmpeg after all
            continue
        lib.av_max_alloc(MAX_FFMPEG_ALLOC)
        capped += 1
    if not capped:  # e.g. an FFmpeg linked statically: the checks above still hold
        log.warning("%s: no FFmpeg libavutil found in this process; its allocations are not "
                    "capped at %s (a crafted header may cost memory in av.open)", decoder,
                    _mib(MAX_FFMPEG_ALLOC))
    return capped
