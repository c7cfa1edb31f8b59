"""The generator writes every dataset layout from the same clips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from videotrain.data.decode import VideoFile
from videotrain.data.layouts import LAYOUTS, camel, ensure_synthetic, generate, in_test_fold
from videotrain.data.loaders import read_index
from videotrain.data.synthetic import CLASSES, SyntheticSpec

# the first training clip of class 1 (right_then_up) in each layout
FIRST = {
    "kinetics": "train/right_then_up/right_then_up_0000.mp4",
    "folder": "train/right_then_up/right_then_up_0000.mp4",
    "ucf101": "UCF-101/RightThenUp/v_RightThenUp_g01_c01.avi",
    "hmdb51": "hmdb51_org/right_then_up/Synth_000_right_then_up_u_nm_np1_fr_med_0.avi",
    "ssv2": "20bn-something-something-v2/2.webm",  # ids count clips in generation order
}
FILES = {
    "kinetics": ["train.csv", "val.csv", "classes.txt"],
    "folder": [],
    "ucf101": ["ucfTrainTestlist/classInd.txt", *(f"ucfTrainTestlist/{k}list0{f}.txt"
                                                 for k in ("train", "test") for f in (1, 2, 3))],
    "hmdb51": [f"testTrainMulti_7030_splits/{c}_test_split{f}.txt" for c in CLASSES for f in (1, 2, 3)],
    "ssv2": ["labels/labels.json", "labels/train.json", "labels/validation.json"],
}


def _frames(path: Path) -> np.ndarray:
    with VideoFile(str(path)) as v:
        return v.clips([(0.0, v.duration)], 8)[0].astype(np.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_files_and_same_clips(layout: str, layout_root, tiny_spec: SyntheticSpec) -> None:
    root = layout_root(layout)
    for rel in FILES[layout]:
        assert (root / rel).is_file(), rel
    videos = [p for p in root.rglob("*") if p.suffix in (".mp4", ".avi", ".webm")]
    assert len(videos) == len(CLASSES) * (tiny_spec.train_per_class + tiny_spec.val_per_class)
    # the same rendered clip, encoded by another codec (H.264, MPEG-4 part 2, VP8)
    ref, clip = _frames(layout_root("kinetics") / FIRST["kinetics"]), _frames(root / FIRST[layout])
    assert clip.shape == ref.shape == (8, 32, 32, 3)
    assert np.abs(clip - ref).mean() < 6.0
    other = _frames(layout_root("kinetics") / FIRST["kinetics"].replace("0000", "0001"))
    assert np.abs(other - ref).mean() > 15.0  # (a different clip is far away)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reader_sees_the_generator_split(layout: str, layout_root, tiny_spec: SyntheticSpec) -> None:
    root = layout_root(layout)
    for split, per_class in (("train", tiny_spec.train_per_class), ("val", tiny_spec.val_per_class)):
        index = read_index(layout, root, split, None)
        assert len(index) == len(CLASSES) * per_class
        assert sorted(index.labels) == sorted(list(range(len(CLASSES))) * per_class)
        names = {"ucf101": [camel(c) for c in CLASSES], "folder": sorted(CLASSES),
                 "hmdb51": sorted(CLASSES)}.get(layout)
        if names:
            assert index.class_names == names


def test_test_folds_rotate() -> None:
    spec = SyntheticSpec(train_per_class=6, val_per_class=2)
    tests = {f: [j for j in range(8) if in_test_fold(spec, j, f)] for f in (1, 2, 3)}
    assert tests == {1: [6, 7], 2: [0, 1], 3: [2, 3]}  # fold 1 = the generator's val clips


def test_generate_rejects_unknown_layout(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layout must be one of kinetics, folder, ucf101"):
        generate(tmp_path / "x", SyntheticSpec(), "charades")
    assert not list(tmp_path.iterdir())


def test_ensure_synthetic_names_the_layout(tmp_path: Path) -> None:
    small = dict(train_per_class=1, val_per_class=1, num_frames=4, size=32)
    root = ensure_synthetic(tmp_path, layout="hmdb51", **small)
    assert root.name == f"synthetic-hmdb51-{SyntheticSpec(**small).digest()}"
    assert ensure_synthetic(tmp_path, **small).name == f"synthetic-{SyntheticSpec(**small).digest()}"
