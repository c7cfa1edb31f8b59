"""The label-aware horizontal flip (``data.hflip_label_map``): a mirrored clip takes the label of
the mirrored action, so direction classes can be flipped without teaching the wrong label."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from videotrain.config.build import build_data_from_cfg
from videotrain.data.annotations import kinetics_index
from videotrain.data.dataset import VideoClipDataset
from videotrain.data.loaders import flip_label_indices
from videotrain.data.synthetic import CLASSES

MIRROR = {"right_then_down": "left_then_down", "right_then_up": "left_then_up"}


def test_flip_label_indices_both_ways_and_errors_name_the_class() -> None:
    assert flip_label_indices(MIRROR, CLASSES) == {0: 2, 2: 0, 1: 3, 3: 1}
    assert flip_label_indices({"left_then_up": "right_then_up"}, CLASSES) == {3: 1, 1: 3}
    with pytest.raises(ValueError, match="'rightwards' is not a class"):
        flip_label_indices({"rightwards": "left_then_up"}, CLASSES)
    with pytest.raises(ValueError, match="'right_then_down' is mapped to two mirrors"):
        flip_label_indices({"right_then_down": "left_then_down", "left_then_up": "right_then_down"}, CLASSES)


def test_flipped_clips_are_mirrored_and_relabelled(tiny_root: Path) -> None:
    index = kinetics_index(tiny_root, "train")
    plain = VideoClipDataset(index, 4, 0.4, lambda clip: clip, train=True)
    flipping = VideoClipDataset(index, 4, 0.4, lambda clip: clip, train=True,
                                flip_labels=flip_label_indices(MIRROR, index.class_names))
    flipped = 0
    for i in range(len(index)):
        seed = 1000 + i
        video, label = plain._load(i, seed)
        v2, l2 = flipping._load(i, seed)  # the same seed: the same window, then maybe the flip
        if torch.equal(v2, video):
            assert l2 == label
        else:
            assert torch.equal(v2, video.flip(-1))  # (T, C, H, W) mirrored left <-> right
            assert CLASSES[l2] == {**MIRROR, **{b: a for a, b in MIRROR.items()}}[CLASSES[label]]
            flipped += 1
    assert 0 < flipped < len(index)  # about half
    val = VideoClipDataset(index, 4, 0.4, lambda clip: clip, train=False,
                           flip_labels=flip_label_indices(MIRROR, index.class_names))
    assert val.flip_labels is None  # evaluation never flips


def test_label_map_needs_hflip_on(tiny_root: Path, compose_cfg, tiny_synthetic_overrides) -> None:
    cfg = compose_cfg([*tiny_synthetic_overrides, "data.hflip=false",
                       "data.hflip_label_map={right_then_down: left_then_down}"])
    with pytest.raises(ValueError, match="data.hflip_label_map is set but data.hflip=false"):
        build_data_from_cfg(cfg, torch.device("cpu"))


def test_label_map_into_a_dropped_class_is_refused(tiny_root: Path, compose_cfg, tiny_synthetic_overrides) -> None:
    cfg = compose_cfg([*tiny_synthetic_overrides, "data.hflip=true", "data.drop_classes=[left_then_down]",
                       "data.hflip_label_map={right_then_down: left_then_down}"])
    with pytest.raises(ValueError, match="mirrors the class of label 0 into that of label 2, which data.drop_classes"):
        build_data_from_cfg(cfg, torch.device("cpu"))
