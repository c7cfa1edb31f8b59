"""The Something-Something v2 reader on a tree in its native layout (written by the
generator), and the errors for broken JSON files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from videotrain.data.annotations import AnnotationError
from videotrain.data.layouts import ssv2_template
from videotrain.data.ssv2 import json_array_lines, ssv2_index
from videotrain.data.synthetic import CLASSES, write_video


@pytest.fixture
def ssv2(layout_root) -> Path:
    return layout_root("ssv2")


@pytest.fixture
def ssv2_copy(ssv2: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ssv2"
    shutil.copytree(ssv2, dst)
    return dst


@pytest.mark.parametrize("split,n,file", [("train", 16, "train.json"), ("val", 8, "validation.json")])
def test_ssv2_index_on_generated_tree(ssv2: Path, split: str, n: int, file: str) -> None:
    index = ssv2_index(ssv2, split)
    assert len(index) == n and index.source == str(ssv2 / "labels" / file)
    assert index.class_names == [ssv2_template(c).replace("[", "").replace("]", "") for c in CLASSES]
    entries = json.loads((ssv2 / "labels" / file).read_text())
    for (path, info), entry in zip(index.paths, entries, strict=True):
        assert path == str(ssv2 / "20bn-something-something-v2" / f"{entry['id']}.webm")
        assert Path(path).is_file()
        # the label follows the template, as in the class name of the entry's clip
        assert CLASSES[info["label"]].replace("_", " ") in entry["label"]


def test_ssv2_mp4_videos(ssv2_copy: Path) -> None:
    videos = ssv2_copy / "20bn-something-something-v2"
    first = sorted(videos.glob("*.webm"), key=lambda p: int(p.stem))[0]
    first.unlink()
    write_video(first.with_suffix(".mp4"), np.zeros((4, 32, 32, 3), np.uint8), 10)
    paths = [p for p, _ in ssv2_index(ssv2_copy, "train").paths]
    assert paths[0].endswith("/1.mp4") and paths[1].endswith("/2.webm")  # auto: per video
    assert all(p.endswith(".mp4") for p, _ in ssv2_index(ssv2_copy, "train", video_ext="mp4").paths)
    with pytest.raises(ValueError, match="data.video_ext must be one of webm, mp4, auto"):
        ssv2_index(ssv2_copy, "train", video_ext="avi")


def test_older_file_names_through_the_keys(ssv2_copy: Path) -> None:
    for new, old in (("labels", "labels"), ("train", "train"), ("validation", "validation")):
        (ssv2_copy / "labels" / f"{new}.json").rename(ssv2_copy / f"something-something-v2-{old}.json")
    with pytest.raises(FileNotFoundError, match="data.labels_file"):
        ssv2_index(ssv2_copy, "train")
    index = ssv2_index(ssv2_copy, "val", labels_file="something-something-v2-labels.json",
                       val_file="something-something-v2-validation.json")
    assert len(index) == 8


def _insert_line(path: Path, at: int, text: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(at - 1, text)
    path.write_text("".join(lines))


@pytest.mark.parametrize("entry,message", [
    ('{"id":"99","label":"x","template":"Jumping over [something]"},\n',
     r"expected a template listed in .*labels\.json \(entry 4's is not\)"),
    ('{"id":"99","label":"x"},\n', "expected an object with 'id' and 'template'"),
    ('{"id":"99" "template":"x"},\n', "invalid JSON"),
    ('"99",\n', "expected an object with 'id' and 'template'"),
])
def test_bad_entry_names_file_and_line(ssv2_copy: Path, entry: str, message: str) -> None:
    train = ssv2_copy / "labels" / "train.json"
    _insert_line(train, 5, entry)  # line 1 is "[", entries start on line 2
    with pytest.raises(AnnotationError, match=message) as err:
        ssv2_index(ssv2_copy, "train")
    assert f"{train}:5" in str(err.value)


def test_json_array_lines_structure(tmp_path: Path) -> None:
    f = tmp_path / "a.json"
    f.write_text('[\n  {"a": 1},\n\n  {"b": [1,\n 2]}\n]\n')
    assert json_array_lines(f) == [(2, {"a": 1}), (4, {"b": [1, 2]})]
    f.write_text("[]")
    assert json_array_lines(f) == []
    f.write_text('{"a": 1}')
    with pytest.raises(AnnotationError, match=r"a.json:1: expected a JSON array"):
        json_array_lines(f)
    f.write_text('[\n{"a": 1}\n{"b": 2}\n]')
    with pytest.raises(AnnotationError, match=r"a.json:3: expected ',' or '\]' after the entry on line 2"):
        json_array_lines(f)


@pytest.mark.parametrize("labels,message", [
    ('{"Moving something": "0", "Other": "0"}', "index 0 is used twice"),
    ('{"Moving something": "zero"}', "the index of entry 1 is not an integer"),
    ('{"Moving something": "1"}', r"indices must be 0..0"),
    ('{"Moving something": "0",\n "x" "1"}', r"labels.json:2:6: invalid JSON"),
])
def test_bad_labels_json(ssv2_copy: Path, labels: str, message: str) -> None:
    (ssv2_copy / "labels" / "labels.json").write_text(labels)
    with pytest.raises(AnnotationError, match=message):
        ssv2_index(ssv2_copy, "train")


def test_num_classes_must_match_labels_json(ssv2: Path) -> None:
    with pytest.raises(AnnotationError, match="lists 4 classes, but data.num_classes=3"):
        ssv2_index(ssv2, "train", num_classes=3)


def _official_ssv2(root: Path, entries: int) -> Path:
    """labels.json and train.json as the release ships them: one entry a line, CRLF."""
    (root / "labels").mkdir(parents=True)
    (root / "20bn-something-something-v2").mkdir()
    templates = [f"Moving [something] and [something] apart {k}" for k in range(174)]
    (root / "labels" / "labels.json").write_text(json.dumps(
        {t.replace("[", "").replace("]", ""): str(k) for k, t in enumerate(templates)}, indent=1))
    lines = [json.dumps({"id": str(k + 1), "label": "moving a cup and a box apart",
                         "template": templates[k % 174], "placeholders": ["a cup", "a box"]})
             for k in range(entries)]
    path = root / "labels" / "train.json"
    path.write_bytes(("[\r\n" + ",\r\n".join(lines) + "\r\n]\r\n").encode())
    return path


def test_index_of_a_large_train_json_is_linear(tmp_path: Path) -> None:
    """30,000 entries (the official train.json has 168,913) read in a small
    multiple of json.loads of the same file; the line of a bad entry is still named."""
    import time

    path = _official_ssv2(tmp_path, 30_000)
    plain, build = [], []
    for _ in range(2):  # the best of two, against a busy machine
        t0 = time.perf_counter()
        json.loads(path.read_text())
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        index = ssv2_index(tmp_path, "train")
        build.append(time.perf_counter() - t0)
    assert len(index) == 30_000 and index.paths[29_999][1]["label"] == 29_999 % 174
    assert min(build) < 5 * min(plain) + 0.2, (build, plain)

    data = path.read_bytes()
    last = data.rfind(b"Moving [something] and [something] apart 71")  # the last entry's template
    path.write_bytes(data[:last] + b"Not a template" + data[last + len(b"Moving [something] and [something] apart 71"):])
    # the last entry is on line 30,001 (line 1 holds the "[")
    with pytest.raises(AnnotationError, match=r"train\.json:30001: expected a template listed in"):
        ssv2_index(tmp_path, "train")
