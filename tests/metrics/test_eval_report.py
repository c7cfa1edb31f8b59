"""per_class.csv against CSV (formula) injection: class names come from annotation files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from videotrain.metrics.eval_report import write_eval_report

# a spreadsheet runs each of the first six as a formula; the last two are plain names
FORMULAS = ['=HYPERLINK("http://x")', "+1", "-cmd", "@SUM(A1)", "\tTAB", "\rCR"]
NAMES = [*FORMULAS, "walking", "high-jump"]


def test_per_class_csv_quotes_names_a_spreadsheet_would_run(tmp_path: Path) -> None:
    """Text cells (class_name, most_confused_with) that start with ``= + - @`` get a leading
    ``'``; a name holding a control character (a tab, a carriage return) is escaped whole
    (``repr``, which starts with a quote, so no spreadsheet runs it); other names and every
    number are written as they are."""
    k = len(NAMES)
    confusion = 2 * torch.eye(k)
    confusion[k - 2, 0] = 1  # walking is taken once for the =HYPERLINK class
    confusion[0, k - 2] = 1  # and that class once for walking
    summary = {"video_top1": 0.9, "mean_class_acc": 0.9, "videos": 2 * k + 2, "clips": 1,
               "crops": 1, "aggregate": "mean", "dropped_classes": ["=1+1"]}
    files = write_eval_report(tmp_path, summary, confusion, NAMES)
    with open(files["per_class"], newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))

    assert [r["class_name"] for r in rows] == (
        [f"'{n}" for n in FORMULAS[:4]] + [repr(n) for n in FORMULAS[4:]] + ["walking", "high-jump"])
    by_name = {r["class_name"]: r for r in rows}
    assert by_name["walking"]["most_confused_with"] == "'" + FORMULAS[0]
    assert by_name["'" + FORMULAS[0]]["most_confused_with"] == "walking"
    # numbers are unchanged
    assert [r["class_index"] for r in rows] == [str(i) for i in range(k)]
    assert [(r["videos"], r["correct"], r["confused_videos"]) for r in rows] == (
        [("3", "2", "1")] + [("2", "2", "0")] * (k - 3) + [("3", "2", "1"), ("2", "2", "0")])
    assert [r["top1"] for r in rows] == ["0.6667"] + ["1.0000"] * (k - 3) + ["0.6667", "1.0000"]
    assert json.loads(Path(files["eval"]).read_text())["dropped_classes"] == ["=1+1"]


def test_names_with_control_characters_never_reach_the_files_raw(tmp_path: Path) -> None:
    """A class name from a dataset's files with a newline, a terminal escape or a huge length
    is escaped and cut in per_class.csv and on the confusion plot's axes."""
    names = ["ok", "two\nlines", "\x1b[31mred", "x" * 5000]
    confusion = torch.eye(len(names))
    summary = {"video_top1": 1.0, "mean_class_acc": 1.0, "videos": 4, "clips": 1, "crops": 1,
               "aggregate": "mean", "dropped_classes": []}
    files = write_eval_report(tmp_path, summary, confusion, names)
    text = Path(files["per_class"]).read_text(encoding="utf-8")
    assert "\x1b" not in text and "two\nlines" not in text and "x" * 200 not in text
    with open(files["per_class"], newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["class_name"] for r in rows][:3] == ["ok", repr("two\nlines"), repr("\x1b[31mred")]
    assert len(rows[3]["class_name"]) <= 100
