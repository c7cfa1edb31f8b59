"""The PyAV clip decoder: the same frames as pytorchvideo's decoder, decoded with less work,
and the files pytorchvideo handles badly (WebM without a stream duration, raw streams); frames
by index for ``data.sampler=segment``. The kept frames chosen as they arrive (a 4K video's
windows) are those chosen after the window; kept frames resized as they are decoded are the
transform's resize of them."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from pytorchvideo.data.encoded_video import EncodedVideo

from videotrain.data import decode
from videotrain.data.clip_sampling import clip_windows, uniform_indices
from videotrain.data.decode import VideoFile
from videotrain.data.synthetic import SyntheticSpec, render_clip, write_video
from videotrain.data.transforms import resize_frames

SPEC = SyntheticSpec(num_frames=40, size=32)  # 4 s at 10 fps
FRAMES = render_clip(SPEC, 1, np.random.default_rng(3))  # (T, H, W, 3)


@pytest.fixture(scope="module", params=["mp4", "avi", "webm"])
def video(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("decode") / f"clip.{request.param}"
    write_video(path, FRAMES, SPEC.fps)
    return path


def _pytorchvideo_clip(path: Path, start: float, end: float, num: int) -> np.ndarray:
    """What the dataset decoded before: EncodedVideo's window, uniformly subsampled."""
    video = EncodedVideo.from_path(str(path), decode_audio=False, decoder="pyav")
    try:
        frames = video.get_clip(start, end)["video"]  # (C, T, H, W) float
    finally:
        video.close()
    frames = frames[:, uniform_indices(frames.shape[1], num)]
    return frames.permute(1, 2, 3, 0).to(torch.uint8).numpy()  # (T, H, W, C)


@pytest.mark.parametrize("window", [(0.0, 1.6), (1.3, 2.9), (2.4, 4.0), (3.5, 5.1)])
def test_same_frames_as_pytorchvideo(video: Path, window: tuple[float, float]) -> None:
    with VideoFile(str(video)) as v:
        ours = v.clips([window], 8)[0]
    assert ours.shape == (8, 32, 32, 3) and ours.dtype == np.uint8
    if window[0] < 4.0 - 0.05:  # pytorchvideo returns no frames for a window past the end
        assert np.array_equal(ours, _pytorchvideo_clip(video, *window, 8))


def test_duration_from_the_container_when_the_stream_has_none(video: Path) -> None:
    with av.open(str(video)) as c:
        stream_duration = c.streams.video[0].duration
    with VideoFile(str(video)) as v:
        assert v.duration == pytest.approx(4.0, abs=0.11)
    if video.suffix == ".webm":
        # the case where pytorchvideo decodes and holds the whole video to learn its length
        assert stream_duration is None


def test_windows_in_any_order_equal_windows_one_by_one(video: Path) -> None:
    """Overlapping (evaluation) windows are decoded in one pass; the result must not depend
    on the order they are asked in, nor on decoding them together."""
    windows = [(2.0, 3.0), (0.0, 1.0), (0.5, 1.5), (3.6, 4.6), (0.5, 1.5)]
    with VideoFile(str(video)) as v:
        together = v.clips(windows, 5)
    for window, clip in zip(windows, together, strict=True):
        with VideoFile(str(video)) as v:
            assert np.array_equal(clip, v.clips([window], 5)[0]), window
    assert not np.array_equal(together[0], together[1])
    assert np.array_equal(together[2], together[4])


def test_window_past_the_end_falls_back_to_the_last_frames(video: Path) -> None:
    with VideoFile(str(video)) as v:
        late = v.clips([(10.0, 11.0)], 4)[0]
        last = v.clips([(3.6, 4.0)], 4)[0]
    assert late.shape == (4, 32, 32, 3)
    assert np.array_equal(late[-1], last[-1])  # the video's final frame


@pytest.fixture
def converted(monkeypatch: pytest.MonkeyPatch) -> list:
    """The timestamps of the frames converted to arrays (``VideoFrame.to_ndarray`` calls)."""
    calls: list = []
    real = av.VideoFrame.to_ndarray

    def counting(self, *args, **kwargs):
        calls.append(self.pts)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(av.VideoFrame, "to_ndarray", counting)
    return calls


def test_only_kept_frames_are_converted(video: Path, converted: list) -> None:
    with VideoFile(str(video)) as v:
        v.clips([(0.0, 2.0)], 4)  # 20 frames in the window, 4 kept
    assert len(converted) == 4


def _raw(path: Path, frames: int = 8) -> Path:
    """An H.264 elementary stream of ``frames`` frames: no container, no timestamps."""
    with av.open(str(path), "w", format="h264") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for frame in FRAMES[:frames]:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def test_raw_stream_without_timestamps_or_seeking(tmp_path: Path) -> None:
    """An H.264 elementary stream has no duration, no timestamps and cannot seek."""
    path = _raw(tmp_path / "clip.h264")
    with VideoFile(str(path)) as v:
        assert v.duration is None
        duration = v.measure_duration()  # 8 frames at the rate FFmpeg assumes
        assert duration == pytest.approx(8 / v.rate)
        clips = v.clips([(duration / 2, duration), (0.0, duration / 2)], 4)
    assert [c.shape for c in clips] == [(4, 32, 32, 3)] * 2
    assert not np.array_equal(clips[0], clips[1])


@pytest.mark.parametrize("content", [b"", b"not a video at all\n"])
def test_unreadable_files_raise(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.mp4"
    path.write_bytes(content)
    with pytest.raises(Exception):  # noqa: B017 - the dataset turns any error into BadVideo
        VideoFile(str(path))
    with pytest.raises(FileNotFoundError):
        VideoFile(str(tmp_path / "missing.mp4"))


class CountingVideoFile(VideoFile):
    """Counts the frames the decoder produced (whatever happens to them afterwards)."""

    decoded = 0

    def _timed(self, frames, from_start):
        for item in super()._timed(frames, from_start):
            self.decoded += 1
            yield item


def test_decoding_seeks_to_the_window_and_stops_after_it(tmp_path: Path) -> None:
    """With a keyframe every second, a window at 3.0-3.5 s of a 4 s video decodes from the
    keyframe at 3.0 s to the first frame past 3.5 s: 6 of the 40 frames."""
    path = tmp_path / "gop.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        stream.options = {"x264-params": "keyint=10:min-keyint=10:scenecut=0", "preset": "veryfast"}
        for frame in FRAMES:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with CountingVideoFile(str(path)) as v:
        v.clips([(3.0, 3.5)], 4)
        assert v.decoded == 6
    with CountingVideoFile(str(path)) as v:
        v.clips([(0.0, 0.5)], 4)  # from the start: no seek, stops after the window
        assert v.decoded == 6
    with CountingVideoFile(str(path)) as v:  # overlapping windows share one pass
        v.clips([(2.0, 3.0), (1.5, 2.5), (2.5, 3.5)], 4)
        assert v.decoded == 26  # from the keyframe at 1.0 s to the frame at 3.5 s


# ------------------------------------------------------- frames by index (data.sampler=segment)
def test_frame_count_comes_from_the_packets(video: Path, tmp_path: Path) -> None:
    """WebM headers carry no frame count and a truncated AVI's overstates it: count packets."""
    with VideoFile(str(video)) as v:
        assert v.frame_count() == 40
    cut = tmp_path / f"cut{video.suffix}"
    cut.write_bytes(video.read_bytes()[: video.stat().st_size // 2])
    if video.suffix != ".mp4":  # a cut MP4 loses its index (at the end) and does not open
        with av.open(str(cut)) as c:
            header = c.streams.video[0].frames
        with VideoFile(str(cut)) as v:
            n = v.frame_count()
            assert 0 < n < 40 and header in (0, 40)
            assert v.frames_at([[n - 1, n + 5]])[0].shape == (2, 32, 32, 3)  # past the end: last


def test_frames_at_indices_are_the_stream_frames(video: Path, converted: list) -> None:
    with VideoFile(str(video)) as v:
        everything = v.clips([(0.0, 4.0)], 40)[0]  # all 40 frames, in order
    converted.clear()
    with VideoFile(str(video)) as v:
        v.frame_count()  # then decoding starts over from the first frame
        clips = v.frames_at([[2, 7, 12, 37], [37, 0, 0]])
    assert np.array_equal(clips[0], everything[[2, 7, 12, 37]])
    assert np.array_equal(clips[1], everything[[37, 0, 0]])
    assert len(converted) == 5  # each distinct chosen frame once


# ----------------------------------------- frames chosen as they arrive (a 4K video's windows)
WINDOW_SETS = {
    "eval": clip_windows(4.0, 1.6, False, 10),  # 10 overlapping evaluation windows
    "any_order": [(2.0, 3.0), (0.0, 1.0), (0.5, 1.5), (3.6, 4.6), (0.5, 1.5)],
    "far_apart": [(0.2, 0.9), (3.0, 3.5)],  # a seek between them
    "past_the_end": [(10.0, 11.0), (0.0, 0.5)],
    "longer_than_the_video": [(0.0, 6.0)],
    "dense": [(1.0, 1.3)],  # fewer frames than kept: repeats
}


def _vfr(path: Path, frames: int = 40) -> Path:
    """Frames 60, 100 and 140 ms apart in turn: timestamps off any one frame rate."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, 1000)
        t = 0
        for i, rgb in enumerate(FRAMES[:frames]):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts, frame.time_base = t, Fraction(1, 1000)
            t += (60, 100, 140)[i % 3]
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


WAITING = VideoFile._clips_waiting


def _read(path: Path, windows: list, num_frames: int, as_they_come: bool,
          monkeypatch: pytest.MonkeyPatch, short_side: int | None = None) -> tuple[list, list]:
    """``clips`` with the kept frames chosen as they arrive (``WAITING_SHARE`` 0: every video
    takes that path) or waiting in full; also the windows the waiting path read."""
    monkeypatch.setattr(decode, "WAITING_SHARE", 0.0 if as_they_come else math.inf)
    waited: list[int] = []

    def waiting(self, windows, order, *args):
        waited.extend(order)
        return WAITING(self, windows, order, *args)

    monkeypatch.setattr(VideoFile, "_clips_waiting", waiting)
    with VideoFile(str(path)) as v:
        return v.clips(windows, num_frames, short_side), waited


@pytest.mark.parametrize("windows", list(WINDOW_SETS))
def test_frames_chosen_as_they_arrive_are_the_waiting_ones(video: Path, windows: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The two ways a read chooses its kept frames keep the same ones, in every container and
    for every kind of window; windows inside the stream settle as they arrive (none of them
    is read a second time), the others are read the waiting way."""
    asked = WINDOW_SETS[windows]
    for num_frames in (4, 8):
        fast, waited = _read(video, asked, num_frames, True, monkeypatch)
        slow, everything = _read(video, asked, num_frames, False, monkeypatch)
        assert everything == sorted(range(len(asked)), key=lambda j: asked[j][0])
        for got, want in zip(fast, slow, strict=True):
            assert np.array_equal(got, want)
        inside = [j for j, (s, e) in enumerate(asked) if e <= 4.0 - 0.05]
        if video.suffix != ".webm" or windows != "eval":  # WebM's ms timestamps may fall back
            assert not set(inside) & set(waited), (waited, inside)
        assert set(waited) >= {j for j, (s, e) in enumerate(asked) if e > 4.0}  # past the end


@pytest.mark.parametrize("kind", ["vfr", "raw", "truncated"])
def test_frames_chosen_as_they_arrive_off_the_rate(kind: str, tmp_path: Path, video: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Timestamps off the header's rate (variable frame rate), none at all (a raw stream) or a
    stream cut short: the windows that do not hold the frames the rate predicts are read the
    waiting way, and every window keeps the waiting way's frames (or both ways fail alike)."""
    if kind == "vfr":
        path = _vfr(tmp_path / "vfr.mp4")
    elif kind == "raw":
        path = _raw(tmp_path / "clip.h264", 40)
    else:
        if video.suffix == ".mp4":
            pytest.skip("a cut MP4 loses its index and does not open")
        path = tmp_path / f"cut{video.suffix}"
        path.write_bytes(video.read_bytes()[: video.stat().st_size // 2])
    with VideoFile(str(path)) as v:  # windows as the dataset makes them, from the duration
        d = v.duration if v.duration is not None else v.measure_duration()
    asked = [*clip_windows(d, d / 2.5, False, 10), (0.6 * d, 0.8 * d), (0.0, 0.3 * d), (0.1 * d, 0.4 * d)]
    try:
        slow, _ = _read(path, asked, 6, False, monkeypatch)
    except ValueError as err:  # a cut file's windows past its real end may hold nothing
        with pytest.raises(ValueError, match=re.escape(str(err))):
            _read(path, asked, 6, True, monkeypatch)
        assert kind == "truncated"
        return
    fast, waited = _read(path, asked, 6, True, monkeypatch)
    for got, want in zip(fast, slow, strict=True):
        assert np.array_equal(got, want)
    if kind == "vfr":
        assert waited  # off the rate: some windows fall back


@pytest.mark.parametrize("as_they_come", [True, False])
@pytest.mark.parametrize("short_side", [16, 32, 48])
def test_kept_frames_are_resized_as_the_transform_resizes_them(
    video: Path, short_side: int, as_they_come: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each kept frame scaled as it becomes RGB: the clip the transform's resize makes of the
    full-size clip, bit for bit (smaller, the same size, larger), both reads and both ways."""
    asked = WINDOW_SETS["eval"]
    full, _ = _read(video, asked, 8, as_they_come, monkeypatch)
    small, _ = _read(video, asked, 8, as_they_come, monkeypatch, short_side)
    for got, clip in zip(small, full, strict=True):
        want = resize_frames(torch.from_numpy(clip).permute(0, 3, 1, 2), short_side)
        assert got.shape == (8, short_side, short_side, 3)
        assert np.array_equal(got, want.permute(0, 2, 3, 1).numpy())
    indices = [[2, 7, 12, 37], [37, 0, 0]]
    with VideoFile(str(video)) as v:
        full_at = v.frames_at(indices)
    with VideoFile(str(video)) as v:
        small_at = v.frames_at(indices, short_side)
    for got, clip in zip(small_at, full_at, strict=True):
        want = resize_frames(torch.from_numpy(clip).permute(0, 3, 1, 2), short_side)
        assert np.array_equal(got, want.permute(0, 2, 3, 1).numpy())
