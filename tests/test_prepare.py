"""``python -m videotrain.prepare kinetics``: the official CSVs -> lists, classes and missing
videos; a short training run on the result; ``--resize`` (size, keyframes, resumability, and
nothing half-written when an encode fails)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from benchmarks.clips import clip_set, probe, write_clip  # Kinetics-like test clips
from videotrain.data.annotations import parse_label_csv
from videotrain.prepare import __main__ as cli
from videotrain.prepare import reencode
from videotrain.prepare.kinetics import prepare_kinetics, read_release_csv

# a miniature of the release: quoted labels with spaces, a comma and parentheses; 6 train
# rows over 3 labels (one video missing), 3 validation rows (one missing), 2 unlabeled test
LABELS = ("playing guitar", "riding, mountain bike", "passing American football (in game)")
TRAIN = [(LABELS[k % 3], f"tr{k}", 10 * k, 10 * k + 10) for k in range(6)]
VAL = [(LABELS[k], f"va{k}", 0, 10) for k in range(3)]
TEST = [(None, f"te{k}", 30, 40) for k in range(2)]
MISSING = {"tr5", "va2", "te1"}
# the downloaded videos: 2 s at 10 fps, 320x288 (short side 288), one keyframe
SOURCE = clip_set("kinetics", 1, seconds=2.0, width=320, height=288, fps=10, preset="veryfast")


def write_csv(path: Path, rows, split: str | None, header: bool = True) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        if any(label is not None for label, *_ in rows):
            w.writerow(["label", "youtube_id", "time_start", "time_end", "split"])
            w.writerows([label, vid, s, e, split] for label, vid, s, e in rows)
        else:  # test CSVs may come without a label column
            w.writerow(["youtube_id", "time_start", "time_end", "split"])
            w.writerows([vid, s, e, split] for _, vid, s, e in rows)
    return path


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """CSVs and a video folder laid out as downloaders leave it: per-label sub-folders (with
    spaces in their names) for train, flat for val and test, one .mkv."""
    base = tmp_path_factory.mktemp("kinetics_release")
    videos = base / "videos"
    rows = [("train", r) for r in TRAIN] + [("val", r) for r in VAL] + [("test", r) for r in TEST]
    for i, (split, (label, vid, s, e)) in enumerate(rows):
        if vid in MISSING:
            continue
        folder = videos / split / label if split == "train" else videos / split
        folder.mkdir(parents=True, exist_ok=True)
        ext = ".mkv" if vid == "va1" else ".mp4"
        write_clip(folder / f"{vid}_{s:06d}_{e:06d}{ext}", SOURCE, i)
    csvs = [write_csv(base / "train.csv", TRAIN, "train"),
            write_csv(base / "validate.csv", VAL, "validate"),
            write_csv(base / "test.csv", TEST, "test")]
    return {"csvs": [str(c) for c in csvs], "videos": videos}


def test_release_csv_reader(release) -> None:
    rows = read_release_csv(release["csvs"][0])
    assert [r.label for r in rows[:3]] == list(LABELS) and rows[0].stem == "tr0_000000_000010"
    val = read_release_csv(release["csvs"][1])
    assert {r.split for r in val} == {"val"}
    test = read_release_csv(release["csvs"][2])
    assert test[0].label is None and test[0].split == "test"


def test_prepare_lists_classes_and_missing(release, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code = cli.main(["kinetics", *(a for c in release["csvs"] for a in ("--csv", c)),
                     "--videos", str(release["videos"]), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "train: 6 listed, 5 in the lists (83.3%), 1 missing" in printed
    assert "val: 3 listed, 2 in the lists" in printed and "test: 2 listed, 1 in the lists" in printed
    names = (out / "classes.txt").read_text().splitlines()
    assert names == sorted(LABELS)
    train = parse_label_csv(out / "train.csv")  # as the reader parses it
    assert len(train) == 5 and all(Path(p).is_absolute() and Path(p).is_file() for p, _ in train)
    assert any("," in p for p, _ in train)  # the label folder "riding, mountain bike"
    for path, label in train:  # the label index of the row's class
        vid = Path(path).name.split("_")[0]
        assert names[label] == next(lab for lab, v, *_ in TRAIN if v == vid)
    assert any(p.endswith(".mkv") for p in (out / "val.csv").read_text().split())
    missing = {s: list(csv.DictReader((out / f"missing_{s}.csv").open())) for s in ("train", "val", "test")}
    assert [r["youtube_id"] for r in missing["train"]] == ["tr5"]
    assert missing["train"][0]["label"] == LABELS[2]  # the release's own columns, kept
    assert [r["youtube_id"] for r in missing["val"]] == ["va2"]
    assert not (out / "test.csv").exists() and len((out / "test_videos.txt").read_text().split()) == 1

    # the project's reader takes it: data=kinetics data.root=OUT
    from videotrain.data.annotations import kinetics_index

    index = kinetics_index(out, "train")
    assert len(index) == 5 and index.class_names == sorted(LABELS)


def test_prepared_kinetics_trains(release, tmp_path: Path, run_overrides, compose_cfg) -> None:
    import videotrain.run as run

    out = tmp_path / "out"
    prepare_kinetics(release["csvs"][:2], release["videos"], out, log=lambda m: None)
    results = run.train(compose_cfg(run_overrides(root=out)), tmp_path / "run")
    assert results["steps"] == 1 and results["skipped_videos"] == 0
    assert results["class_names"] == sorted(LABELS) and 0.0 <= results["val_top1"] <= 1.0


def test_resize_reencodes_resumably(release, tmp_path: Path) -> None:
    out = tmp_path / "out"
    logs: list[str] = []
    prepare_kinetics(release["csvs"][:2], release["videos"], out, resize=256, workers=2,
                     log=logs.append)
    files = sorted((out / "videos_256").rglob("*.mp4"))
    assert len(files) == 7 and {f.parent.name for f in files} == {"train", "val"}
    p = probe(files[0])
    # short side 288 -> 256 (width 320 * 256 / 288 = 284.4 -> 284), keyframe every 1 s
    assert (p["codec"], p["width"], p["height"], p["fps"]) == ("h264", 284, 256, 10.0)
    assert p["keyframes"] == [0, 10] and p["frames"] == 20 and p["audio_streams"] == 0
    lines = (out / "train.csv").read_text().splitlines()
    assert all(ln.startswith("videos_256/train/") for ln in lines)  # relative to OUT
    assert not list(out.rglob(".*part*"))

    # a second run skips the finished files
    mtimes = {f: f.stat().st_mtime_ns for f in files}
    logs.clear()
    prepare_kinetics(release["csvs"][:2], release["videos"], out, resize=256, workers=2,
                     log=logs.append)
    assert "0 done now, 7 already there (resumed), 0 failed" in "\n".join(logs)
    assert {f: f.stat().st_mtime_ns for f in files} == mtimes


def test_failed_encode_leaves_nothing(release, tmp_path: Path, monkeypatch) -> None:
    videos = tmp_path / "videos"
    shutil.copytree(release["videos"] / "val", videos)
    corrupt = videos / "va0_000000_000010.mp4"
    corrupt.write_bytes(corrupt.read_bytes()[:4000])  # truncated: header and a few packets
    out = tmp_path / "out"
    logs: list[str] = []
    (val,) = prepare_kinetics([release["csvs"][1]], videos, out, resize=256, log=logs.append)
    assert any("failed to re-encode" in m and corrupt.name in m for m in logs)
    assert (val.found, val.missing, val.failed) == (1, 1, 1)
    assert not (out / "videos_256" / "val" / corrupt.name).exists()
    assert not list(out.rglob(".*part*"))
    assert {r["youtube_id"] for r in csv.DictReader((out / "missing_val.csv").open())} == {"va0", "va2"}

    # an encoder that dies mid-file (frames already written to the partial file)
    calls = {"n": 0}
    real = reencode.VideoReformatter

    class Dying:  # PyAV's VideoReformatter, failing at the 6th frame
        def __init__(self) -> None:
            self.real = real()

        def reformat(self, frame, **kw):
            calls["n"] += 1
            if calls["n"] > 5:
                raise RuntimeError("disk on fire")
            return self.real.reformat(frame, **kw)

    monkeypatch.setattr(reencode, "VideoReformatter", Dying)
    src = release["videos"] / "val" / "va1_000000_000010.mkv"
    dst = tmp_path / "one" / "va1.mp4"
    (res,) = reencode.encode_all([(str(src), str(dst))], reencode.EncodeSettings(256))
    assert res.status == "failed" and "disk on fire" in res.error and calls["n"] == 6
    assert not dst.exists() and list(dst.parent.iterdir()) == []


def test_prepare_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``videotrain.prepare``: a CSV that is a folder (or unreadable) is
    one `error:` line naming it, exit status 2, not a traceback."""
    (tmp_path / "videos").mkdir()
    (tmp_path / "train.csv").mkdir()  # e.g. an archive extracted into a folder of that name
    code = cli.main(["kinetics", "--csv", str(tmp_path / "train.csv"), "--videos",
                     str(tmp_path / "videos"), "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(tmp_path / "train.csv") in err[0]
