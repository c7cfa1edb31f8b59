"""Broken inputs: bad videos are skipped (warned about, counted, replaced so batches stay full)
until there are too many; broken annotation files and labels fail with file and line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import videotrain.run as run
from videotrain.data.annotations import AnnotationError
from videotrain.data.loaders import BadDataError
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
    assert any("skipping bad video" in w and rel in w for w in warnings), warnings
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
