"""The accuracy suite's bookkeeping (``videotrain.bench.accuracy``): rows, paired statistics and
the report; the training runs themselves are ordinary ``python -m videotrain`` runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from videotrain.bench.accuracy import (
    ROWS,
    figure,
    mean_ci,
    render,
    rows_for,
    run_overrides,
    summarize,
    t95,
    train_one,
)


def test_t95_and_mean_ci_by_hand() -> None:
    assert t95(2) == 4.303 and t95(11) == 2.201 and t95(21) == 2.086 and t95(500) == 1.96
    m, sd, half = mean_ci([0.80, 0.90, 1.00])
    assert m == pytest.approx(0.9) and sd == pytest.approx(0.1)
    assert half == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert math.isnan(mean_ci([0.5])[2])


def test_rows_follow_whether_the_backbone_mixes_frames() -> None:
    names = [r.name for r in rows_for(["model.backbone.temporal_shift=0"])]
    assert "sbp-frame-0.5" in names and "sbp-block-0.5" not in names and names[0] == "e2e"
    shifted = [r.name for r in rows_for([])]  # the default resnet10 shifts: both granularities
    assert "sbp-block-0.25" in shifted and "sbp-frame-0.25" in shifted
    assert {"frame_dropout-0.5", "checkpoint-optimal"} <= set(shifted)
    ov = run_overrides("order", ROWS[1], 2, ["optim.lr=0.002"])
    assert "data.synthetic.task=order" in ov and "seed=2" in ov and "memory.keep_ratio=0.5" in ov
    assert ov.index("memory=sbp") < ov.index("optim.lr=0.002")  # the user's overrides come last


def test_a_run_composes_with_the_suite_recipe_and_the_user_overrides_win() -> None:
    from videotrain.build import compose_cfg

    cfg = compose_cfg(run_overrides("speed", ROWS[0], 1, []))
    assert (cfg.data.synthetic.task, cfg.data.synthetic.train_per_class, cfg.trainer.max_epochs,
            cfg.optim.lr, cfg.seed) == ("speed", 256, 2, 3e-4, 1)
    cfg = compose_cfg(run_overrides("speed", ROWS[0], 1, ["optim.lr=1e-3", "trainer.max_epochs=8"]))
    assert (cfg.optim.lr, cfg.trainer.max_epochs) == (1e-3, 8)


def _finished(run_dir: Path, overrides: list[str]) -> None:
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (run_dir / "results.json").write_text(json.dumps({"val_top1": 0.5}))


def test_a_finished_run_of_other_overrides_stops_the_suite_before_any_run(
    tmp_path: Path, fake_suite: list[tuple[str, int]]
) -> None:
    import videotrain.bench.accuracy as acc

    runs = tmp_path / "runs" / "order"
    ov = run_overrides("order", ROWS[0], 0, [])
    # the same run, its overrides in another order and 3e-4 spelled 0.0003: reused
    _finished(runs / "e2e" / "seed0", [o.replace("3e-4", "0.0003") for o in reversed(ov)])
    assert acc.stale_run(runs / "e2e" / "seed0", ov) is None
    # a run of the older recipe (the default job's 64 videos at lr 1e-3, 8 epochs)
    sbp = ROWS[3]
    _finished(runs / sbp.name / "seed0",
              [o for o in run_overrides("order", sbp, 0, []) if o not in acc.SUITE_RECIPE])
    with pytest.raises(ValueError, match=r"sbp-block-0.5/seed0 holds a finished run with other "
                       r"overrides \(data.synthetic.train_per_class: \(not set\) -> 256; "
                       r"optim.lr: \(not set\) -> 3e-4; trainer.max_epochs: \(not set\) -> 2\)"):
        _suite(tmp_path)
    assert fake_suite == []  # nothing ran


def test_summary_pairs_rows_with_e2e_of_the_same_task_and_seed() -> None:
    runs = []
    for task, base in (("order", 0.90), ("speed", 0.70)):
        for seed, jitter in enumerate((0.0, 0.02, -0.02)):
            runs.append({"task": task, "row": "e2e", "seed": seed, "val_top1": base + jitter,
                         "param_digests": {"w": f"{task}{seed}"}})
            runs.append({"task": task, "row": "sbp-frame-0.5", "seed": seed,
                         "val_top1": base + jitter - 0.01 * (seed + 1), "param_digests": {"w": "x"}})
            runs.append({"task": task, "row": "checkpoint-optimal", "seed": seed,
                         "val_top1": base + jitter, "param_digests": {"w": f"{task}{seed}"}})
    runs.append({"task": "speed", "row": "frame_dropout-0.5", "seed": 0, "error": "not run"})
    rows = [r for r in ROWS if r.name in ("e2e", "sbp-frame-0.5", "checkpoint-optimal", "frame_dropout-0.5")]
    summary = summarize(runs, rows)
    order_sbp = next(p for p in summary["per_task"] if p["task"] == "order" and p["row"] == "sbp-frame-0.5")
    assert order_sbp["diff"] == pytest.approx(-0.02)  # mean of -0.01, -0.02, -0.03
    assert order_sbp["diff_ci95"] == pytest.approx(4.303 * 0.01 / math.sqrt(3))
    overall = {o["row"]: o for o in summary["overall"]}
    assert overall["sbp-frame-0.5"]["pairs"] == 6 and overall["sbp-frame-0.5"]["diff"] == pytest.approx(-0.02)
    assert overall["e2e"]["mean"] == pytest.approx(0.80)
    assert overall["checkpoint-optimal"]["weights_equal_e2e"] and not overall["sbp-frame-0.5"]["weights_equal_e2e"]
    assert "frame_dropout-0.5" not in overall  # a run that did not finish is not a zero
    table = render(summary, {"e2e": 1.0, "sbp-frame-0.5": 0.55, "checkpoint-optimal": 0.4},
                   {"command": "x", "machine": "m", "seeds": [0, 1, 2]})
    assert "| sbp-frame-0.5 | 0.55 |" in table and "-2.0 ±" in table and "weights identical to e2e" in table


def test_one_seed_is_reported_without_a_spread() -> None:
    runs = [{"task": "order", "row": row, "seed": 0, "val_top1": acc}
            for row, acc in (("e2e", 0.9), ("sbp-block-0.5", 0.85))]
    summary = summarize(runs, [r for r in ROWS if r.name in ("e2e", "sbp-block-0.5")])
    table = render(summary, {"e2e": 1.0, "sbp-block-0.5": 0.86}, {"command": "x", "machine": "m", "seeds": [0]})
    assert "nan" not in table
    assert "| sbp-block-0.5 | 0.86 | 0.850 (Δ -5.0) | 0.850 | -5.0 (n=1) |" in table


def test_val_loss_is_paired_like_top1_and_tabled_below_it() -> None:
    # top-1 saturated at 1.000 on both rows: only the loss tells them apart
    runs = [{"task": "order", "row": row, "seed": seed, "val_top1": 1.0, "val_loss": loss}
            for seed in (0, 1, 2) for row, loss in (("e2e", 0.02 + 0.01 * seed), ("sbp-block-0.5", 0.05 + 0.01 * seed))]
    runs.append({"task": "speed", "row": "e2e", "seed": 0, "val_top1": 1.0})  # older than val_loss
    runs.append({"task": "speed", "row": "sbp-block-0.5", "seed": 0, "val_top1": 1.0, "val_loss": float("nan")})
    rows = [r for r in ROWS if r.name in ("e2e", "sbp-block-0.5")]
    top1, loss = summarize(runs, rows), summarize(runs, rows, "val_loss")
    assert {o["row"]: o["diff"] for o in top1["overall"]} == {"e2e": 0.0, "sbp-block-0.5": 0.0}
    sbp = next(o for o in loss["overall"] if o["row"] == "sbp-block-0.5")
    assert sbp["pairs"] == 3 and sbp["diff"] == pytest.approx(0.03) and sbp["mean"] == pytest.approx(0.06)
    assert {p["task"] for p in loss["per_task"]} == {"order"}  # no loss on speed: left out, not zero
    meta = {"command": "x", "machine": "m", "seeds": [0, 1, 2]}
    table = render(top1, {"e2e": 1.0, "sbp-block-0.5": 0.86}, meta, loss)
    top1_part, loss_part = table.split("Val loss")
    assert "| sbp-block-0.5 | 0.86 | 1.000 ± 0.000 (Δ +0.0 ± 0.0) |" in top1_part
    assert "| row | order | mean | Δ mean (95% CI) |" in loss_part
    assert "| sbp-block-0.5 | 0.060 ± 0.010 (Δ +0.030 ± 0.000) | 0.060 | +0.030 ± 0.000 (n=3) |" in loss_part
    assert "Val loss" not in render(top1, {"e2e": 1.0}, meta)


def test_the_plot_spans_chance_to_one_when_every_row_saturates() -> None:
    import matplotlib.pyplot as plt

    runs = [{"task": "order", "row": row, "seed": 0, "val_top1": acc}
            for row, acc in (("e2e", 1.0), ("sbp-block-0.5", 0.9922))]
    summary = summarize(runs, [r for r in ROWS if r.name in ("e2e", "sbp-block-0.5")])
    fig = figure(summary, {"e2e": 1.0, "sbp-block-0.5": 0.86})
    assert fig.axes[0].get_ylim() == pytest.approx((0.2, 1.02))  # not 0.99-1.0: one video is small
    plt.close(fig)
    runs.append({"task": "order", "row": "frame_dropout-0.25", "seed": 0, "val_top1": 0.1})
    summary = summarize(runs, [r for r in ROWS if r.name in ("e2e", "frame_dropout-0.25")])
    fig = figure(summary, {"e2e": 1.0, "frame_dropout-0.25": 0.26})
    assert fig.axes[0].get_ylim()[0] == pytest.approx(0.05)  # below chance: the axis goes down to it
    plt.close(fig)


def test_report_only_does_not_train(tmp_path: Path) -> None:
    assert train_one(tmp_path / "run", ["seed=0"], 1, 10, train=False) == {"error": "not run"}
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("keep", [False, True])
def test_a_finished_run_drops_its_checkpoints_a_failed_one_keeps_them_for_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    import subprocess

    import videotrain.bench.accuracy as acc

    def fake_run(cmd: list[str], returncode: int) -> subprocess.CompletedProcess:
        run_dir = Path(next(a for a in cmd if a.startswith("hydra.run.dir=")).partition("=")[2])
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / "step-00000256.ckpt").write_bytes(b"weights")
        if returncode == 0:
            (run_dir / "results.json").write_text(json.dumps({"val_top1": 0.5}))
        return subprocess.CompletedProcess(cmd, returncode, "", "boom")

    monkeypatch.setattr(acc.subprocess, "run", lambda cmd, **kw: fake_run(cmd, 0))
    res = train_one(tmp_path / "done", ["seed=0"], 1, 10, keep_checkpoints=keep)
    assert res["val_top1"] == 0.5 and (tmp_path / "done" / "results.json").exists()
    assert (tmp_path / "done" / "checkpoints" / "step-00000256.ckpt").exists() is keep
    monkeypatch.setattr(acc.subprocess, "run", lambda cmd, **kw: fake_run(cmd, 1))
    assert train_one(tmp_path / "failed", ["seed=0"], 1, 10, keep_checkpoints=keep) == {"error": "exit 1: boom"}
    assert (tmp_path / "failed" / "checkpoints" / "step-00000256.ckpt").exists()  # resumed from


@pytest.fixture
def fake_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """``run_accuracy_bench`` without training: the (row, threads) of every run it asks for."""
    import videotrain.bench.accuracy as acc

    seen: list[tuple[str, int]] = []

    def fake_train(run_dir: Path, overrides: list[str], threads: int, timeout: float,
                   train: bool = True, keep_checkpoints: bool = False) -> dict:
        seen.append((run_dir.parent.name, threads))
        return {"error": "not run"}

    monkeypatch.setattr(acc, "train_one", fake_train)
    monkeypatch.setattr(acc, "stored_activation_bytes", lambda overrides: 1)
    return seen


def _suite(tmp_path: Path, **kw) -> None:
    from videotrain.bench.accuracy import run_accuracy_bench

    run_accuracy_bench(out=tmp_path / "out", tasks=["order"], seeds=[0], runs_dir=tmp_path / "runs", **kw)


def test_threads_per_run_default_to_the_cores_shared_among_jobs(
    tmp_path: Path, fake_suite: list[tuple[str, int]]
) -> None:
    import os

    _suite(tmp_path, only=["e2e"], jobs=1, threads=3)  # two suites side by side: 1 thread each, say
    _suite(tmp_path, only=["e2e"], jobs=2)
    assert fake_suite == [("e2e", 3), ("e2e", max(1, (os.cpu_count() or 1) // 2))]


def test_sbp_settings_variants_run_only_when_named(tmp_path: Path, fake_suite: list[tuple[str, int]]) -> None:
    from videotrain.build import compose_cfg

    _suite(tmp_path, jobs=1)
    default = [name for name, _ in fake_suite]
    assert "sbp-block-0.5" in default and not any(n.endswith(("-random", "-unscaled", "-inverse_keep")) for n in default)
    fake_suite.clear()
    _suite(tmp_path, jobs=1, only=["sbp-block-0.5-*"])
    assert [name for name, _ in fake_suite] == ["e2e", "sbp-block-0.5-random", "sbp-block-0.5-unscaled"]
    meta = json.loads((tmp_path / "out" / "accuracy.json").read_text())["meta"]
    # the header's command reproduces the run: every flag not at its default, --jobs and folders too
    assert meta["command"] == ("python -m videotrain.bench --suite accuracy --tasks order --seeds 0 "
                               f"--only 'sbp-block-0.5-*' --jobs 1 --runs-dir {tmp_path / 'runs'} "
                               f"--out {tmp_path / 'out'}")
    assert ", 1 run at a time, " in meta["machine"]
    variants = {r.name: r for r in ROWS if not r.default}
    # {frame, block} x {0.5, 0.25} x {random, the other grad_scale}
    assert len(variants) == 8 and "sbp-frame-0.5-inverse_keep" in variants
    cfg = compose_cfg(list(variants["sbp-block-0.25-unscaled"].overrides))
    assert cfg.memory.grad_scale == "none" and cfg.memory.keep_ratio == 0.25
    assert compose_cfg(list(variants["sbp-frame-0.25-inverse_keep"].overrides)).memory.grad_scale == "inverse_keep"
    cfg = compose_cfg(list(variants["sbp-frame-0.5-random"].overrides))
    assert cfg.memory.sampler == "random" and cfg.memory.granularity == "frame"


def test_a_suite_with_no_finished_run_plots_without_a_legend_warning(
    tmp_path: Path, fake_suite: list[tuple[str, int]]
) -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _suite(tmp_path, only=["e2e"], jobs=1)
    assert (tmp_path / "out" / "accuracy.png").is_file()
    assert not [w for w in caught if "No artists with labels" in str(w.message)]


def test_only_or_tasks_naming_nothing_is_an_error_before_any_run(
    tmp_path: Path, fake_suite: list[tuple[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A renamed row (``sbp-block-0.5-inverse_keep`` became the default ``sbp-block-0.5``) once
    made a queued suite run e2e only, silently."""
    from videotrain.bench.cli import main

    with pytest.raises(ValueError, match="sbp-block-0.5-inverse_keep: no such row"):
        _suite(tmp_path, only=["e2e", "sbp-block-0.5-inverse_keep"])
    with pytest.raises(ValueError, match="sbp-block-0.5: no such row"):  # a per-frame model
        _suite(tmp_path, only=["sbp-block-0.5"], extra=["model.backbone.temporal_shift=0"])
    assert main(["--suite", "accuracy", "--tasks", "spin", "--out", str(tmp_path / "o"),
                 "--runs-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --tasks spin: no such task; tasks: direction, rotation, order, speed")
    assert fake_suite == [] and not (tmp_path / "runs").exists()


def test_report_only_lists_runs_not_run_yet_and_exits_0(
    tmp_path: Path, fake_suite: list[tuple[str, int]], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--report-only`` of a partial suite: the runs still to do are not failures."""
    import videotrain.bench.accuracy as acc
    from videotrain.bench.cli import main

    args = ["--suite", "accuracy", "--tasks", "order", "--seeds", "0", "--only", "e2e",
            "--out", str(tmp_path / "o"), "--runs-dir", str(tmp_path / "r")]
    assert main([*args, "--report-only"]) == 0
    assert "1 run(s) not run yet: order/e2e/seed0" in capsys.readouterr().err
    monkeypatch.setattr(acc, "train_one", lambda *a, **k: {"error": "exit 1: boom"})
    assert main(args) == 1  # a run that ended without results: a failure
    assert "1 run(s) failed: order/e2e/seed0" in capsys.readouterr().err


def test_equal_time_rows_train_for_e2e_s_time_and_resume_with_the_same_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--equal-time``: a row whose step takes 0.8 of e2e's trains 256 / 0.8 = 320 steps (3 epochs
    of 128, the schedule over 320 steps), one at 2x e2e's 128; e2e keeps its 256. The step times are
    measured once and kept in the runs folder, so a resumed suite trains the same steps."""
    import videotrain.bench.accuracy as acc
    from videotrain.build import compose_cfg
    from videotrain.engine.trainer import TrainerSettings, plan_steps

    runs: dict[str, list[str]] = {}
    measured: list[list[str]] = []

    def fake_train(run_dir: Path, overrides: list[str], *a, **k) -> dict:
        runs[run_dir.parent.name] = overrides
        return {"error": "not run"}

    def fake_times(rows, extra, threads, **k):
        measured.append([r.name for r in rows])
        return {"e2e": 1.0, "sbp-frame-0.5": 0.8, "sbp-frame-0.25": 2.0}

    monkeypatch.setattr(acc, "train_one", fake_train)
    monkeypatch.setattr(acc, "stored_activation_bytes", lambda overrides: 1)
    monkeypatch.setattr(acc, "measure_step_times", fake_times)
    _suite(tmp_path, jobs=1, only=["sbp-frame-0.5", "sbp-frame-0.25"], equal_time=True)
    assert measured == [["e2e", "sbp-frame-0.5", "sbp-frame-0.25"]]
    assert set(runs) == {"e2e", "sbp-frame-0.5@time", "sbp-frame-0.25@time"}
    assert not any(o.startswith("trainer.max_steps") for o in runs["e2e"])
    for name, steps, epochs in (("sbp-frame-0.5@time", 320, 3), ("sbp-frame-0.25@time", 128, 1)):
        cfg = compose_cfg(runs[name])
        assert (cfg.trainer.max_steps, cfg.trainer.max_epochs) == (steps, epochs)
        settings = TrainerSettings(max_epochs=cfg.trainer.max_epochs, max_steps=cfg.trainer.max_steps)
        assert plan_steps(128, settings) == (128, steps)  # what the run's schedule spans
    report = json.loads((tmp_path / "out" / "accuracy.json").read_text())
    assert report["meta"]["equal_time"]["steps"] == {"e2e": 256, "sbp-frame-0.5@time": 320,
                                                     "sbp-frame-0.25@time": 128}
    assert report["meta"]["command"].startswith("python -m videotrain.bench --suite accuracy --equal-time")
    assert "Equal time:" in (tmp_path / "out" / "accuracy.md").read_text()
    first = dict(runs)
    runs.clear()
    from videotrain.bench.cli import main

    assert main(["--suite", "accuracy", "--equal-time", "--tasks", "order", "--seeds", "0", "--jobs", "1",
                 "--only", "sbp-frame-0.5,sbp-frame-0.25", "--out", str(tmp_path / "out"),
                 "--runs-dir", str(tmp_path / "runs"), "--report-only"]) == 0
    assert len(measured) == 1 and runs == first  # resumed: not measured again, the same steps


def test_step_times_are_measured_for_every_row() -> None:
    from videotrain.bench.accuracy import measure_step_times

    small = ["data.batch_size=2", "data.num_frames=4", "data.crop_size=32"]
    rows = [r for r in ROWS if r.name in ("e2e", "sbp-frame-0.25")]
    times = measure_step_times(rows, small, threads=1, steps=1, warmup=1)
    assert set(times) == {"e2e", "sbp-frame-0.25"} and all(t > 0 for t in times.values())
