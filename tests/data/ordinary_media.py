"""Ordinary videos for the tests that legitimate use is unchanged by the media budgets: what a
camera or a download gives (1080p, 4K, small, portrait), a few seconds at 30 fps, textured and
moving, at a low bitrate (H.264, ultrafast: a 3 s 1080p file is about 120 KB and takes a few
seconds to write; 4K about four times that).

Written in a process of their own (:func:`write_videos`, or ``python
tests/data/ordinary_media.py FOLDER JSON``): once a process has opened a video, the decoder caps
every FFmpeg allocation in it (``videotrain.data.media_budget``), and x264 could then not
encode 1080p.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import av
import numpy as np


def ordinary_video(path: Path, width: int, height: int, seconds: float = 3.0,
                   rate: int = 30) -> Path:
    """Write ``seconds`` of ``width`` x ``height`` video at ``rate`` fps to ``path``: one
    textured frame (gradients and noise, so that resizing has work to do) panned sideways."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:height, 0:width]
    texture = np.stack([np.sin(xx / 23.0) * 90 + 128, np.cos(yy / 17.0) * 90 + 128,
                        (xx + yy) % 256 * 0.8], -1).astype(np.uint8)
    texture += rng.integers(0, 24, texture.shape, dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "40"}
        for i in range(round(seconds * rate)):
            frame = av.VideoFrame.from_ndarray(np.roll(texture, 6 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_videos(folder: Path, videos: dict[str, tuple[int, int, float]]) -> dict[str, Path]:
    """``{name: (width, height, seconds)}`` written as ``folder/NAME.mp4`` at 30 fps, by a
    process of its own; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, str(folder), json.dumps(videos)], check=True,
                   timeout=300)
    return {name: folder / f"{name}.mp4" for name in videos}


if __name__ == "__main__":
    for name, (width, height, seconds) in json.loads(sys.argv[2]).items():
        ordinary_video(Path(sys.argv[1]) / f"{name}.mp4", width, height, seconds)
