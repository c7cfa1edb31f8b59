"""The synthetic generator: files on disk, determinism, caching, and the task's semantics."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import av
import numpy as np
import pytest

from videotrain.data.layouts import default_cache_root, ensure_synthetic
from videotrain.data.synthetic import CLASSES, SyntheticSpec, render_clip


def test_generated_tree_layout(tiny_root: Path, tiny_spec: SyntheticSpec) -> None:
    assert (tiny_root / "classes.txt").read_text().split() == list(CLASSES)
    assert json.loads((tiny_root / "spec.json").read_text()) == asdict(tiny_spec)
    for split, per_class in (("train", tiny_spec.train_per_class), ("val", tiny_spec.val_per_class)):
        lines = (tiny_root / f"{split}.csv").read_text().splitlines()
        assert len(lines) == per_class * len(CLASSES)
        for line in lines:
            rel, label = line.split()
            # the class folder of every file matches its label
            assert rel.startswith(f"{split}/{CLASSES[int(label)]}/")
            assert (tiny_root / rel).stat().st_size > 0
    # no temporary folder left next to the finished tree
    assert not list(tiny_root.parent.glob(tiny_root.name + ".tmp*"))


def test_generated_video_decodes_to_spec(tiny_root: Path, tiny_spec: SyntheticSpec) -> None:
    path = tiny_root / "train" / CLASSES[0] / f"{CLASSES[0]}_0000.mp4"
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == tiny_spec.num_frames
    assert frames[0].shape == (tiny_spec.size, tiny_spec.size, 3)


def test_render_clip_is_deterministic_per_seed() -> None:
    spec = SyntheticSpec(num_frames=8, size=32)
    a = render_clip(spec, 2, np.random.default_rng(7))
    b = render_clip(spec, 2, np.random.default_rng(7))
    c = render_clip(spec, 2, np.random.default_rng(8))
    assert a.dtype == np.uint8 and a.shape == (8, 32, 32, 3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def _centroid(frame: np.ndarray, colour: str) -> tuple[float, float]:
    rgb = (230, 40, 40) if colour == "red" else (40, 80, 235)  # the generator's raw colours
    ys, xs = np.nonzero((frame == np.array(rgb, dtype=np.uint8)).all(axis=-1))
    assert len(xs) > 0, f"no {colour} object in frame"
    return float(xs.mean()), float(ys.mean())


@pytest.mark.parametrize("label", range(len(CLASSES)))
def test_render_clip_moves_as_the_class_name_says(label: int) -> None:
    spec = SyntheticSpec(num_frames=8, size=48)
    frames = render_clip(spec, label, np.random.default_rng(label))
    half = spec.num_frames // 2
    red_dx = _centroid(frames[half - 1], "red")[0] - _centroid(frames[0], "red")[0]
    blue_dy = _centroid(frames[-1], "blue")[1] - _centroid(frames[half], "blue")[1]
    horizontal, vertical = CLASSES[label].split("_then_")
    assert (red_dx > 0) == (horizontal == "right"), (CLASSES[label], red_dx)
    assert (blue_dy > 0) == (vertical == "down"), (CLASSES[label], blue_dy)
    assert abs(red_dx) > 0.3 * spec.travel * spec.size
    assert abs(blue_dy) > 0.3 * spec.travel * spec.size


def test_digest_names_the_spec() -> None:
    assert SyntheticSpec().digest() == SyntheticSpec().digest()
    assert SyntheticSpec().digest() != replace(SyntheticSpec(), seed=1).digest()


def test_ensure_synthetic_reuses_the_cache(tiny_root: Path, isolated_env: Path,
                                           tiny_spec: SyntheticSpec) -> None:
    assert default_cache_root() == isolated_env
    before = (tiny_root / "train.csv").stat().st_mtime_ns
    root = ensure_synthetic(None, **{k: getattr(tiny_spec, k) for k in
                                     ("train_per_class", "val_per_class", "num_frames", "size", "seed")})
    assert root == tiny_root
    assert (tiny_root / "train.csv").stat().st_mtime_ns == before  # not regenerated


def test_ensure_synthetic_generates_into_root(tmp_path: Path) -> None:
    root = ensure_synthetic(tmp_path, train_per_class=1, val_per_class=1, num_frames=4, size=32)
    assert root.parent == tmp_path and root.name.startswith("synthetic-")
    assert len((root / "train.csv").read_text().splitlines()) == len(CLASSES)
    assert len(list(root.rglob("*.mp4"))) == 2 * len(CLASSES)
