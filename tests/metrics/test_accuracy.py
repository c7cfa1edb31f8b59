"""Top-k and multi-view accuracy against hand-computed expectations."""

from __future__ import annotations

import math

import pytest
import torch

from videotrain.metrics.accuracy import MultiViewAccuracy, topk_correct


def test_topk_correct_by_hand() -> None:
    scores = torch.tensor([
        [0.1, 0.5, 0.4],   # label 2: rank 2
        [0.8, 0.15, 0.05],  # label 0: rank 1
        [0.2, 0.3, 0.5],   # label 0: rank 3
    ])
    labels = torch.tensor([2, 0, 0])
    assert topk_correct(scores, labels, (1, 2, 3)) == {1: 1, 2: 2, 3: 3}
    assert topk_correct(scores, labels, (1, 10)) == {1: 1, 10: 3}  # k > K clamps to K


# Two videos x three views, K = 3 classes. Chosen so that clip level and video level disagree:
# video 0 (label 0): one confident correct view, two mildly wrong views -> clips 1/3 correct,
#   but the averaged softmax still picks class 0;
# video 1 (label 1): two correct views, one confidently wrong -> clips 2/3 correct, and the
#   averaged softmax picks class 1.
LOGITS = torch.tensor([
    [[5.0, 0.0, 0.0], [0.0, 1.0, -1.0], [0.0, 1.0, -1.0]],
    [[0.0, 3.0, 0.0], [3.0, 0.0, 1.0], [0.0, 2.0, 1.0]],
])
LABELS = torch.tensor([0, 1])


def test_multi_view_accuracy_by_hand() -> None:
    acc = MultiViewAccuracy(ks=(1, 2, 5))
    acc.update(LOGITS, LABELS)
    out = acc.compute()
    assert out["val_clip_top1"] == pytest.approx(3 / 6)  # views: (1 of 3) + (2 of 3)
    assert out["val_top1"] == pytest.approx(2 / 2)  # both videos right after averaging
    # top-2: only video 1's wrong view [3, 0, 1] misses label 1 among {0, 2}
    assert out["val_clip_top2"] == pytest.approx(5 / 6)
    assert out["val_top2"] == pytest.approx(1.0)
    assert out["val_clip_top5"] == out["val_top5"] == pytest.approx(1.0)  # k > K
    assert out["val_videos"] == 2
    # video-level loss: -log of the averaged probability of the label
    p0 = (math.exp(5) / (math.exp(5) + 2) + 2 * 1 / (1 + math.e + math.exp(-1))) / 3
    p1 = (math.exp(3) / (math.exp(3) + 2)
          + 1 / (math.exp(3) + 1 + math.e)
          + math.exp(2) / (1 + math.exp(2) + math.e)) / 3
    assert p0 == pytest.approx(0.4920, abs=1e-3) and p1 == pytest.approx(0.5389, abs=1e-3)
    assert out["val_loss"] == pytest.approx((-math.log(p0) - math.log(p1)) / 2, rel=1e-5)


def test_multi_view_accuracy_where_averaging_hurts() -> None:
    # label 2: two mildly right views, one very confident wrong view -> the average picks 1
    logits = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 6.0, 0.0]]])
    acc = MultiViewAccuracy(ks=(1,))
    acc.update(logits, torch.tensor([2]))
    out = acc.compute()
    assert out["val_clip_top1"] == pytest.approx(2 / 3) and out["val_top1"] == 0.0


def test_multi_view_accuracy_accumulates_and_round_trips() -> None:
    whole = MultiViewAccuracy(ks=(1, 2))
    whole.update(LOGITS, LABELS)
    parts = MultiViewAccuracy(ks=(1, 2))
    parts.update(LOGITS[:1], LABELS[:1])
    parts.update(LOGITS[1:], LABELS[1:])
    assert parts.compute() == pytest.approx(whole.compute())
    # state() is what DDP all-reduces: summing two copies doubles counts, keeps fractions
    doubled = MultiViewAccuracy(ks=(1, 2))
    doubled.load(whole.state() * 2)
    out = doubled.compute()
    assert out["val_videos"] == 4
    assert out == pytest.approx({**whole.compute(), "val_videos": 4})


def test_multi_view_accuracy_empty_and_bf16() -> None:
    assert MultiViewAccuracy().compute()["val_top1"] == 0.0  # no division by zero
    acc = MultiViewAccuracy(ks=(1,))
    acc.update(LOGITS.bfloat16(), LABELS)
    assert acc.compute()["val_clip_top1"] == pytest.approx(0.5)
