"""``data.decoder=torchcodec``: the same frames as the PyAV decoder for the same windows and
frame indices (within YUV->RGB rounding), the same handling of bad files, the config key, and
a message naming the extra where torchcodec cannot be imported."""

from __future__ import annotations

import os
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

from videotrain.config.build import build_data_from_cfg
from videotrain.data.annotations import VideoIndex, kinetics_index
from videotrain.data.dataset import BadVideo, SampleKey, VideoClipDataset
from videotrain.data.decode import VideoFile, check_decoder, open_video
from videotrain.data.decode_torchcodec import DecoderUnavailable, TorchCodecVideo
from videotrain.data.loaders import build_data
from videotrain.data.transforms import train_transform

FPS, LENGTH = 10, 40  # 4 s
MAX_MEAN_DIFF = 3.0  # levels: FFmpeg builds may convert YUV to RGB a little differently


def _texture_frames(length: int = LENGTH) -> np.ndarray:
    """A blocky random texture moving 3 px a frame: neighbouring frames differ a lot, so a
    decoder that took the wrong frame would fail the tolerance."""
    blocks = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    texture = np.kron(blocks, np.ones((4, 4, 1), np.uint8))  # (32, 32, 3)
    return np.stack([np.roll(texture, 3 * i, axis=1) for i in range(length)])  # (T, H, W, 3)


def _write(path: Path, frames: np.ndarray, times_ms: list[int] | None = None, fps: int = FPS) -> Path:
    """H.264 MP4, MPEG-4 AVI or VP8 WebM (by suffix); ``times_ms``: a variable frame rate."""
    codec = {".mp4": "libx264", ".avi": "mpeg4", ".webm": "libvpx"}[path.suffix]
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        stream.bit_rate = 4_000_000
        if times_ms is not None:
            stream.codec_context.time_base = stream.time_base = Fraction(1, 1000)
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            if times_ms is not None:
                frame.pts, frame.time_base = times_ms[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.fixture(scope="module", params=["mp4", "avi", "webm"])
def video(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("tc") / f"clip.{request.param}", _texture_frames())


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def _assert_same(expected: list[np.ndarray], got: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape and g.dtype == np.uint8
        diffs = [_diff(ef, gf) for ef, gf in zip(e, g, strict=True)]  # per frame
        assert max(diffs) < MAX_MEAN_DIFF, diffs


def test_a_wrong_frame_would_be_caught() -> None:
    frames = _texture_frames()
    assert min(_diff(frames[i], frames[i + 1]) for i in range(LENGTH - 1)) > 10 * MAX_MEAN_DIFF


WINDOWS = [
    [(0.0, 1.6)], [(1.3, 2.9)], [(0.05, 0.35)], [(2.4, 4.0)],
    [(3.5, 5.1)],  # runs past the end
    [(2.0, 3.0), (0.0, 1.0), (0.5, 1.5), (3.6, 4.6), (0.5, 1.5)],  # evaluation-like, any order
]


@pytest.mark.parametrize("windows", WINDOWS, ids=str)
def test_same_clips_as_pyav(torchcodec: None, video: Path, windows: list) -> None:
    with VideoFile(str(video)) as ref, TorchCodecVideo(str(video)) as tc:
        assert tc.duration == pytest.approx(ref.duration, abs=1e-6)
        _assert_same(ref.clips(windows, 8), tc.clips(windows, 8))


def test_same_frames_at_indices_as_pyav(torchcodec: None, video: Path) -> None:
    indices = [[0, 5, 10, 39], [39, 0, 0, 17], [45, 2]]  # any order, repeats; past the end: last
    with VideoFile(str(video)) as ref, TorchCodecVideo(str(video)) as tc:
        assert ref.frame_count() == tc.frame_count() == LENGTH
        _assert_same(ref.frames_at(indices), tc.frames_at(indices))


def test_only_the_kept_frames_are_decoded(torchcodec: None, video: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with TorchCodecVideo(str(video)) as tc:
        asked: list[list[int]] = []
        real = tc.decoder.get_frames_at
        monkeypatch.setattr(tc.decoder, "get_frames_at", lambda i: asked.append(list(i)) or real(i))
        tc.clips([(0.0, 2.0), (1.0, 3.0)], 4)  # 20 frames in each window, 4 kept
    assert len(asked) == 1 and len(asked[0]) <= 8  # one call, the kept frames only


def test_variable_frame_rate_matches_pyav(torchcodec: None, tmp_path: Path) -> None:
    """Frames 50 or 150 ms apart: the constant-rate grid does not hold, timestamps decide."""
    times = np.cumsum([0] + [150 if i % 3 == 0 else 50 for i in range(1, 30)]).tolist()
    path = _write(tmp_path / "vfr.mp4", _texture_frames(30), times)
    windows = [(0.2, 1.0), (0.25, 0.35), (2.2, 3.0), (0.0, 2.4)]
    with VideoFile(str(path)) as ref, TorchCodecVideo(str(path)) as tc:
        assert tc.lattices == ()  # found variable at open
        _assert_same(ref.clips(windows, 4), tc.clips(windows, 4))


def test_millisecond_timestamps_match_pyav(torchcodec: None, tmp_path: Path) -> None:
    """WebM at 30 fps: frames are 33 or 34 ms apart, so a window edge between a frame's rounded
    time and the exact grid (here 0.0668 s: frame 2 is at 67 ms, the grid says 66.7) must go
    by the timestamp, as PyAV's does."""
    path = _write(tmp_path / "30fps.webm", _texture_frames(30), fps=30)
    windows = [(0.0668, 0.5), (0.1, 0.7), (0.3335, 0.9)]
    with VideoFile(str(path)) as ref, TorchCodecVideo(str(path)) as tc:
        _assert_same(ref.clips(windows, 4), tc.clips(windows, 4))
        assert tc.lattices == (1e-3,)


# ---------------------------------------------------------------------------- bad files
VICTIM = "train/left_then_up/left_then_up_0001.mp4"  # a real file of the tiny dataset


def _break(root: Path, kind: str) -> None:
    path = root / VICTIM
    if kind == "missing":
        path.unlink()
    elif kind == "zero_byte":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_text("this is a text file with an .mp4 name\n")


@pytest.mark.parametrize("kind", ["missing", "zero_byte", "truncated", "text_as_mp4"])
def test_bad_files_are_skipped_the_same_way(torchcodec: None, tiny_copy: Path, kind: str) -> None:
    _break(tiny_copy, kind)
    index = kinetics_index(tiny_copy, "train")
    victim = next(i for i, (p, _) in enumerate(index.paths) if p.endswith(VICTIM))
    results = {}
    for decoder in ("pyav", "torchcodec"):
        ds = VideoClipDataset(index, 4, 0.8, train_transform(32, 32), train=True, decoder=decoder)
        with pytest.raises(BadVideo, match=rf"{VICTIM}: cannot open \("):
            ds._decode(str(tiny_copy / VICTIM))
        item = ds[SampleKey(victim, 0)]  # through the retry logic: replaced, reported
        assert item["skipped"] == [str(tiny_copy / VICTIM)] and item["video"].shape == (4, 3, 32, 32)
        results[decoder] = item["index"]
    assert results["pyav"] == results["torchcodec"]  # the same replacement


def test_missing_file_raises_file_not_found(torchcodec: None, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        TorchCodecVideo(str(tmp_path / "missing.mp4"))


@pytest.mark.parametrize("suffix", [".avi", ".webm"])
def test_truncated_stream_keeps_the_frames_that_survive(torchcodec: None, tmp_path: Path,
                                                        suffix: str) -> None:
    """A half-downloaded AVI or WebM still opens; both decoders count and read what is left."""
    video = _write(tmp_path / f"clip{suffix}", _texture_frames())
    cut = tmp_path / f"cut{suffix}"
    cut.write_bytes(video.read_bytes()[: video.stat().st_size // 2])
    with VideoFile(str(cut)) as ref, TorchCodecVideo(str(cut)) as tc:
        n = ref.frame_count()
        assert 0 < n < LENGTH and tc.frame_count() == n
        # the last packet is cut short: FFmpeg versions conceal its damage differently
        _assert_same(ref.frames_at([[0, n // 2, n - 2]]), tc.frames_at([[0, n // 2, n - 2]]))
        _assert_same(ref.clips([(0.0, (n - 1) / FPS)], 4), tc.clips([(0.0, (n - 1) / FPS)], 4))


def test_raw_stream_is_a_bad_video_for_torchcodec(torchcodec: None, tmp_path: Path) -> None:
    """torchcodec's exact scan cannot seek back through a raw H.264 stream (PyAV reads it)."""
    path = tmp_path / "clip.h264"
    with av.open(str(path), "w", format="h264") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for rgb in _texture_frames(8):
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    nothing = VideoIndex(LabeledVideoPaths([]), [], "none")
    ds = VideoClipDataset(nothing, 4, 0.4, lambda c: c, train=True, decoder="torchcodec")
    with pytest.raises(BadVideo, match=r"clip\.h264: cannot open \(RuntimeError: .*seek") as err:
        ds._decode(str(path))
    assert ".cpp:" not in str(err.value)  # FFmpeg's message without torchcodec's source location


# -------------------------------------------------------------------- config and install
def test_decoder_config_key_composes_and_reads(torchcodec: None, compose_cfg, run_overrides) -> None:
    cfg = compose_cfg([*run_overrides(), "data.decoder=torchcodec", "data.sampler=segment",
                       "data.val_batch_size=2"])
    assert cfg.data.decoder == "torchcodec" and cfg.data.sampler == "segment"
    data, bad = build_data_from_cfg(cfg, torch.device("cpu"))
    assert bad == [] and data.train.dataset.decoder == data.val.dataset.decoder == "torchcodec"
    data.train_sampler.set_epoch(0)
    batch = next(iter(data.train))
    assert batch["video"].shape == (4, 4, 3, 32, 32) and batch["skipped"] == []  # (B, T, C, H, W)
    val = next(iter(data.val))
    assert val["video"].shape == (2, cfg.data.val_clips * cfg.data.val_crops, 4, 3, 32, 32)


def test_default_decoder_and_sampler(compose_cfg) -> None:
    for option in ("synthetic", "kinetics", "ucf101", "hmdb51", "ssv2", "folder"):
        data = compose_cfg([f"data={option}"]).data
        assert (data.decoder, data.sampler) == ("pyav", "random"), option


def test_unavailable_torchcodec_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                tiny_root: Path) -> None:
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    for call in (lambda: check_decoder("torchcodec"),
                 lambda: open_video(str(tiny_root / VICTIM), "torchcodec"),
                 lambda: VideoClipDataset(kinetics_index(tiny_root, "val"), 4, 0.8, lambda c: c,
                                          train=False, decoder="torchcodec")):
        with pytest.raises(DecoderUnavailable) as err:
            call()
        msg = str(err.value)
        assert 'pip install -e ".[torchcodec]"' in msg and "data.decoder=torchcodec" in msg, msg
        assert "apt-get install ffmpeg" in msg and "data.decoder=pyav" in msg, msg
    with pytest.raises(DecoderUnavailable):  # before any file is read
        build_data(name="kinetics", layout="kinetics", root=str(tiny_root), num_frames=4,
                   sampling_rate=2, fps=10, short_side=32, crop_size=32, train_scale=(0.5, 1.0),
                   hflip=False, batch_size=4, val_batch_size=4, num_workers=0, val_clips=1,
                   val_crops=1, max_bad_fraction=0.1, decoder="torchcodec")


def test_unknown_decoder_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"data\.decoder must be one of pyav, torchcodec, got 'ffmpeg'"):
        check_decoder("ffmpeg")


def test_decoder_unavailable_is_not_a_bad_video(monkeypatch: pytest.MonkeyPatch, tiny_root: Path) -> None:
    """A missing install fails the item at once instead of skipping every video as broken."""
    ds = VideoClipDataset(kinetics_index(tiny_root, "train"), 4, 0.8, lambda c: c, train=True)
    ds.decoder = "torchcodec"  # as if torchcodec went missing after the dataset was built
    monkeypatch.setitem(sys.modules, "torchcodec", None)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    with pytest.raises(DecoderUnavailable):
        ds[SampleKey(0, 0)]


@pytest.mark.parametrize("broken", {
    "torchcodec missing": "raise ModuleNotFoundError(\"No module named 'torchcodec'\")",
    "FFmpeg missing": "raise OSError('libavutil.so.59: cannot open shared object file')",
}.items(), ids=["torchcodec missing", "FFmpeg missing"])
def test_cli_unavailable_decoder_is_one_error_line(broken: tuple[str, str], run_cli, run_overrides,
                                                   tmp_path: Path) -> None:
    """What a user sees: one ``error:`` line naming the extra and the way out, exit status 2,
    no traceback, no run."""
    fake = tmp_path / "fake"  # a torchcodec package whose import fails as the real one would
    (fake / "torchcodec").mkdir(parents=True)
    (fake / "torchcodec" / "__init__.py").write_text(broken[1] + "\n")
    env_path = os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])
    done = run_cli([*run_overrides(), "data.decoder=torchcodec", f"hydra.run.dir={tmp_path / 'run'}"],
                   cwd=tmp_path, env={"PYTHONPATH": env_path})
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert 'pip install -e ".[torchcodec]"' in errors[0] and "data.decoder=pyav" in errors[0]
    assert broken[0].split()[0].lower() in errors[0].lower() or "libavutil" in errors[0]
    assert not (tmp_path / "run" / "results.json").exists()
