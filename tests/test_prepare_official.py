"""``python -m videotrain.prepare kinetics`` on release CSVs and downloads as people have them:
re-saved by Excel (BOM, CRLF), an unquoted comma, K700's ids with two segments and a bare-id
file, 0-byte downloads, the CVDF replacement files, and a split mostly missing.

The videos are placeholder files: listing reads names and sizes only, never the contents."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from videotrain.prepare import __main__ as cli
from videotrain.prepare.kinetics import KineticsCsvError, prepare_kinetics, read_release_csv

HEADER = ["label", "youtube_id", "time_start", "time_end", "split", "is_cc"]
BOM = b"\xef\xbb\xbf"


def release_csv(path: Path, rows: list[list], header: list[str] = HEADER, bom: bool = False) -> Path:
    """The CVDF format: quoted labels where needed, CRLF (csv's default), optionally the BOM
    of Excel's 'CSV UTF-8'."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((BOM if bom else b"") + buf.getvalue().encode())
    return path


def video(path: Path, data: bytes = b"placeholder video bytes") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def listed(out: Path, split: str) -> list[tuple[str, int]]:
    lines = (out / f"{split}.csv").read_text().splitlines()
    return [(p, int(k)) for p, k in (ln.rsplit(maxsplit=1) for ln in lines)]


ROWS = [["air drumming", "--6bJUbfpnQ", 17, 27, "train", 0],
        ["passing American football (in game)", "-0WZKVI2bRI", 0, 10, "train", 0],
        ["massaging person's head", "-1n4o_ibP_Y", 30, 40, "train", 1]]


def test_an_excel_resaved_csv_keeps_its_labels(tmp_path: Path) -> None:
    """BOM + CRLF + quoted labels: 3 classes, a labelled train.csv (not '0 classes')."""
    csv_path = release_csv(tmp_path / "train.csv", ROWS, bom=True)
    assert [r.label for r in read_release_csv(csv_path)] == [r[0] for r in ROWS]
    for _, vid, s, e, _, _ in ROWS:
        video(tmp_path / "videos" / "train" / f"{vid}_{s:06d}_{e:06d}.mp4")
    out = tmp_path / "out"
    assert cli.main(["kinetics", "--csv", str(csv_path), "--videos", str(tmp_path / "videos"),
                     "--out", str(out)]) == 0
    assert (out / "classes.txt").read_text().splitlines() == sorted(r[0] for r in ROWS)
    assert sorted(k for _, k in listed(out, "train")) == [0, 1, 2]
    assert not (out / "train_videos.txt").exists()


def test_a_train_or_val_split_without_labels_is_an_error(tmp_path: Path) -> None:
    rows = [r[1:] for r in ROWS]
    path = release_csv(tmp_path / "train.csv", rows, header=HEADER[1:])
    with pytest.raises(KineticsCsvError, match=f"{path}: the train split has no label column"):
        read_release_csv(path)
    test = release_csv(tmp_path / "test.csv", [[*r[:3], "test", 0] for r in rows], header=HEADER[1:])
    assert {r.label for r in read_release_csv(test)} == {None}  # the test split may have none
    empty = release_csv(tmp_path / "validate.csv", [["", "abc", 0, 10, "validate", 0]])
    with pytest.raises(KineticsCsvError, match=f"{empty}:2: a val row without a label"):
        read_release_csv(empty)


def test_an_unquoted_comma_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_bytes(b"label,youtube_id,time_start,time_end,split,is_cc\r\n"
                     b"\"air drumming\",--6bJUbfpnQ,17,27,train,0\r\n"
                     b"riding, mountain bike,-0WZKVI2bRI,0,10,train,0\r\n")
    with pytest.raises(KineticsCsvError, match=f"{path}:3: 7 fields, expected 6"):
        read_release_csv(path)
    path.write_bytes(b"label,youtube_id,time_start,time_end,split,is_cc\r\n\"air drumming\",--6bJUbfpnQ,17\r\n")
    with pytest.raises(KineticsCsvError, match=f"{path}:2: 3 fields, expected 6"):
        read_release_csv(path)


def test_a_bare_id_file_is_used_only_for_an_id_with_one_row(tmp_path: Path) -> None:
    """K700's validate.csv lists 6sYu45RK454 twice (two segments, two labels): its bare
    ``6sYu45RK454.mp4`` cannot tell which segment it is, so neither row takes it."""
    rows = [["playing piano", "6sYu45RK454", 22, 32, "validate", 0],
            ["playing keyboard", "6sYu45RK454", 45, 55, "validate", 0],
            ["playing piano", "0a1b2c3d4e5", 5, 15, "validate", 0]]
    csv_path = release_csv(tmp_path / "validate.csv", rows)
    videos = tmp_path / "videos"
    video(videos / "6sYu45RK454.mp4")
    video(videos / "0a1b2c3d4e5.mp4")
    logs: list[str] = []
    (val,) = prepare_kinetics([csv_path], videos, tmp_path / "out", log=logs.append)
    assert listed(tmp_path / "out", "val") == [(str((videos / "0a1b2c3d4e5.mp4").absolute()), 1)]
    assert (val.found, val.missing) == (1, 2)
    assert any(m.startswith("1 row(s) matched a file named by the bare YouTube id") for m in logs)
    missing = list(csv.DictReader(open(tmp_path / "out" / "missing_val.csv")))
    assert [(m["youtube_id"], m["time_start"]) for m in missing] == [("6sYu45RK454", "22"),
                                                                       ("6sYu45RK454", "45")]


def test_an_empty_download_counts_as_missing(tmp_path: Path) -> None:
    csv_path = release_csv(tmp_path / "train.csv", ROWS[:2])
    videos = tmp_path / "videos"
    video(videos / "--6bJUbfpnQ_000017_000027.mp4", b"")  # an interrupted download
    video(videos / "-0WZKVI2bRI_000000_000010.mp4")
    logs: list[str] = []
    (train,) = prepare_kinetics([csv_path], videos, tmp_path / "out", log=logs.append)
    assert (train.found, train.missing) == (1, 1)
    assert [p for p, _ in listed(tmp_path / "out", "train")] == [
        str((videos / "-0WZKVI2bRI_000000_000010.mp4").absolute())]
    assert any("1 empty (0-byte) video file(s) ignored" in m for m in logs)
    missing = list(csv.DictReader(open(tmp_path / "out" / "missing_train.csv")))
    assert [m["youtube_id"] for m in missing] == ["--6bJUbfpnQ"]


@pytest.mark.parametrize("replacement", ["replacement/replacement_for_corrupted_k400",  # CVDF
                                         "val/replacement_for_corrupted_k400"])  # sorts after val/
def test_the_cvdf_replacement_wins_by_rule(tmp_path: Path, replacement: str) -> None:
    rows = [["abseiling", "3caPS4FHFF8", 36, 46, "val", 0]]
    csv_path = release_csv(tmp_path / "validate.csv", rows)
    videos = tmp_path / "k400"
    name = "3caPS4FHFF8_000036_000046.mp4"
    video(videos / "val" / name, b"the corrupted original")
    fixed = video(videos / replacement / name, b"the re-download")
    prepare_kinetics([csv_path], videos, tmp_path / "out", log=lambda m: None)
    assert listed(tmp_path / "out", "val") == [(str(fixed.absolute()), 0)]


def test_finding_few_videos_is_a_warning(tmp_path: Path, capsys) -> None:
    rows = [["abseiling", f"id{k:09d}", 0, 10, "validate", 0] for k in range(20)]
    csv_path = release_csv(tmp_path / "validate.csv", rows)
    videos = tmp_path / "videos"
    video(videos / "id000000007_000000_000010.mp4")
    code = cli.main(["kinetics", "--csv", str(csv_path), "--videos", str(videos),
                     "--out", str(tmp_path / "out")])
    assert code == 0  # the list is valid; the user is told loudly
    err = capsys.readouterr().err
    assert (f"warning: val: only 1 of the 20 listed videos (5.0%) were found; the other 19 are "
            f"in {tmp_path / 'out' / 'missing_val.csv'}") in err
    assert str(videos) in err


@pytest.mark.parametrize("body", ["machine host login me password SECRET-1\n",
                                  "label,youtube_id,time_start,time_end,split\n"
                                  "abseiling,aaaaaaaaaaa,SECRET-1,10,train\n",
                                  "label,youtube_id,time_start,time_end,split\n"
                                  "abseiling,aaaaaaaaaaa,0,10,SECRET-1\n",
                                  "label,youtube_id,time_start,time_end,split\n"
                                  "SECRET-1,aaaaaaaaaaa,0,10\n"])
def test_a_csv_error_shows_no_text_of_the_file(body: str, tmp_path: Path) -> None:
    """The header, a time, a split, a row: the error names the file, the line and what was
    expected, never the text (the CSV may be a link to a secret)."""
    path = tmp_path / "train.csv"
    path.write_text(body)
    with pytest.raises(KineticsCsvError, match=f"{path}:[12]: ") as err:
        read_release_csv(path)
    assert "SECRET" not in str(err.value)
