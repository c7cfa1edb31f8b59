"""Annotation readers on the generated tree, and the errors users see for broken files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

from videotrain.data.annotations import (
    AnnotationError,
    folder_index,
    kinetics_index,
    parse_label_csv,
)
from videotrain.data.synthetic import CLASSES


@pytest.mark.parametrize("split,n", [("train", 16), ("val", 8)])
def test_kinetics_index_on_generated_tree(tiny_root: Path, split: str, n: int) -> None:
    index = kinetics_index(tiny_root, split)
    assert len(index) == n
    assert index.class_names == list(CLASSES)  # from classes.txt, in its order
    assert index.source == str(tiny_root / f"{split}.csv")
    expected = dict(
        (str(tiny_root / rel), int(label))
        for rel, label in (ln.split() for ln in (tiny_root / f"{split}.csv").read_text().splitlines())
    )
    for path, info in index.paths:
        assert Path(path).is_file()  # paths are resolved against ROOT
        assert info["label"] == expected[path]
    assert sorted(set(index.labels)) == [0, 1, 2, 3]


def test_kinetics_index_class_names_from_folders_without_classes_txt(tiny_copy: Path) -> None:
    (tiny_copy / "classes.txt").unlink()
    index = kinetics_index(tiny_copy, "train")
    assert index.class_names == list(CLASSES)  # each label's videos are in its class folder
    # labels without videos keep their number
    assert kinetics_index(tiny_copy, "train", num_classes=6).class_names == [*CLASSES, "4", "5"]


def test_kinetics_index_numbers_classes_when_folders_do_not_name_them(tiny_copy: Path) -> None:
    (tiny_copy / "classes.txt").unlink()
    csv = tiny_copy / "train.csv"  # flat paths (as in the official Kinetics downloads)
    lines = []
    for line in csv.read_text().splitlines():
        rel, label = line.split()
        flat = f"flat/{Path(rel).name}"
        (tiny_copy / "flat").mkdir(exist_ok=True)
        (tiny_copy / rel).rename(tiny_copy / flat)
        lines.append(f"{flat} {label}")
    csv.write_text("\n".join(lines) + "\n")
    assert kinetics_index(tiny_copy, "train").class_names == ["0", "1", "2", "3"]


def test_kinetics_index_comma_separated_with_path_prefix(tiny_copy: Path, tmp_path: Path) -> None:
    """``path,label`` lines with paths relative to a prefix folder, and a class-name file
    elsewhere (all as keys of data=kinetics)."""
    (tiny_copy / "videos").mkdir()
    (tiny_copy / "train").rename(tiny_copy / "videos" / "train")
    ann = tmp_path / "ann"
    ann.mkdir()
    rows = [ln.split() for ln in (tiny_copy / "train.csv").read_text().splitlines()]
    (ann / "k_train.csv").write_text("".join(f"{rel},{label}\n" for rel, label in rows))
    (ann / "names.json").write_text(json.dumps({n: i for i, n in enumerate(CLASSES)}))
    index = kinetics_index(tiny_copy, "train", train_file=str(ann / "k_train.csv"),
                           path_prefix="videos", classes_file=str(ann / "names.json"))
    assert index.class_names == list(CLASSES) and len(index) == 16
    assert all(Path(p).is_file() and "/videos/train/" in p for p, _ in index.paths)
    assert index.labels == [int(label) for _, label in rows]
    with pytest.raises(FileNotFoundError, match="data.path_prefix: video folder not found"):
        kinetics_index(tiny_copy, "train", train_file=str(ann / "k_train.csv"), path_prefix="nope")
    with pytest.raises(FileNotFoundError, match="data.classes_file"):
        kinetics_index(tiny_copy, "train", classes_file="missing.txt")
    with pytest.raises(FileNotFoundError, match="data.val_file"):
        kinetics_index(tiny_copy, "val", val_file="missing.csv")


def test_kinetics_index_matches_pytorchvideo_reader(tiny_root: Path) -> None:
    """The same (path, label) pairs as pytorchvideo's ``LabeledVideoPaths.from_csv``."""
    ours = kinetics_index(tiny_root, "train")
    ref = LabeledVideoPaths.from_csv(str(tiny_root / "train.csv"))
    ref.path_prefix = str(tiny_root)
    assert list(ours.paths) == list(ref)


def test_classes_txt_count_mismatch(tiny_root: Path) -> None:
    with pytest.raises(AnnotationError, match=r"classes\.txt.*4 classes, expected 6"):
        kinetics_index(tiny_root, "train", num_classes=6)


def test_duplicate_class_names(tiny_copy: Path) -> None:
    (tiny_copy / "classes.txt").write_text("a\nb\na\nc\n")
    with pytest.raises(AnnotationError, match="duplicate class names .names 1 and 3 are the same"):
        kinetics_index(tiny_copy, "train")


def test_label_beyond_classes_txt(tiny_copy: Path) -> None:
    with (tiny_copy / "train.csv").open("a") as f:
        f.write("train/extra.mp4 4\n")
    with pytest.raises(AnnotationError) as err:
        kinetics_index(tiny_copy, "train")
    msg = str(err.value)
    assert "train.csv" in msg and "label 4" in msg and "num_classes=4" in msg


def test_label_beyond_explicit_num_classes(tiny_root: Path) -> None:
    with pytest.raises(AnnotationError, match=r"train\.csv: label 3 .* outside num_classes=3"):
        kinetics_index(tiny_root, "train", num_classes=3)


def test_missing_csv(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train.csv"):
        kinetics_index(tmp_path, "train")


def test_folder_index_on_generated_tree(tiny_root: Path) -> None:
    index = folder_index(tiny_root, "train")
    assert index.class_names == sorted(CLASSES)  # sorted folder names, not classes.txt order
    assert len(index) == 16
    for path, info in index.paths:
        assert Path(path).parent.name == index.class_names[info["label"]]
    assert index.labels.count(0) == 4


def test_folder_index_ignores_non_videos(tiny_copy: Path) -> None:
    (tiny_copy / "val" / CLASSES[0] / "notes.txt").write_text("not a video")
    assert len(folder_index(tiny_copy, "val")) == 8


def test_folder_index_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="split folder not found"):
        folder_index(tmp_path, "train")
    (tmp_path / "train").mkdir()
    with pytest.raises(AnnotationError, match="no class folders"):
        folder_index(tmp_path, "train")
    (tmp_path / "train" / "a").mkdir()
    with pytest.raises(AnnotationError, match="no video files"):
        folder_index(tmp_path, "train")


# ------------------------------------------------------------------- parse_label_csv


def test_parse_label_csv_formats(tmp_path: Path) -> None:
    f = tmp_path / "a.csv"
    f.write_text("# comment\n\nx/a b.mp4 0\nx/c.mp4,2\n  y/d.mp4\t1  \n")
    assert parse_label_csv(f) == [("x/a b.mp4", 0), ("x/c.mp4", 2), ("y/d.mp4", 1)]


@pytest.mark.parametrize(
    "bad_line,pattern",
    [
        ("foo.mp4 notanint", "not an integer"),
        ("foo.mp4", "expected 'path label'"),
        ("foo.mp4 -1", "negative label"),
        (",3", "an empty path or a negative label"),
    ],
)
def test_parse_label_csv_names_file_and_line(tmp_path: Path, bad_line: str, pattern: str) -> None:
    f = tmp_path / "train.csv"
    # line 4 is the bad one: a comment and a blank line still count as lines
    f.write_text(f"a.mp4 0\n# comment\n\n{bad_line}\nb.mp4 1\n")
    with pytest.raises(AnnotationError, match=pattern) as err:
        parse_label_csv(f)
    assert f"{f}:4:" in str(err.value)


def test_parse_label_csv_empty(tmp_path: Path) -> None:
    f = tmp_path / "val.csv"
    f.write_text("# nothing here\n\n")
    with pytest.raises(AnnotationError, match="no annotation lines"):
        parse_label_csv(f)


def test_annotation_error_is_a_value_error() -> None:
    assert issubclass(AnnotationError, ValueError)


def test_a_list_of_too_many_lines_is_refused_before_a_line_is_parsed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lines are counted in chunks first (LF, CRLF or a CR alone), so a file of short lines
    costs a count; the error names the file and the bound, not a line."""
    from videotrain.data import annotations

    monkeypatch.setattr(annotations, "MAX_ANNOTATION_LINES", 3)
    path = tmp_path / "train.csv"
    for end in ("\n", "\r\n", "\r"):
        path.write_text(end.join(f"v/secret{i}.mp4 0" for i in range(4)) + end, newline="")
        with pytest.raises(AnnotationError, match=f"{path}: more than 3 lines") as err:
            annotations.parse_label_csv(path)
        assert "secret" not in str(err.value)
    path.write_text("v/a.mp4 0\r\rv/b.mp4 1\r", newline="")  # old Mac line ends: lines all the same
    assert annotations.parse_label_csv(path) == [("v/a.mp4", 0), ("v/b.mp4", 1)]


def test_a_line_over_the_bound_is_refused_unread(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from videotrain.data import annotations

    monkeypatch.setattr(annotations, "MAX_ANNOTATION_LINE_CHARS", 20)
    path = tmp_path / "train.csv"
    path.write_text("v/a.mp4 0\n" + "v/" + "secret" * 10 + ".mp4 1\n")
    with pytest.raises(AnnotationError, match=f"{path}:2: a line longer than 20 characters") as err:
        annotations.parse_label_csv(path)
    assert "secret" not in str(err.value)
    path.write_text("v/a.mp4 0\nv/caf\xe9.mp4 1\n", encoding="latin-1")  # the byte's own line
    with pytest.raises(AnnotationError, match=f"{path}:2: byte 0xe9 is not UTF-8"):
        annotations.parse_label_csv(path)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": 1' + "0" * 5000 + "}",
                                  "[" + "{}," * 400 + "{}]"])
def test_a_hostile_class_json_is_one_error(text: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Deep nesting, a number too long to read, more values than the bound: one
    ``AnnotationError`` naming the file, before (or instead of) what ``json`` would build."""
    from videotrain.data import annotations

    monkeypatch.setattr(annotations, "MAX_ANNOTATION_JSON_VALUES", 500)
    path = tmp_path / "classes.json"
    path.write_text(text)
    with pytest.raises(AnnotationError, match=str(path)):
        annotations.read_class_names(path)
