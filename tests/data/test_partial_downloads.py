"""Real downloads are partial: classes whose videos are all missing, val videos that
cannot be read, and hundreds of thousands of missing files. The lists are the datasets' own
formats (UCF101's CRLF ``ucfTrainTestlist``, HMDB51's ``*_test_splitN.txt`` with trailing
spaces, Kinetics-style CSVs), written by the layout writers; the videos are then broken the
way a repack or a half-extracted archive breaks them."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

import videotrain.run as run
from videotrain.config.build import clean_errors
from videotrain.data.annotations import AnnotationError
from videotrain.data.loaders import read_index
from videotrain.data.preflight import BadDataError, preflight

# the class of the tiny dataset that loses its videos, as each layout names it
VICTIM = {"ucf101": "LeftThenUp", "hmdb51": "left_then_up"}
VICTIM_LABEL = {"ucf101": 3, "hmdb51": 1}  # classInd.txt's order; HMDB51's sorted names
LIST_FILE = {"ucf101": "trainlist01.txt", "hmdb51": "_test_split1.txt"}


def _overrides(run_overrides, layout: str, root: Path, **extra: object) -> list[str]:
    ov = [o for o in run_overrides(root=root, **extra) if o != "data=kinetics"]
    return [f"data={layout}", *ov]


def _break_class(layout: str, root: Path) -> None:
    """UCF101: a repack that names the files ``v_LeftthenUp_*`` where the lists say
    ``v_LeftThenUp_*`` (the real case: HandstandPushups / HandStandPushups). HMDB51: the
    class's archive was never extracted (no folder)."""
    if layout == "ucf101":
        folder = root / "UCF-101" / VICTIM[layout]
        for video in folder.iterdir():
            video.rename(folder / video.name.replace("LeftThenUp", "LeftthenUp"))
    else:
        shutil.rmtree(root / "hmdb51_org" / VICTIM[layout])


@pytest.mark.parametrize("layout", ["ucf101", "hmdb51"])
def test_a_class_without_readable_videos_is_an_error_unless_dropped(
        layout: str, layout_root, run_overrides, compose_cfg, tmp_path: Path) -> None:
    root = tmp_path / layout
    shutil.copytree(layout_root(layout), root)
    _break_class(layout, root)
    # 4 of 16 training videos missing: under the bad-video limit, which must not hide the class
    cfg = compose_cfg(_overrides(run_overrides, layout, root, data__max_bad_fraction=0.3))
    with pytest.raises(AnnotationError) as err:
        run.train(cfg, tmp_path / "run")
    msg = str(err.value)
    assert LIST_FILE[layout] in msg.split(":")[0], msg  # the list file comes first
    # by label: the class's name (read from the dataset's files) is never echoed in an error
    assert re.search(rf"1 class\(es\) have no readable training videos: label {VICTIM_LABEL[layout]} "
                     r"\(4 listed, all missing or empty\)", msg), msg
    assert f"data.drop_classes=[{VICTIM_LABEL[layout]}]" in msg and "results.json" in msg
    assert VICTIM[layout] not in msg.replace(str(tmp_path), "")
    assert (tmp_path / "run" / "missing_videos_train.txt").read_text().count("\n") == 4

    # the explicit option, as the error gives it (by label): trained and scored without the
    # class, and results.json says so
    cfg = compose_cfg(_overrides(run_overrides, layout, root, data__max_bad_fraction=0.3,
                                 data__drop_classes=f"[{VICTIM_LABEL[layout]}]"))
    results = run.train(cfg, tmp_path / "dropped")
    saved = json.loads((tmp_path / "dropped" / "results.json").read_text())
    assert saved["dropped_classes"] == results["dropped_classes"] == [VICTIM[layout]]
    assert saved["num_classes"] == 4  # the label numbering stays
    assert saved["val_videos"] == saved["val_videos_listed"] == 6  # 3 classes x 2 test videos


def test_unknown_class_to_drop_names_the_key(tiny_copy: Path, run_overrides, compose_cfg,
                                              tmp_path: Path) -> None:
    cfg = compose_cfg(run_overrides(root=tiny_copy, data__drop_classes="[LeftThenUp]"))
    with pytest.raises(ValueError, match=r"data.drop_classes: 'LeftThenUp' is neither a class of "
                                         r".*train\.csv nor a label number of its 4 classes "
                                         r"\(0 to 3\)$"):
        run.train(cfg, tmp_path)


def test_a_class_with_no_readable_val_video_is_an_error(tiny_copy: Path, run_overrides,
                                                          compose_cfg, tmp_path: Path) -> None:
    for video in (tiny_copy / "val" / "left_then_up").glob("*.mp4"):
        video.unlink()  # 2 of 8 val videos, both of one class
    cfg = compose_cfg(run_overrides(root=tiny_copy, data__max_bad_fraction=0.3))
    with pytest.raises(AnnotationError) as err:
        run.train(cfg, tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"{tiny_copy / 'val.csv'}: 1 class(es) have no readable videos in this "
                          "evaluated split: label 3 (2 listed, all missing or empty)")
    assert "data.drop_classes=[3]" in msg and "left_then_up" not in msg


def test_validation_and_test_score_only_the_videos_that_are_there(
        tiny_copy: Path, run_overrides, compose_cfg, tmp_path: Path) -> None:
    """One val video missing (found by the preflight), one unreadable (found when decoded):
    neither is replaced by another video; 6 of the 8 listed are scored, and both the
    validation and the multi-view test say so."""
    (tiny_copy / "val/right_then_up/right_then_up_0001.mp4").unlink()
    (tiny_copy / "val/left_then_down/left_then_down_0000.mp4").write_text("not a video\n")
    cfg = compose_cfg(run_overrides(root=tiny_copy, data__max_bad_fraction=0.3,
                                    trainer__test_after_fit=True, eval__clips=1, eval__crops=1))
    results = run.train(cfg, tmp_path)
    assert results["val_videos"] == 6 and results["val_videos_listed"] == 8
    assert results["test"]["videos"] == 6 and results["test"]["videos_listed"] == 8
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["videos"] == 6 and report["videos_listed"] == 8 and report["dropped_classes"] == []
    assert sorted(results["skipped_paths"]) == sorted(
        str(tiny_copy / p) for p in ("val/right_then_up/right_then_up_0001.mp4",
                                     "val/left_then_down/left_then_down_0000.mp4"))


def _kinetics_split(root: Path, listed: int, present: int) -> None:
    """A ``path label`` list of ``listed`` Kinetics-named videos, the first ``present`` there."""
    (root / "videos").mkdir(parents=True)
    lines = []
    for i in range(listed):
        name = f"id{i:08d}_{i % 300:06d}_{i % 300 + 10:06d}.mp4"
        lines.append(f"{name} {i % 400}")
        if i < present:
            (root / "videos" / name).write_bytes(b"not empty")
    (root / "train.csv").write_text("\n".join(lines) + "\n")


def test_missing_videos_are_one_warning_and_a_list_in_the_run_folder(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """9,000 missing files give one warning (a count, the first few, where
    the list is), not 9,000; the run folder holds the full list."""
    root = tmp_path / "k"
    _kinetics_split(root, 10_000, 1_000)
    index = read_index("kinetics", root, "train", None, {"path_prefix": "videos"})
    with caplog.at_level(logging.WARNING, logger="videotrain.data.preflight"):
        bad = preflight(index, 0.95, cache_dir=tmp_path / "cache", split="train",
                        report_dir=tmp_path / "run")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings[:3]
    listing = tmp_path / "run" / "missing_videos_train.txt"
    assert "9000 of 10000 listed videos are missing or empty" in warnings[0]
    assert f"all 9000 are listed in {listing}" in warnings[0] and ", ..." in warnings[0]
    assert listing.read_text().splitlines() == bad and len(bad) == 9000

    with pytest.raises(BadDataError, match=rf"9000 of 10000 videos are unreadable .* they are "
                                           rf"listed in {listing}"):
        preflight(index, 0.1, cache_dir=tmp_path / "cache", split="train", report_dir=tmp_path / "run")


def test_too_many_missing_videos_are_one_error_line(tiny_copy: Path, run_overrides, compose_cfg,
                                                     tmp_path: Path, capsys) -> None:
    """In-process, a BadDataError is one `error:` line and exit status 2."""
    for video in sorted((tiny_copy / "train").rglob("*.mp4"))[:6]:
        video.unlink()
    with pytest.raises(SystemExit) as done, clean_errors():
        run.train(compose_cfg(run_overrides(root=tiny_copy)), tmp_path / "run")
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: BadDataError: {tiny_copy / 'train.csv'}: "
                                               "6 of 16 videos are unreadable"), err
    assert str(tmp_path / "run" / "missing_videos_train.txt") in err[0]
