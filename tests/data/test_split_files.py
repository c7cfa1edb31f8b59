"""UCF101 and HMDB51 readers on trees in their official layouts (written by the generator),
and the errors for broken split files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pytorchvideo.data.hmdb51 import Hmdb51LabeledVideoPaths

from videotrain.data.annotations import AnnotationError
from videotrain.data.layouts import camel
from videotrain.data.split_files import hmdb51_index, ucf101_index
from videotrain.data.synthetic import CLASSES

# the tiny spec: 4 train + 2 val clips per class; each fold tests on 2 clips per class
PER_CLASS, TEST_PER_CLASS = 6, 2


@pytest.fixture
def ucf(layout_root) -> Path:
    return layout_root("ucf101")


@pytest.fixture
def hmdb(layout_root) -> Path:
    return layout_root("hmdb51")


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _pairs(index) -> set[tuple[str, int]]:
    return {(p, info["label"]) for p, info in index.paths}


@pytest.mark.parametrize("reader,name", [(ucf101_index, "ucf"), (hmdb51_index, "hmdb")])
def test_folds_partition_the_videos(reader, name: str, request: pytest.FixtureRequest) -> None:
    root = request.getfixturevalue(name)
    tests = []
    for fold in (1, 2, 3):
        train, val = reader(root, "train", fold=fold), reader(root, "val", fold=fold)
        assert len(train) == len(CLASSES) * (PER_CLASS - TEST_PER_CLASS)
        assert len(val) == len(CLASSES) * TEST_PER_CLASS
        assert not _pairs(train) & _pairs(val)  # a video is train or test, never both
        assert train.class_names == val.class_names and len(train.class_names) == 4
        for path, info in [*train.paths, *val.paths]:
            assert Path(path).is_file()
            assert Path(path).parent.name == train.class_names[info["label"]]
        assert sorted(set(train.labels)) == [0, 1, 2, 3]
        tests.append(_pairs(val))
    assert not tests[0] & tests[1] and not tests[1] & tests[2]  # folds test on other clips


def test_ucf101_classes_and_fold_one(ucf: Path, tiny_root: Path) -> None:
    val = ucf101_index(ucf, "val", fold=1)
    assert val.class_names == [camel(c) for c in CLASSES]  # classInd.txt order
    assert val.source == str(ucf / "ucfTrainTestlist" / "testlist01.txt")
    # fold 1 tests on the same clips as the Kinetics layout's val split
    assert sorted(val.labels) == sorted(int(ln.split()[1]) for ln in
                                        (tiny_root / "val.csv").read_text().splitlines())


def test_hmdb51_matches_pytorchvideo_reader(hmdb: Path) -> None:
    for fold in (1, 2, 3):
        for split, ptv_split in (("train", "train"), ("val", "test")):
            ours = hmdb51_index(hmdb, split, fold=fold)
            ref = Hmdb51LabeledVideoPaths.from_dir(str(hmdb / "testTrainMulti_7030_splits"),
                                                   split_id=fold, split_type=ptv_split)
            ref.path_prefix = str(hmdb / "hmdb51_org")
            assert {(p, ours.class_names[info["label"]]) for p, info in ours.paths} == \
                {(p, info["label"]) for p, info in ref}


def test_hmdb51_ignores_unused_videos(hmdb: Path, tmp_path: Path) -> None:
    root = _copy(hmdb, tmp_path)
    f = root / "testTrainMulti_7030_splits" / f"{CLASSES[0]}_test_split1.txt"
    lines = f.read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace(" 1 ", " 0 ")  # the first (train) video of the class: unused
    f.write_text("".join(lines))
    assert len(hmdb51_index(root, "train", fold=1)) == len(CLASSES) * 4 - 1
    assert len(hmdb51_index(root, "val", fold=1)) == len(CLASSES) * 2


@pytest.mark.parametrize("reader,name", [(ucf101_index, "ucf"), (hmdb51_index, "hmdb")])
def test_bad_fold_names_the_key(reader, name: str, request: pytest.FixtureRequest) -> None:
    with pytest.raises(ValueError, match=r"data.fold must be one of \(1, 2, 3\), got 4"):
        reader(request.getfixturevalue(name), "train", fold=4)


@pytest.mark.parametrize("file,old,new,message", [
    ("classInd.txt", "2 RightThenUp", "2RightThenUp", "expected 'index ClassName'"),
    ("classInd.txt", "3 LeftThenDown", "4 LeftThenDown", "index 4 out of order"),
    ("trainlist01.txt", "v_RightThenUp_g01_c01.avi 2", "v_RightThenUp_g01_c01.avi 3",
     r"label 3 disagrees with the video's class folder, class 2 of classInd.txt"),
    ("trainlist01.txt", "v_RightThenUp_g01_c01.avi 2", "v_RightThenUp_g01_c01.avi x",
     "the label is not an integer"),
    ("testlist01.txt", "RightThenUp/v_RightThenUp_g05", "Jumping/v_RightThenUp_g05",
     "its class folder is not there"),
    ("testlist01.txt", "v_RightThenUp_g05_c01.avi", "v_RightThenUp_g05_c01.avi 2 extra",
     "expected 'Class/video.avi"),
])
def test_ucf101_bad_line_names_file_and_line(ucf: Path, tmp_path: Path, file: str, old: str,
                                             new: str, message: str) -> None:
    root = _copy(ucf, tmp_path)
    f = root / "ucfTrainTestlist" / file
    text = f.read_bytes().decode()
    assert old in text
    lineno = text[: text.index(old)].count("\n") + 1
    f.write_bytes(text.replace(old, new).encode())
    split = "val" if file.startswith("test") else "train"
    with pytest.raises(AnnotationError, match=message) as err:
        ucf101_index(root, split, fold=1)
    assert f"{f}:{lineno}:" in str(err.value)


@pytest.mark.parametrize("bad", ["Synth_000.avi 3", "Synth_000.avi", "Synth_000.avi one"])
def test_hmdb51_bad_line_names_file_and_line(hmdb: Path, tmp_path: Path, bad: str) -> None:
    root = _copy(hmdb, tmp_path)
    f = root / "testTrainMulti_7030_splits" / f"{CLASSES[2]}_test_split2.txt"
    lines = f.read_text().splitlines(keepends=True)
    lines.insert(3, bad + "\n")  # becomes line 4
    f.write_text("".join(lines))
    with pytest.raises(AnnotationError, match="expected 'video.avi 0|1|2'") as err:
        hmdb51_index(root, "train", fold=2)
    assert f"{f}:4:" in str(err.value)
    assert len(hmdb51_index(root, "train", fold=1)) == 16  # other folds are other files


def test_missing_files_and_folders_name_the_key(ucf: Path, hmdb: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.video_dir: video folder not found"):
        ucf101_index(ucf, "train", video_dir="UCF101_videos")
    with pytest.raises(FileNotFoundError, match="data.split_dir: annotation file not found"):
        ucf101_index(ucf, "train", split_dir="lists")
    with pytest.raises(FileNotFoundError, match="data.split_dir: split folder not found"):
        hmdb51_index(hmdb, "train", split_dir="splits")
    with pytest.raises(AnnotationError, match=r"no \*_test_split1.txt files"):
        hmdb51_index(hmdb, "train", split_dir="hmdb51_org")


def test_num_classes_must_match_the_class_list(ucf: Path, hmdb: Path) -> None:
    with pytest.raises(AnnotationError, match="lists 4 classes, but data.num_classes=5"):
        ucf101_index(ucf, "train", num_classes=5)
    with pytest.raises(AnnotationError, match="name 4 classes, but data.num_classes=3"):
        hmdb51_index(hmdb, "train", num_classes=3)
    assert len(ucf101_index(ucf, "train", num_classes=4).class_names) == 4
