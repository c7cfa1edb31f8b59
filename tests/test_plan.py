"""``python -m videotrain.plan``: prints the plan and writes plan.json; infeasible budgets fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from videotrain.plan import main

SMALL = ["data.batch_size=1", "data.num_frames=2", "data.crop_size=32", "memory=recompute"]


def test_plan_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["--out", str(out), *SMALL, "memory.policy=optimal", "memory.budget_frac=0.8"]) == 0
    text = capsys.readouterr().out
    for word in ("estimated peak", "estimated overhead", "e2e peak", "smallest budget", "segment  0"):
        assert word in text
    report = json.loads(out.read_text())
    assert report["input_shape"] == [2, 3, 32, 32]
    assert report["estimated_peak_bytes"] <= 0.8 * report["e2e_peak_bytes"]
    assert report["smallest_feasible_bytes"] <= report["estimated_peak_bytes"]
    assert sum(len(s["nodes"]) for s in report["segments"]) == report["vertices"]
    # a real backbone has more than 16 vertices: rounded costs, so the plan says it is approximate
    assert report["vertices"] > 16 and report["exact_family"] and report["exact"] is False
    assert "approximate plan: it may recompute more than the optimum" in text


def test_plan_cli_infeasible_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--out", str(tmp_path / "p.json"), *SMALL, "memory.policy=optimal", "memory.budget_mb=0.0001"])
    assert rc == 2
    assert "smallest feasible budget" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


AUTO = ["data.batch_size=1", "data.num_frames=2", "data.crop_size=32", "device=cpu", "memory=auto"]


def test_plan_cli_auto_prints_the_decision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["--out", str(out), *AUTO, "memory.budget_mb=100000"]) == 0  # above the e2e peak
    text = capsys.readouterr().out
    for word in ("| plan |", "estimated peak MB", "+ headroom MB", "relative cost", "| e2e |",
                 "**chosen**", "chosen: e2e fits"):
        assert word in text
    report = json.loads(out.read_text())
    assert report["chosen"] == "e2e" and report["budget_mb"] == 100000
    assert {c["kind"] for c in report["candidates"]} >= {"e2e", "recompute", "sbp"}


def test_plan_cli_auto_impossible_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--out", str(tmp_path / "p.json"), *AUTO, "memory.budget_mb=0.0001"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no plan fits the budget of 0.0 MB" in err and "smallest budget that would work" in err
    assert not (tmp_path / "p.json").exists()


def test_auto_under_bf16_with_too_small_a_budget_says_no_plan_fits(tmp_path, capsys) -> None:
    """Recompute candidates are planned inside their bf16 estimates; one whose plan has no room
    is skipped, and the decision ends in the "no plan fits" table (status 2), not an
    InfeasibleBudget from the middle of it."""
    out = tmp_path / "auto.json"
    code = main(["--out", str(out), "memory=auto", "memory.budget_mb=11.8", "model/backbone=resnet10",
                 "data.batch_size=1", "data.num_frames=4", "data.crop_size=32", "device=cpu",
                 "trainer.precision=bf16", "logger.wandb.mode=disabled"])
    assert code == 2
    assert "no plan fits the budget of 11.8 MB" in capsys.readouterr().err
