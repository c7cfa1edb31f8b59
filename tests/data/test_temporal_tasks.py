"""The accuracy suite's temporal tasks (``videotrain/data/temporal_tasks.py``): files, classes,
and that none of them can be solved from per-frame appearance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from videotrain.data.layouts import ensure_synthetic
from videotrain.data.synthetic import TASK_NAMES, SyntheticSpec, render_clip
from videotrain.data.temporal_tasks import TASKS
from videotrain.models.backbones import resnet
from videotrain.models.heads import MeanHead
from videotrain.models.video import VideoClassifier


@pytest.mark.parametrize("task", list(TASKS))
def test_task_clips_are_deterministic_and_differ_by_class(task: str) -> None:
    spec = SyntheticSpec(task=task, num_frames=8, size=32, object_size=6)
    a = render_clip(spec, 1, np.random.default_rng(4))
    assert a.shape == (8, 32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, render_clip(spec, 1, np.random.default_rng(4)))
    assert not np.array_equal(a, render_clip(spec, 2, np.random.default_rng(4)))
    assert len(spec.classes) == 4 and len(set(spec.classes)) == 4


def test_task_name_is_checked_and_the_default_keeps_its_folder() -> None:
    with pytest.raises(ValueError, match="data.synthetic.task"):
        SyntheticSpec(task="counting")
    assert TASK_NAMES[0] == "two_strokes"
    # the default task's cache folder name is what it was before tasks existed
    assert SyntheticSpec().digest() == SyntheticSpec(task="two_strokes").digest()
    assert SyntheticSpec().digest() != SyntheticSpec(task="order").digest()


def test_a_new_drawing_of_a_task_is_a_new_cache_folder(monkeypatch) -> None:
    before = SyntheticSpec(task="speed").digest()
    monkeypatch.setitem(TASKS, "speed", TASKS["speed"]._replace(version=TASKS["speed"].version + 1))
    assert SyntheticSpec(task="speed").digest() != before  # not the old videos under a new renderer


def test_task_dataset_names_its_classes(tmp_path) -> None:
    root = ensure_synthetic(tmp_path, task="rotation", train_per_class=1, val_per_class=1,
                            num_frames=4, size=32)
    assert (root / "classes.txt").read_text().split() == list(TASKS["rotation"].classes)
    assert len((root / "train.csv").read_text().splitlines()) == 4


def _clips(task: str, per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    spec = SyntheticSpec(task=task, num_frames=8, size=32, object_size=6)
    rng = np.random.default_rng(seed)
    videos, labels = [], []
    for _ in range(per_class):
        for label in range(4):
            videos.append(render_clip(spec, label, rng))
            labels.append(label)
    x = torch.from_numpy(np.stack(videos)).permute(0, 1, 4, 2, 3).float() / 255  # (N, T, C, H, W)
    return (x - 0.5) / 0.25, torch.tensor(labels)


@pytest.mark.slow
@pytest.mark.parametrize("task", list(TASKS))
def test_an_order_blind_model_stays_near_chance(task: str) -> None:
    """A per-frame backbone with the mean head (TSN's consensus) sees only the set of frames:
    trained on a small version of the task it fits the training clips at best, and stays near
    chance (0.25) on new ones. The same budget with the frames' order is what the suite measures."""
    torch.manual_seed(0)
    x, y = _clips(task, 48, seed=1)
    xv, yv = _clips(task, 48, seed=2)
    backbone = resnet(layers=[1, 1, 1, 1], grid=2)
    model = VideoClassifier(backbone, MeanHead(backbone.feature_dim, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(4):
        for i in torch.randperm(len(y)).split(16):
            opt.zero_grad()
            loss_fn(model(x[i]), y[i]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(xv).argmax(1) == yv).float().mean().item()
    # 192 validation clips: chance 0.25 with a binomial std of 0.031; 0.40 is 4.8 std above it
    assert acc < 0.40, f"{task}: the mean head reached {acc:.3f}, so per-frame appearance solves it"
