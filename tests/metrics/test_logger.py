"""metrics.jsonl: rows, non-finite values, truncation on resume; wandb mode validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from videotrain.metrics.logger import MetricsLogger, WandbSettings


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_rows_and_truncate(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path / "run", wandb=WandbSettings(mode="disabled"))
    for step in range(1, 5):
        logger.log({"train_loss": float(step)}, step)
    logger.log({"val_top1": float("nan")}, 4)
    rows = _rows(logger.path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4]
    assert rows[-1]["val_top1"] is None  # NaN is written as null: the file stays valid JSON
    logger.truncate_after(2)  # resuming from the step-2 checkpoint
    assert [r["step"] for r in _rows(logger.path)] == [1, 2]
    logger.log({"train_loss": 3.5}, 3)
    assert [r["train_loss"] for r in _rows(logger.path)] == [1.0, 2.0, 3.5]
    logger.finish({"val_top1": 0.5})


def test_truncate_without_file_is_a_no_op(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, wandb=WandbSettings(mode="disabled"))
    logger.truncate_after(3)
    assert not logger.path.exists()


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path / "rank1", enabled=False)
    logger.log({"train_loss": 1.0}, 1)
    assert not (tmp_path / "rank1").exists()


def test_bad_wandb_mode_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="logger.wandb.mode"):
        MetricsLogger(tmp_path, wandb=WandbSettings(mode="sometimes"))
