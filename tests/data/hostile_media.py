"""Hostile videos for the media-budget tests, small on disk and costly to decode naively:
``python tests/data/hostile_media.py FOLDER`` writes every kind of ``KINDS`` there.

Run as a script, in a process of its own: once a video has been opened, the decoder caps every
FFmpeg allocation of its process (``videotrain.data.media_budget``), and an 8192x8192 frame
could then not even be encoded. Each file is a harmless payload of one attack class:

* ``frame_8192.mp4``: one 8192x8192 frame (the issue's video: 12 GB as RGB when decoded whole);
* ``frame_6000.mp4``: one 6000x6000 frame, over the frame budget but under FFmpeg's cap;
* ``frame_4096.mp4``: two 4096x4096 frames, exactly at the frame budget (accepted);
* ``declared_frames.mp4``: an MP4 of three frames whose header declares fifty million;
* ``lying_header.mp4``: an H.264 stream whose first frames are 64x64 and whose last is
  6000x6000 (what the header says is not what is decoded);
* ``dense_window.mp4``: 100 frames of 2048x2048 at 1000 fps, all in one clip window;
* ``text.mp4``, ``empty.mp4``, ``truncated.mp4``: not videos, or half of one.
"""

from __future__ import annotations

import io
import struct
import sys
from pathlib import Path

import av

DECLARED_FRAMES = 50_000_000


def _encode(width: int, height: int, frames: int, rate: int = 10, fmt: str = "mp4",
            gray: int = 0) -> bytes:
    """``frames`` solid frames of ``width`` x ``height`` as H.264 (ultrafast, lowest quality:
    a few hundred bytes a frame), in ``fmt`` (``mp4``, or ``h264``: a raw stream)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "51"}
        frame = av.VideoFrame(width, height, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes([gray]) * plane.buffer_size)
        for i in range(frames):
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _declared_frames() -> bytes:
    """A three-frame MP4 whose sample tables declare ``DECLARED_FRAMES`` samples: ``stsz`` of
    constant size, one ``stts`` run and one ``stsc`` chunk that long (1.6 KB on disk; FFmpeg,
    uncapped, builds a 3.5 GB index of them in ``av.open``)."""
    data = bytearray(_encode(64, 64, 3))
    for box, offset, values in ((b"stsz", 12, (1, DECLARED_FRAMES)), (b"stts", 16, (DECLARED_FRAMES,)),
                                (b"stsc", 20, (DECLARED_FRAMES,))):
        at = data.find(box) - 4  # the box starts with its size
        struct.pack_into(f">{len(values)}I", data, at + offset, *values)
    return bytes(data)


KINDS = {
    "frame_8192.mp4": lambda: _encode(8192, 8192, 1),
    "frame_6000.mp4": lambda: _encode(6000, 6000, 1),
    "frame_4096.mp4": lambda: _encode(4096, 4096, 2, gray=128),
    "declared_frames.mp4": _declared_frames,
    "lying_header.mp4": lambda: _encode(64, 64, 10, fmt="h264") + _encode(6000, 6000, 1, fmt="h264"),
    "dense_window.mp4": lambda: _encode(2048, 2048, 100, rate=1000),
    "text.mp4": lambda: b"this is a text file with an .mp4 name\n",
    "empty.mp4": lambda: b"",
    "truncated.mp4": lambda: _encode(64, 64, 20)[:700],
}


def write_all(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, make in KINDS.items():
        (folder / name).write_bytes(make())


if __name__ == "__main__":
    write_all(Path(sys.argv[1]))
