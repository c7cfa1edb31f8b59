"""Broken inputs: bad videos are skipped (warned about, counted, replaced so batches stay full)
until there are too many; broken annotation files and labels fail with file and line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

import videotrain.run as run
from videotrain.data.annotations import AnnotationError
from videotrain.data.dataset import VideoClipDataset
from videotrain.data.layouts import generate
from videotrain.data.loaders import BadDataError, build_data
from videotrain.data.synthetic import SyntheticSpec
from videotrain.engine.trainer import Trainer

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
