"""Every reader on annotation files as people have them: re-saved by Excel (a UTF-8
BOM, CRLF), in the official formats (quoted Kinetics release header, UCF101's 1-based CRLF
lists, HMDB51's trailing spaces, SSv2's one-entry-per-line JSON), cut short by a download, or
given where another format is read; HMDB51's class order; an empty HMDB51 split file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from videotrain.data.annotations import AnnotationError, kinetics_index, read_class_names
from videotrain.data.split_files import hmdb51_index, ucf101_index
from videotrain.data.ssv2 import ssv2_index

BOM = b"\xef\xbb\xbf"  # what Excel writes in front of a CSV it saves as "CSV UTF-8"


def write(path: Path, lines: list[str], bom: bool = False, end: str = "\r\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((BOM if bom else b"") + "".join(f"{ln}{end}" for ln in lines).encode())
    return path


# ---------------------------------------------------------------- Kinetics-style lists


def kinetics_root(tmp_path: Path, bom: bool) -> Path:
    root = tmp_path / "k"
    (root / "videos").mkdir(parents=True)
    write(root / "classes.txt", ["abseiling", "air drumming"], bom)
    for split in ("train", "val"):
        write(root / f"{split}.csv", ["abseiling/a1.mp4 0", "air drumming/b1.mp4,1"], bom)
    return root


@pytest.mark.parametrize("bom", [False, True])
def test_kinetics_lists_with_a_bom(tmp_path: Path, bom: bool) -> None:
    index = kinetics_index(kinetics_root(tmp_path, bom), "train", path_prefix="videos")
    assert index.class_names == ["abseiling", "air drumming"]
    assert [Path(p).relative_to(tmp_path / "k" / "videos").as_posix() for p, _ in index.paths] == [
        "abseiling/a1.mp4", "air drumming/b1.mp4"]


def test_class_json_with_a_bom(tmp_path: Path) -> None:
    path = tmp_path / "classes.json"
    path.write_bytes(BOM + json.dumps({"abseiling": 0, "air drumming": 1}, indent=1).encode())
    assert read_class_names(path) == ["abseiling", "air drumming"]


def test_a_release_csv_given_to_data_kinetics_points_to_prepare(tmp_path: Path) -> None:
    """The CVDF release's own train.csv where a ``path label`` list belongs."""
    root = tmp_path / "k400"
    write(root / "train.csv", ["label,youtube_id,time_start,time_end,split,is_cc",
                               '"air drumming",--6bJUbfpnQ,17,27,train,0'], end="\n")
    with pytest.raises(AnnotationError) as err:
        kinetics_index(root, "train")
    text = str(err.value)
    assert f"{root / 'train.csv'}:1:" in text and "official Kinetics release CSV" in text
    assert "python -m videotrain.prepare kinetics" in text and "is_cc" not in text.split(";")[-1]


def test_wide_and_stray_boms_are_named(tmp_path: Path) -> None:
    root = kinetics_root(tmp_path, bom=False)
    (root / "train.csv").write_bytes("abseiling/a1.mp4 0\r\n".encode("utf-16"))  # Excel "Unicode Text"
    with pytest.raises(AnnotationError, match=r"train.csv: starts with a UTF-16 byte-order mark \(BOM\)"):
        kinetics_index(root, "train", path_prefix="videos")
    # two re-saved files concatenated: the second BOM starts line 2
    (root / "train.csv").write_bytes(BOM + b"abseiling/a1.mp4 0\r\n" + BOM + b"air drumming/b1.mp4 1\r\n")
    with pytest.raises(AnnotationError, match=r"train.csv:2: a byte-order mark \(BOM, U\+FEFF\) inside"):
        kinetics_index(root, "train", path_prefix="videos")
    (root / "train.csv").write_bytes("caf\xe9/a1.mp4 0\r\n".encode("latin-1"))
    with pytest.raises(AnnotationError, match=r"train.csv:1: byte 0xe9 is not UTF-8"):
        kinetics_index(root, "train", path_prefix="videos")


# ---------------------------------------------------------------- UCF101


@pytest.mark.parametrize("bom", [False, True])
def test_ucf101_lists_with_a_bom(tmp_path: Path, bom: bool) -> None:
    root = tmp_path / "ucf"
    (root / "UCF-101").mkdir(parents=True)
    lists = root / "ucfTrainTestlist"
    write(lists / "classInd.txt", ["1 ApplyEyeMakeup", "2 HandstandPushups"], bom)
    write(lists / "trainlist01.txt", ["ApplyEyeMakeup/v_ApplyEyeMakeup_g08_c01.avi 1",
                                      "HandstandPushups/v_HandStandPushups_g08_c01.avi 2"], bom)
    write(lists / "testlist01.txt", ["ApplyEyeMakeup/v_ApplyEyeMakeup_g01_c01.avi",
                                     "HandstandPushups/v_HandStandPushups_g01_c01.avi"], bom)
    for split in ("train", "val"):
        index = ucf101_index(root, split)
        assert index.class_names == ["ApplyEyeMakeup", "HandstandPushups"]
        assert index.labels == [0, 1]
        assert Path(index.paths[0][0]).parent == root / "UCF-101" / "ApplyEyeMakeup"


# ---------------------------------------------------------------- HMDB51


def hmdb_root(tmp_path: Path, classes: dict[str, list[str]], bom: bool = False) -> Path:
    """``testTrainMulti_7030_splits/<class>_test_split1.txt`` with the official ``name.avi 1 ``
    lines (trailing space, CRLF as the files of the rar come)."""
    root = tmp_path / "hmdb"
    (root / "hmdb51_org").mkdir(parents=True)
    for name, videos in classes.items():
        write(root / "testTrainMulti_7030_splits" / f"{name}_test_split1.txt",
              [f"{v} {1 if i % 2 == 0 else 2} " for i, v in enumerate(videos)], bom)
    return root


# the three pairs where a class name is a prefix of another: '_' sorts before letters
PAIRS = {"climb": ["Climbing_a_rope_climb_f_cm_np1_ba_med_0.avi", "x_climb_2.avi"],
         "climb_stairs": ["Stairs!_[up]_climb_stairs_u_nm_np1_fr_med_0.avi", "y_2.avi"],
         "kick": ["kick_(me)_&_you_kick_f_cm_np1_le_med_1.avi", "k_2.avi"],
         "kick_ball": ["Ball_kick_ball_f_cm_np1_ri_bad_0.avi", "kb_2.avi"],
         "sword": ["sword_sword_f_cm_np1_ri_med_0.avi", "s_2.avi"],
         "sword_exercise": ["Sword_Exercise_sword_exercise_f_nm_np1_ri_med_3.avi", "se_2.avi"]}


def test_hmdb51_classes_are_sorted_by_class_name(tmp_path: Path) -> None:
    """As torchvision and MMAction2 number them, and as the docstring always promised."""
    index = hmdb51_index(hmdb_root(tmp_path, PAIRS), "train")
    assert index.class_names == sorted(PAIRS)
    assert index.class_names[:2] == ["climb", "climb_stairs"]
    for path, info in index.paths:
        assert index.class_names[info["label"]] == Path(path).parent.name
    # the order before: by split-file name, which put climb_stairs before climb
    from videotrain.data.split_files import hmdb51_legacy_order

    assert hmdb51_legacy_order(index.class_names)[:2] == ["climb_stairs", "climb"]


def test_hmdb51_split_files_with_a_bom_and_special_names(tmp_path: Path) -> None:
    index = hmdb51_index(hmdb_root(tmp_path, PAIRS, bom=True), "train")
    first = Path(index.paths[0][0])
    assert first.name == "Climbing_a_rope_climb_f_cm_np1_ba_med_0.avi"
    assert "Stairs!_[up]_climb_stairs_u_nm_np1_fr_med_0.avi" in {Path(p).name for p, _ in index.paths}


def test_an_empty_hmdb51_split_file_is_an_error(tmp_path: Path) -> None:
    """A half-extracted archive: the class would exist with no videos."""
    root = hmdb_root(tmp_path, PAIRS)
    empty = root / "testTrainMulti_7030_splits" / "kick_ball_test_split1.txt"
    empty.write_bytes(b"")
    for split in ("train", "val"):
        with pytest.raises(AnnotationError, match=f"{empty}: empty split file: its class would have no videos"):
            hmdb51_index(root, split)


# ---------------------------------------------------------------- Something-Something v2

ENTRIES = [{"id": "78687", "label": "holding potato next to vicks vaporub bottle",
            "template": "Holding [something] next to [something]", "placeholders": ["potato", "vicks"]},
           {"id": "42326", "label": "spreading margarine onto bread",
            "template": "Spreading [something] onto [something]", "placeholders": ["margarine", "bread"]}]
LABELS = {"Holding something next to something": "0", "Spreading something onto something": "1"}


def entries_text(entries: list[dict]) -> str:
    """The official layout: one entry a line, CRLF."""
    return "[\r\n" + ",\r\n".join(json.dumps(e) for e in entries) + "\r\n]"


def ssv2_root(tmp_path: Path, bom: bool = False) -> Path:
    root = tmp_path / "ssv2"
    (root / "20bn-something-something-v2").mkdir(parents=True)
    labels = root / "labels"
    labels.mkdir()
    mark = BOM if bom else b""
    (labels / "labels.json").write_bytes(mark + json.dumps(LABELS, indent=1).encode())
    (labels / "train.json").write_bytes(mark + entries_text(ENTRIES).encode())
    (labels / "validation.json").write_bytes(mark + entries_text(ENTRIES[::-1]).encode())
    return root


@pytest.mark.parametrize("bom", [False, True])
def test_ssv2_json_with_a_bom(tmp_path: Path, bom: bool) -> None:
    root = ssv2_root(tmp_path, bom)
    assert ssv2_index(root, "train").labels == [0, 1]
    assert ssv2_index(root, "val").labels == [1, 0]


def test_ssv2_older_file_names_are_named(tmp_path: Path) -> None:
    root = ssv2_root(tmp_path)
    with pytest.raises(FileNotFoundError, match="something-something-v2-"):
        ssv2_index(root, "train", labels_file="labels/nothing.json")
    for part, new in (("labels", "labels"), ("train", "train"), ("validation", "validation")):
        (root / "labels" / f"{new}.json").rename(root / "labels" / f"something-something-v2-{part}.json")
    with pytest.raises(FileNotFoundError) as err:
        ssv2_index(root, "train")
    text = str(err.value)
    assert text.startswith(f"data.labels_file: annotation file not found: {root / 'labels' / 'labels.json'}")
    assert ("data.labels_file=labels/something-something-v2-labels.json "
            "data.train_file=labels/something-something-v2-train.json "
            "data.val_file=labels/something-something-v2-validation.json") in text
    index = ssv2_index(root, "val", labels_file="labels/something-something-v2-labels.json",
                       val_file="labels/something-something-v2-validation.json")
    assert index.labels == [1, 0]


@pytest.mark.parametrize("cut", ["mid_entry", "after_entry", "after_comma", "labels"])
def test_a_truncated_json_file_is_called_truncated(tmp_path: Path, cut: str) -> None:
    root = ssv2_root(tmp_path)
    text = entries_text(ENTRIES)
    first_end = text.index("}") + 1
    target, body = root / "labels" / "train.json", {
        "mid_entry": text[:first_end + 20],  # inside the second entry
        "after_entry": text[:first_end],  # the first entry complete, no ']'
        "after_comma": text[:first_end + 3],  # '},\r\n'
        "labels": None,
    }[cut]
    if body is None:
        target, body = root / "labels" / "labels.json", json.dumps(LABELS, indent=1)[:-10]
    target.write_text(body)
    with pytest.raises(AnnotationError, match=f"{target}:\\d+(:\\d+)?: the JSON ends early.*truncated"):
        ssv2_index(root, "train")
