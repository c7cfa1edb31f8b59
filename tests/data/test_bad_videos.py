"""Broken inputs: bad videos are skipped (warned about, counted, replaced so batches stay full)
until there are too many; broken annotation files and labels fail with file and line. Videos
over the media budget (frame size, frame count, what one read decodes and holds) are refused
before any frame becomes RGB, and then skipped like any bad video; ordinary 1080p and 4K
videos are read at the default clip settings within it. A bad video is named escaped, and
FFmpeg's message that quotes its name is not relayed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ordinary_media import write_videos
from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

import videotrain.run as run
from videotrain.data import decode, media_budget
from videotrain.data.annotations import AnnotationError, VideoIndex
from videotrain.data.dataset import SampleKey, VideoClipDataset
from videotrain.data.decode import VideoFile
from videotrain.data.layouts import generate
from videotrain.data.loaders import build_data
from videotrain.data.media_budget import VideoTooLarge, limit_ffmpeg_allocations
from videotrain.data.preflight import BadDataError
from videotrain.data.synthetic import SyntheticSpec, render_clip, write_video
from videotrain.engine.inference import UnreadableVideo, ViewReader
from videotrain.engine.trainer import Trainer
from videotrain.untrusted.bounds import MAX_DECODED_BYTES, MAX_FRAME_PIXELS

VICTIM = "train/left_then_up/left_then_up_0001.mp4"  # a real file of the tiny dataset


def _zero_byte(root: Path) -> str:
    (root / VICTIM).write_bytes(b"")
    return VICTIM


def _truncated(root: Path) -> str:
    data = (root / VICTIM).read_bytes()
    (root / VICTIM).write_bytes(data[: len(data) // 2])
    return VICTIM


def _text(root: Path) -> str:
    rel = "train/left_then_up/notes.mp4"
    (root / rel).write_text("this is a text file with an .mp4 name\n")
    _replace_in_csv(root, VICTIM, rel)
    return rel


def _missing(root: Path) -> str:
    rel = "train/left_then_up/gone.mp4"
    with (root / "train.csv").open("a") as f:
        f.write(f"{rel} 3\n")
    return rel


def _replace_in_csv(root: Path, old: str, new: str) -> None:
    csv = root / "train.csv"
    assert old in csv.read_text()
    csv.write_text(csv.read_text().replace(old, new))


BREAKERS = {"zero_byte": _zero_byte, "truncated": _truncated, "text_as_mp4": _text,
            "missing_path": _missing}


@pytest.mark.parametrize("kind", list(BREAKERS))
def test_bad_video_is_skipped_and_counted(
    kind: str, tiny_copy: Path, run_overrides, compose_cfg, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    rel = BREAKERS[kind](tiny_copy)
    batch_sizes = []
    real_loss = Trainer._loss

    def recording_loss(self, video, labels):
        batch_sizes.append(video.shape[0])
        return real_loss(self, video, labels)

    monkeypatch.setattr(Trainer, "_loss", recording_loss)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        results = run.train(compose_cfg(run_overrides(root=tiny_copy)), out)

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # found by the preflight stat (missing, empty: one warning for the split) or when decoded
    assert any(("skipping bad video" in w or "missing or empty" in w) and rel in w
               for w in warnings), warnings
    saved = json.loads((out / "results.json").read_text())
    assert saved["skipped_videos"] == results["skipped_videos"] == 1
    assert saved["skipped_paths"] == [str(tiny_copy / rel)]
    # training completed, every step with a full batch (broken items were replaced)
    assert saved["steps"] == 4 and saved["epochs"] == 1 and 0.0 <= saved["val_top1"] <= 1.0
    assert batch_sizes == [4, 4, 4, 4]


@pytest.mark.parametrize("kind", ["zero_byte", "text_as_mp4"])
def test_too_many_bad_videos_fail_the_run(kind: str, tiny_copy: Path, run_overrides, compose_cfg,
                                          tmp_path: Path) -> None:
    # 3 of 16 training videos (19%) > data.max_bad_fraction=0.1
    victims = ["train/right_then_up/right_then_up_0000.mp4", "train/left_then_down/left_then_down_0002.mp4",
               "train/right_then_down/right_then_down_0003.mp4"]
    for rel in victims:
        if kind == "zero_byte":  # found by the preflight stat, before training starts
            (tiny_copy / rel).write_bytes(b"")
        else:  # found while decoding, mid-epoch
            (tiny_copy / rel).write_text("not a video")
    with pytest.raises(BadDataError) as err:
        run.train(compose_cfg(run_overrides(root=tiny_copy)), tmp_path / "run")
    msg = str(err.value)
    assert "data.max_bad_fraction=0.1" in msg and "unreadable" in msg
    assert ("train.csv" in msg) if kind == "zero_byte" else ("train split" in msg)
    assert not (tmp_path / "run" / "results.json").exists()


def test_max_bad_fraction_can_be_raised(tiny_copy: Path, run_overrides, compose_cfg,
                                        tmp_path: Path) -> None:
    for rel in ["train/right_then_up/right_then_up_0000.mp4", "train/left_then_down/left_then_down_0002.mp4"]:
        (tiny_copy / rel).write_bytes(b"")
    cfg = compose_cfg(run_overrides(root=tiny_copy, data__max_bad_fraction=0.2, trainer__max_steps=1))
    assert run.train(cfg, tmp_path)["skipped_videos"] == 2


def test_bad_fraction_is_counted_per_split(tiny_copy: Path, run_overrides, compose_cfg,
                                           tmp_path: Path) -> None:
    # train: 2 of 16 bad (12.5%), val: 1 of 8 bad (12.5%); each split is within 13%, and a bad
    # val video must not count against the train split (3 of 16 would be 19%)
    bad = ["train/right_then_up/right_then_up_0000.mp4", "train/left_then_down/left_then_down_0002.mp4",
           "val/left_then_up/left_then_up_0001.mp4"]
    for rel in bad:
        (tiny_copy / rel).write_bytes(b"")
    cfg = compose_cfg(run_overrides(root=tiny_copy, data__max_bad_fraction=0.13))
    results = run.train(cfg, tmp_path)
    assert results["skipped_videos"] == 3  # the total over both splits is still reported
    assert results["skipped_paths"] == sorted(str(tiny_copy / rel) for rel in bad)


@pytest.mark.parametrize("line", ["foo.mp4 notanint", "foo.mp4"])
def test_malformed_annotation_line_fails_with_file_and_line(
    line: str, tiny_copy: Path, run_overrides, compose_cfg, tmp_path: Path,
) -> None:
    csv = tiny_copy / "train.csv"
    lines = csv.read_text().splitlines()
    lines.insert(5, line)  # becomes line 6
    csv.write_text("\n".join(lines) + "\n")
    with pytest.raises(AnnotationError) as err:
        run.train(compose_cfg(run_overrides(root=tiny_copy)), tmp_path)
    assert f"{csv}:6:" in str(err.value)


def test_label_outside_num_classes_fails(tiny_copy: Path, run_overrides, compose_cfg,
                                         tmp_path: Path) -> None:
    csv = tiny_copy / "val.csv"
    csv.write_text(csv.read_text().replace(" 3\n", " 7\n", 1))
    with pytest.raises(AnnotationError, match=r"val\.csv: label 7 .* outside num_classes=4"):
        run.train(compose_cfg(run_overrides(root=tiny_copy)), tmp_path)
    # and an explicit data.num_classes smaller than the labels
    with pytest.raises(AnnotationError, match="outside num_classes=2"):
        run.train(compose_cfg(run_overrides(data__num_classes=2)), tmp_path)


# ------------------------------------------------------------------- acceptance, end to end

# A Kinetics-layout set big enough that 4 bad training videos stay under the default
# data.max_bad_fraction=0.1 (4 of 48), tiny enough to train an epoch in seconds.
ACCEPTANCE_SPEC = SyntheticSpec(train_per_class=12, val_per_class=2, num_frames=8, size=32, seed=1)
FOUR_BROKEN = {  # kind -> a training video of the set
    "zero_byte": "train/right_then_down/right_then_down_0003.mp4",
    "truncated": "train/right_then_up/right_then_up_0007.mp4",
    "text_as_mp4": "train/left_then_down/left_then_down_0001.mp4",
    "missing_path": "train/left_then_up/left_then_up_0010.mp4",
}


def _break(path: Path, kind: str) -> None:
    if kind == "zero_byte":
        path.write_bytes(b"")
    elif kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "text_as_mp4":
        path.write_text("these are notes, not a video\n" * 20)
    else:
        path.unlink()


@pytest.fixture
def acceptance_root(isolated_env: Path, tmp_path: Path) -> Path:
    src = generate(isolated_env / f"synthetic-{ACCEPTANCE_SPEC.digest()}", ACCEPTANCE_SPEC)
    dst = tmp_path / "kinetics"
    shutil.copytree(src, dst)
    return dst


def _cli_args(run_overrides, root: Path, run_dir: Path, **extra: object) -> list[str]:
    return [*run_overrides(root=root, **extra), f"hydra.run.dir={run_dir}"]


def test_four_broken_files(acceptance_root: Path, run_overrides, compose_cfg, tmp_path: Path,
                           caplog: pytest.LogCaptureFixture) -> None:
    """The acceptance case in-process: one of each kind of broken file in a Kinetics-layout
    set; training completes with full batches, 4 skipped videos, each named in the log."""
    for kind, rel in FOUR_BROKEN.items():
        _break(acceptance_root / rel, kind)
    with caplog.at_level(logging.WARNING):
        results = run.train(compose_cfg(run_overrides(root=acceptance_root)), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["skipped_videos"] == results["skipped_videos"] == 4
    assert saved["skipped_paths"] == sorted(str(acceptance_root / r) for r in FOUR_BROKEN.values())
    assert saved["steps"] == 12 and saved["epochs"] == 1  # 48 videos / batch 4: no step lost
    messages = "\n".join(r.getMessage() for r in caplog.records)
    for rel in FOUR_BROKEN.values():
        assert str(acceptance_root / rel) in messages, rel


@pytest.mark.slow  # a fresh interpreter and a full epoch (~20 s); in-process above
def test_four_broken_files_end_to_end(acceptance_root: Path, run_overrides, run_cli,
                                      tmp_path: Path) -> None:
    """The acceptance case: one of each kind of broken file in a Kinetics-layout set, through
    ``python -m videotrain``: training completes, results.json counts 4 skipped videos and the
    log names all four."""
    for kind, rel in FOUR_BROKEN.items():
        _break(acceptance_root / rel, kind)
    run_dir = tmp_path / "run"
    done = run_cli(_cli_args(run_overrides, acceptance_root, run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["skipped_videos"] == 4
    assert results["skipped_paths"] == sorted(str(acceptance_root / r) for r in FOUR_BROKEN.values())
    assert results["steps"] == 12 and results["epochs"] == 1  # 48 videos / batch 4: no step lost
    log_text = (run_dir / "videotrain.log").read_text()
    for rel in FOUR_BROKEN.values():
        assert str(acceptance_root / rel) in log_text, rel
    assert "data.max_bad_fraction" not in log_text


def test_most_files_broken_fails_in_process(acceptance_root: Path, run_overrides, compose_cfg,
                                            tmp_path: Path) -> None:
    kinds = list(FOUR_BROKEN)
    for i, path in enumerate(sorted((acceptance_root / "train").rglob("*.mp4"))[:30]):
        _break(path, kinds[i % 4])  # 30 of 48: 15 missing or empty, found by the preflight stat
    with pytest.raises(BadDataError, match=r"train\.csv: 15 of 48 videos are unreadable \(31% > "
                                           r"data\.max_bad_fraction=0\.1\)"):
        run.train(compose_cfg(run_overrides(root=acceptance_root)), tmp_path / "run")


@pytest.mark.slow  # a fresh interpreter; the same error is checked in-process above
def test_most_files_broken_exits_nonzero(acceptance_root: Path, run_overrides, run_cli,
                                         tmp_path: Path) -> None:
    kinds = list(FOUR_BROKEN)
    for i, path in enumerate(sorted((acceptance_root / "train").rglob("*.mp4"))[:30]):
        _break(path, kinds[i % 4])
    run_dir = tmp_path / "run"
    done = run_cli(_cli_args(run_overrides, acceptance_root, run_dir), cwd=tmp_path)
    assert done.returncode != 0
    assert "BadDataError" in done.stderr and "data.max_bad_fraction=0.1" in done.stderr
    assert "15 of 48 videos are unreadable" in done.stderr
    assert not (run_dir / "results.json").exists()


# ------------------------------------------------------------------- worker processes


def test_decode_errors_in_workers_are_skipped(tiny_copy: Path, run_overrides, compose_cfg,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """With 2 workers the broken files are found while decoding in a worker process; the
    main process counts and logs them from the batches, and every batch stays full."""
    text = _text(tiny_copy)  # (replaces VICTIM in train.csv)
    truncated = "train/right_then_down/right_then_down_0002.mp4"
    _break(tiny_copy / truncated, "truncated")
    batch_sizes = []
    real_loss = Trainer._loss

    def recording_loss(self, video, labels):
        batch_sizes.append(video.shape[0])
        return real_loss(self, video, labels)

    monkeypatch.setattr(Trainer, "_loss", recording_loss)
    cfg = compose_cfg(run_overrides(root=tiny_copy, data__num_workers=2, data__max_bad_fraction=0.2))
    with caplog.at_level(logging.WARNING):
        results = run.train(cfg, tmp_path)
    assert results["skipped_paths"] == sorted([str(tiny_copy / truncated), str(tiny_copy / text)])
    assert batch_sizes == [4, 4, 4, 4] and results["steps"] == 4
    main_log = [r.getMessage() for r in caplog.records if r.process == os.getpid()]
    for rel in (truncated, text):  # logged by the main process, not only by a worker
        assert any("bad video skipped" in m and str(tiny_copy / rel) in m for m in main_log), rel


def _loader(root: Path, **kw):
    data, _ = build_data(name="kinetics", layout="kinetics", root=str(root), num_frames=4,
                         sampling_rate=2, fps=10, short_side=32, crop_size=32, train_scale=(0.5, 1.0),
                         hflip=False, batch_size=4, val_batch_size=4, num_workers=2, val_clips=1,
                         val_crops=1, max_bad_fraction=0.1, **kw)
    data.train_sampler.set_epoch(0)
    return data.train


@pytest.mark.timeout(120)
def test_unexpected_worker_error_surfaces_instead_of_hanging(
    tiny_root: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error that is not a decode error (a bug, a transform failing) stops the run with the
    worker's message; it is not retried forever nor swallowed."""
    real = VideoClipDataset._load

    def failing(self, idx, seed):
        if idx == 5:
            raise ZeroDivisionError("transform failed on video 5")
        return real(self, idx, seed)

    monkeypatch.setattr(VideoClipDataset, "_load", failing)
    with pytest.raises(ZeroDivisionError, match="transform failed on video 5"):
        for _ in _loader(tiny_root):
            pass


def _misbehave_on(monkeypatch: pytest.MonkeyPatch, name: str, action) -> None:
    """Make decoding the video whose path ends in ``name`` run ``action()`` first (in the worker)."""
    real = VideoClipDataset._decode

    def decode(self, path):
        if path.endswith(name):
            action()
        return real(self, path)

    monkeypatch.setattr(VideoClipDataset, "_decode", decode)


@pytest.mark.timeout(120)
def test_crashed_worker_stops_the_loader(tiny_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that kills its process (a segfault in FFmpeg) fails the run promptly."""
    _misbehave_on(monkeypatch, "left_then_up_0002.mp4", lambda: os.kill(os.getpid(), signal.SIGSEGV))
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"):
        for _ in _loader(tiny_root):
            pass


@pytest.mark.timeout(120)
def test_stuck_decoder_times_out(tiny_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that never returns fails the run after data.worker_timeout seconds."""
    _misbehave_on(monkeypatch, "right_then_up_0001.mp4", lambda: time.sleep(600))
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="DataLoader timed out after 1 seconds"):
        for _ in _loader(tiny_root, worker_timeout=1):
            pass
    assert time.perf_counter() - t0 < 60


# ------------------------------------------------------------------- videos over the media budget
# Files a stranger can make that cost gigabytes or minutes when decoded naively
# (tests/data/hostile_media.py); the budgets are videotrain.untrusted.bounds' MAX_* constants.
OVER_BUDGET = ["frame_8192.mp4", "frame_6000.mp4", "declared_frames.mp4", "lying_header.mp4",
               "dense_window.mp4"]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hostile videos, written by a process of their own (this one caps FFmpeg's
    allocations once it has opened a video, which an 8192x8192 encoder would exceed)."""
    folder = tmp_path_factory.mktemp("hostile")
    script = Path(__file__).with_name("hostile_media.py")
    subprocess.run([sys.executable, str(script), str(folder)], check=True, timeout=120)
    return folder


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every frame converted to an array (``VideoFrame.to_ndarray``: RGB, in ``decode._rgb``)."""
    calls: list = []
    real = av.VideoFrame.to_ndarray

    def counting(self, *args, **kwargs):
        calls.append((self.width, self.height))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(av.VideoFrame, "to_ndarray", counting)
    return calls


@pytest.mark.parametrize("read", ["clips", "frames_at"])
@pytest.mark.parametrize("name", OVER_BUDGET)
def test_over_budget_video_is_refused_before_any_rgb(name: str, read: str, hostile: Path,
                                                     conversions: list) -> None:
    """Each read an evaluation makes (10 windows of 8 frames, or 10 segment clips) is refused
    with a ``VideoTooLarge`` saying which budget, and not one frame became RGB. The header's
    size and count are refused at open; a header that lies, at its first large frame; too many
    decoded frames in one window while they arrive; too many RGB frames before decoding."""
    start = time.perf_counter()
    with pytest.raises(VideoTooLarge, match="over the budget") as err:
        with VideoFile(str(hostile / name)) as video:
            if read == "clips":
                video.clips([(0.16 * k, 0.16 * k + 1.6) for k in range(10)], 8)
            else:
                video.frames_at([[k + 8 * c for k in range(8)] for c in range(10)])
    # a header that lies shows its small frames first, and those are read; never a large one
    assert all(w * h <= MAX_FRAME_PIXELS for w, h in conversions)
    assert conversions == [] or name == "lying_header.mp4"
    assert time.perf_counter() - start < 10
    assert str(hostile) not in str(err.value)  # numbers only: nothing of the file


def test_a_video_at_the_frame_budget_is_read(hostile: Path) -> None:
    """Two 4096x4096 frames (the frame budget exactly) decode: the budget refuses what is over
    it, not large frames as such."""
    with VideoFile(str(hostile / "frame_4096.mp4")) as video:
        (clip,) = video.clips([(0.0, 0.2)], 2)
        assert (video.width, video.height, video.frame_count()) == (4096, 4096, 2)
    assert clip.shape == (2, 4096, 4096, 3) and int(clip[0, 0, 0].sum()) > 0  # gray, decoded


def test_a_declared_frame_index_is_not_built(hostile: Path) -> None:
    """An MP4 header declaring fifty million frames: uncapped, FFmpeg builds their index in
    ``av.open`` (3.5 GB, 11 s). Every FFmpeg allocation is capped, so the file opens at once
    and its declared count is refused."""
    assert limit_ffmpeg_allocations("pyav") >= 1  # PyAV's own libavutil was found and capped
    start = time.perf_counter()
    with pytest.raises(VideoTooLarge, match="declares 50,000,000 frames"):
        VideoFile(str(hostile / "declared_frames.mp4"))
    assert time.perf_counter() - start < 2


def _raw_stream(path: Path, frames: int = 40) -> Path:
    with av.open(str(path), "w", format="h264") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 6, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _budget(monkeypatch: pytest.MonkeyPatch, name: str, value: int) -> None:
    """Lower one budget where the decoders read it (each module imported the constant)."""
    for module in (media_budget, decode):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


def test_frame_count_budget_without_a_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A raw stream declares no count and no duration: a pass that decodes more frames than
    the budget, and a packet count past it, are refused as they go (40 frames, budget 30)."""
    path = _raw_stream(tmp_path / "clip.h264")
    _budget(monkeypatch, "MAX_VIDEO_FRAMES", 30)
    with VideoFile(str(path)) as video:
        assert video.duration is None and video.stream.frames == 0
        with pytest.raises(VideoTooLarge, match="more than 30 frames decoded in one pass"):
            video.measure_duration()
        with pytest.raises(VideoTooLarge, match="packets hold more than 31 frames"):
            video.frame_count()
    _budget(monkeypatch, "MAX_VIDEO_FRAMES", 40)  # at the budget: read
    with VideoFile(str(path)) as video:
        assert video.frame_count() == 40 and video.measure_duration() == pytest.approx(40 / video.rate)


@pytest.mark.parametrize("suffix", ["mp4", "webm"])
def test_frame_count_budget_from_the_header(suffix: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An MP4 states its frame count; a WebM only its duration and rate, whose product counts."""
    path = tmp_path / f"clip.{suffix}"
    write_video(path, render_clip(SyntheticSpec(num_frames=40, size=32), 1,
                                  np.random.default_rng(0)), 10)
    _budget(monkeypatch, "MAX_VIDEO_FRAMES", 30)
    want = "header declares 40 frames" if suffix == "mp4" else "duration and frame rate make 40"
    with pytest.raises(VideoTooLarge, match=want):
        VideoFile(str(path))


def test_decoded_pixel_budget_per_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One read may decode ``MAX_DECODED_PIXELS``: a 2 s window of 32x32 frames at the 25 fps
    FFmpeg assumes for a raw stream decodes 40 frames; with room for 16, it is refused, and the
    next read (13 frames) starts anew."""
    path = _raw_stream(tmp_path / "clip.h264")
    _budget(monkeypatch, "MAX_DECODED_PIXELS", 16 * 32 * 32)
    with VideoFile(str(path)) as video:
        with pytest.raises(VideoTooLarge, match="decodes more than"):
            video.clips([(0.0, 2.0)], 4)
        assert video.clips([(0.0, 0.5)], 4)[0].shape == (4, 32, 32, 3)  # 6 frames: within


def test_over_budget_videos_are_skipped_in_training_and_not_evaluated(
    hostile: Path, tiny_copy: Path, run_overrides, compose_cfg, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Training shares the decoder: an over-budget training video is replaced (batches stay
    full) and counted; an over-budget validation video is not scored, nor another in its place
    (7 of the 8 listed are evaluated)."""
    bad = {"train/left_then_up/left_then_up_0001.mp4": "lying_header.mp4",
           "val/right_then_up/right_then_up_0000.mp4": "frame_8192.mp4"}
    for rel, name in bad.items():
        shutil.copy(hostile / name, tiny_copy / rel)
    with caplog.at_level(logging.WARNING):
        results = run.train(compose_cfg(run_overrides(root=tiny_copy, data__max_bad_fraction=0.13)),
                            tmp_path / "run")
    assert results["skipped_paths"] == sorted(str(tiny_copy / rel) for rel in bad)
    assert results["steps"] == 4 and (results["val_videos"], results["val_videos_listed"]) == (7, 8)
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert "VideoTooLarge" in warned and "over the budget" in warned


# A small real MP4 whose header fields the property test overwrites: 20 frames of 32x32.
FUZZ_SPEC = SyntheticSpec(num_frames=20, size=32)
HOSTILE_WORDS = [0, 1, 2, 0x7FFF, 0xFFFF, 8192 << 16, 50_000_000, 0x7FFFFFFF, 0xFFFFFFFF]


@pytest.fixture(scope="module")
def fuzz_mp4(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "clip.mp4"
    write_video(path, render_clip(FUZZ_SPEC, 0, np.random.default_rng(0)), 10)
    return path.read_bytes()


def _peak_rss_reset() -> int:
    """Reset this process's peak RSS (``/proc/self/clear_refs``) and return its RSS, in KB:
    ``VmHWM`` then tells what the next step peaked at."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS")


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), sampler=st.sampled_from(["random", "segment"]),
       cut=st.one_of(st.none(), st.integers(0, 4000)))
def test_any_header_reads_or_is_one_bad_video(data: st.DataObject, sampler: str, cut: int | None,
                                              fuzz_mp4: bytes, tmp_path_factory) -> None:
    """Hostile headers, generated: 32-bit fields of the MP4's ``moov`` box (sizes, counts,
    durations, time scales, the frame size, the codec's parameter sets) overwritten with
    extreme or random words, the file perhaps cut. predict's reader (the evaluation's views,
    either sampler) either returns the views or raises one ``UnreadableVideo`` naming the file
    and nothing of it; within 10 s and 500 MB over what the process held before."""
    moov = fuzz_mp4.find(b"moov") - 4
    edits = data.draw(st.lists(st.tuples(st.integers(moov, len(fuzz_mp4) - 4),
                                         st.one_of(st.sampled_from(HOSTILE_WORDS),
                                                   st.integers(0, 2**32 - 1))),
                               min_size=1, max_size=4))
    blob = bytearray(fuzz_mp4)
    for at, word in edits:
        blob[at:at + 4] = word.to_bytes(4, "big")
    path = tmp_path_factory.mktemp("fuzzed") / "video.mp4"
    path.write_bytes(bytes(blob[:cut] if cut is not None else blob))
    reader = ViewReader(num_frames=4, clip_duration=0.8, short_side=32, crop_size=32, clips=3,
                        crops=1, sampler=sampler)
    before = _peak_rss_reset()
    start = time.perf_counter()
    try:
        views = reader(path)
        assert views.shape == (3, 4, 3, 32, 32) and views.dtype == torch.uint8
    except UnreadableVideo as err:
        assert str(err).startswith(f"{path}: cannot ") and "\n" not in str(err)
    assert time.perf_counter() - start < 10
    assert (_status_kb("VmHWM") - before) / 1024 < 500


# ------------------------------------------------------------------- ordinary videos fit the budgets
# What evaluation and predict read of an ordinary 1080p or 4K video at the defaults (data.num_frames
# 8, data.sampling_rate 8 at 30 fps, short side 128, crop 112; eval.clips 10 x eval.crops 3): the
# frames are resized as they are decoded, so the read holds frames of the output's size.
READ_AT_THE_DEFAULTS = """
import json, sys
from pathlib import Path
from videotrain.engine.inference import ViewReader
def kb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
video, small, decoder, sampler = sys.argv[1:5]
reader = ViewReader(8, 8 * 8 / 30, 128, 112, 10, 3, decoder=decoder, sampler=sampler)
reader(Path(small))  # libraries loaded on a small video: the large one is read cold
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS: the peak of the read alone
before = kb("VmRSS")
views = reader(Path(video))
print(json.dumps({"shape": list(views.shape), "peak_mib": (kb("VmHWM") - before) / 1024}))
"""


@pytest.fixture(scope="module")
def ordinary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_videos(tmp_path_factory.mktemp("ordinary"),
                        {"small": (96, 64, 3.0), "1080p": (1920, 1080, 3.0)})


def _read_at_the_defaults(video: Path, small: Path, decoder: str, sampler: str) -> dict:
    """Predict's reader (the evaluation dataset's decoding and transform) at the defaults, in
    a process of its own: the views' shape and the read's peak RSS."""
    done = subprocess.run([sys.executable, "-c", READ_AT_THE_DEFAULTS, str(video), str(small),
                           decoder, sampler], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("decoder", ["pyav", "torchcodec"])
@pytest.mark.parametrize("sampler", ["random", "segment"])
def test_an_ordinary_1080p_video_is_read_at_the_defaults(sampler: str, decoder: str,
                                                         ordinary: dict[str, Path],
                                                         request: pytest.FixtureRequest) -> None:
    """3 s of 1080p at 30 fps, evaluated and predicted at the default clips: 30 views. Held at
    full size, its 80 RGB frames alone took 475 MiB, over the 320 MiB budget, and were
    refused; resized as they are decoded, the whole read peaks at a fraction of that (pyav:
    about 20 MiB, torchcodec about 120 MiB, its decoder's own frames included)."""
    if decoder == "torchcodec":
        request.getfixturevalue("torchcodec")
    read = _read_at_the_defaults(ordinary["1080p"], ordinary["small"], decoder, sampler)
    assert read["shape"] == [30, 8, 3, 112, 112]
    assert read["peak_mib"] < 200, read


@pytest.mark.slow  # writing 3 s of 4K takes about 10 s, reading it 3-5 s per case
@pytest.mark.parametrize("decoder", ["pyav", "torchcodec"])
@pytest.mark.parametrize("sampler", ["random", "segment"])
def test_an_ordinary_4k_video_is_read_at_the_defaults(sampler: str, decoder: str,
                                                      ordinary: dict[str, Path], tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    """3 s of 3840x2160 at 30 fps: its 2.1 s windows hold 64 decoded frames of 12 MiB each,
    which cannot wait to be chosen within the budget; the kept ones are chosen as they arrive
    (pyav) or fetched two at a time (torchcodec), and the read stays within the budget."""
    if decoder == "torchcodec":
        request.getfixturevalue("torchcodec")
    video = write_videos(tmp_path, {"4k": (3840, 2160, 3.0)})["4k"]
    read = _read_at_the_defaults(video, ordinary["small"], decoder, sampler)
    assert read["shape"] == [30, 8, 3, 112, 112]
    assert read["peak_mib"] < MAX_DECODED_BYTES / 2**20, read


# ------------------------------------------------------------------- a bad video's name in the log
EVIL_NAME = "evil\x1b[2J\x07\nerror: forged.mp4"  # would clear the screen and forge a line, raw


@pytest.mark.parametrize("decoder", ["pyav", "torchcodec"])
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("kind", ["text", "missing", "truncated"])
def test_a_bad_videos_warning_names_it_escaped(kind: str, train: bool, decoder: str,
                                               tiny_root: Path, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture,
                                               request: pytest.FixtureRequest) -> None:
    """A video's name comes from an annotation file or a folder someone else made: the
    warning shows it escaped, once, and gives the error's fixed text, not FFmpeg's message
    that quotes the name raw (``Invalid data found when processing input: '<name>'``; with
    torchcodec, ``Could not open input file: <name> ...``, the name replaced)."""
    if decoder == "torchcodec":
        request.getfixturevalue("torchcodec")
    path = tmp_path / EVIL_NAME
    if kind == "text":
        path.write_text("this is a text file with an .mp4 name\n")
    elif kind == "truncated":  # an MP4 cut in half
        data = (tiny_root / VICTIM).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    index = VideoIndex(LabeledVideoPaths([(str(path), 0)]), ["a"], "t")
    ds = VideoClipDataset(index, 4, 0.4, lambda clip: clip, train=train, max_retries=0,
                          decoder=decoder)
    with caplog.at_level(logging.WARNING, logger="videotrain.data.dataset"):
        if train:
            with pytest.raises(RuntimeError, match="1 videos in a row failed to decode") as err:
                ds[SampleKey(0, 0)]
            assert str(path) not in str(err.value) and repr(EVIL_NAME)[1:-1] in str(err.value)
        else:
            assert ds[SampleKey(0, 0)]["skipped"] == [str(path)]  # the path itself, for the lists
    (record,) = caplog.records
    line = record.getMessage()
    assert "\x1b" not in line and "\n" not in line and "\x07" not in line
    assert line.count(repr(EVIL_NAME)[1:-1]) == 1 and "error: forged" not in line.replace(
        repr(EVIL_NAME)[1:-1], "")  # the name once, escaped, and nowhere else
    if decoder == "torchcodec":
        return  # its own wording (checked above: the name escaped, once)
    if kind != "missing":  # a cut MP4 has lost its index (at the end): it does not open either
        assert line.endswith("cannot open (InvalidDataError: Invalid data found when processing input)")
    if kind == "missing":
        assert line.endswith("cannot open (FileNotFoundError: No such file or directory)")
