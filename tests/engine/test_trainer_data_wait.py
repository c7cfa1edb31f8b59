"""``data_wait_s`` in metrics.jsonl: the time a step waits for its batches, kept apart from the
step's compute time, so a user sees when loading is the bottleneck."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

import videotrain.run as run
from videotrain.data.dataset import VideoClipDataset

DELAY = 0.05  # seconds added to every training clip


@pytest.fixture
def slow_train_clips(monkeypatch: pytest.MonkeyPatch) -> None:
    real = VideoClipDataset.__getitem__

    def slow(self, key):
        if self.train:
            time.sleep(DELAY)
        return real(self, key)

    monkeypatch.setattr(VideoClipDataset, "__getitem__", slow)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_data_wait_is_logged_apart_from_step_time(
    grad_accum: int, slow_train_clips, run_overrides, compose_cfg, metrics_rows, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # batch 4 in the main process (no workers): each micro-batch waits >= 4 * DELAY
    cfg = compose_cfg(run_overrides(trainer__max_steps=2, trainer__grad_accum=grad_accum))
    with caplog.at_level(logging.WARNING):
        results = run.train(cfg, tmp_path)
    rows = [r for r in metrics_rows(tmp_path) if "train_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["data_wait_s"] >= grad_accum * 4 * DELAY  # every micro-batch's wait counts
        assert r["step_time_s"] > 0 and "data_time_s" not in r
    assert results["data_wait_s"] >= grad_accum * 4 * DELAY
    if results["data_wait_s"] > 0.25 * results["step_time_s"]:
        assert any("data loading is a bottleneck" in r.getMessage() for r in caplog.records)


def test_step_time_excludes_the_wait_for_later_micro_batches(
    run_overrides, compose_cfg, metrics_rows, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 4 micro-batches per step, 3 of the step's 4 waits fall between its start and end;
    they are data wait, not step time. Clips take 0.25 s each, so those 3 waits alone are
    1.5 s, far more than the tiny model's compute."""
    real = VideoClipDataset.__getitem__

    def slow(self, key):
        if self.train:
            time.sleep(0.25)
        return real(self, key)

    monkeypatch.setattr(VideoClipDataset, "__getitem__", slow)
    cfg = compose_cfg(run_overrides(trainer__max_steps=1, trainer__grad_accum=4, data__batch_size=2))
    run.train(cfg, tmp_path)
    (row,) = [r for r in metrics_rows(tmp_path) if "train_loss" in r]
    assert row["data_wait_s"] >= 4 * 2 * 0.25
    assert row["step_time_s"] < 3 * 2 * 0.25
