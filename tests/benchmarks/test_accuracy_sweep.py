"""The accuracy sweep (benchmarks/conf: a Hydra multirun) and its equal-time rows
(benchmarks/equal_time.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.utils import instantiate

from benchmarks import equal_time
from videotrain.config.build import compose_cfg

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "benchmarks" / "conf"
SCRIPT = ROOT / "scripts" / "summarize_sweep.py"
SWEEP = yaml.safe_load((CONF / "sweep" / "accuracy.yaml").read_text())
ROWS = SWEEP["hydra"]["sweeper"]["params"]["row"].split(",")
# what each row builds: (strategy name, keep ratio, policy)
EXPECTED = {"e2e": ("e2e", None, None), "sbp-frame-0.5": ("sbp", 0.5, None),
            "sbp-frame-0.25": ("sbp", 0.25, None), "frame_dropout-0.5": ("frame_dropout", 0.5, None),
            "frame_dropout-0.25": ("frame_dropout", 0.25, None),
            "recompute-optimal": ("recompute", None, "optimal")}


def test_every_row_file_is_swept_and_every_swept_row_has_a_file() -> None:
    assert sorted(ROWS) == sorted(p.stem for p in (CONF / "row").glob("*.yaml")) == sorted(EXPECTED)
    params = SWEEP["hydra"]["sweeper"]["params"]
    assert params["data.synthetic.task"].split(",") == ["direction", "rotation", "order", "speed"]
    assert params["seed"] == "0,1,2"


@pytest.mark.parametrize("row", sorted(EXPECTED))
def test_each_row_composes_with_the_sweep_and_builds_its_strategy(row: str) -> None:
    cfg = compose_cfg(equal_time.sweep_overrides(row, ["data.synthetic.task=order"]))
    # the sweep's recipe (256 videos per class, 2 epochs at lr 3e-4, validation at the end)
    assert cfg.data.synthetic.train_per_class == 256 and cfg.data.synthetic.task == "order"
    assert cfg.trainer.max_epochs == 2 == cfg.trainer.val_every_n_epochs
    assert cfg.optim.lr == pytest.approx(3e-4)
    strategy = instantiate(cfg.memory)
    name, keep, mode = EXPECTED[row]
    assert type(strategy).__name__ == {"e2e": "EndToEnd", "sbp": "StochasticBackprop",
                                       "frame_dropout": "FrameDropout",
                                       "recompute": "Recompute"}[name], row
    if keep is not None:
        assert strategy.keep_ratio == keep
    if mode == "optimal":
        assert cfg.memory.policy == "optimal"


def test_at_time_steps_and_row_files(tmp_path: Path) -> None:
    times = {"e2e": 0.6, "sbp-frame-0.5": 0.4, "slow": 6000.0}
    assert equal_time.at_time_steps(times, 256) == {"sbp-frame-0.5": 384, "slow": 1}
    name = equal_time.write_row(tmp_path, "sbp-frame-0.5", 384, per_epoch=128)
    assert name == "sbp-frame-0.5-at-time"
    # in either order: a multirun job lists the swept row before +sweep=accuracy
    for order in (["+sweep=accuracy", f"row={name}"], [f"row={name}", "+sweep=accuracy"]):
        cfg = compose_cfg([f"hydra.searchpath=[file://{CONF},file://{tmp_path / 'conf'}]", *order])
        # the row's own memory settings, and e2e's wall-clock time in steps (the row's
        # max_epochs wins over the sweep's 2)
        assert cfg.memory.keep_ratio == 0.5 and cfg.memory._target_.endswith("StochasticBackprop")
        assert cfg.trainer.max_steps == 384 and cfg.trainer.max_epochs == 3


def test_step_times_are_kept_and_a_later_row_is_scaled_to_its_e2e(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[list[str]] = []

    def fake(rows: list[str], extra: list[str], threads: int, steps: int,
             warmup: int) -> dict[str, float]:
        measured.append(rows)
        assert (steps, warmup) == (20, 5)
        table = {"e2e": 2.0, "sbp-frame-0.5": 1.0, "sbp-frame-0.25": 0.5}
        return {r: table[r] for r in rows}

    monkeypatch.setattr(equal_time, "measure_step_times", fake)
    assert equal_time.step_times(tmp_path, ["sbp-frame-0.5"], [], 1) == {
        "e2e": 2.0, "sbp-frame-0.5": 1.0}
    assert equal_time.step_times(tmp_path, ["sbp-frame-0.5"], [], 1)["e2e"] == 2.0
    assert measured == [["e2e", "sbp-frame-0.5"]]  # the second call measured nothing
    # a row added later is measured beside a new e2e and scaled to the kept one
    (tmp_path / "step_times.json").write_text(json.dumps({"step_s": {"e2e": 4.0, "sbp-frame-0.5": 2.0}}))
    got = equal_time.step_times(tmp_path, ["sbp-frame-0.5", "sbp-frame-0.25"], [], 1)
    assert got == {"e2e": 4.0, "sbp-frame-0.5": 2.0, "sbp-frame-0.25": 1.0}


def test_step_times_are_medians_of_interleaved_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round steps every row once (a load change reaches all rows alike); the warm-up
    steps run but are not timed; each row's time is its median."""
    clock = iter(range(1000))
    monkeypatch.setattr(equal_time.time, "perf_counter", lambda: float(next(clock)))
    calls: list[str] = []
    lengths = {"e2e": [5, 5, 1, 9, 2], "sbp": [7, 7, 3, 3, 4]}  # clock ticks per call

    def stepper(name: str):
        def step() -> None:
            calls.append(name)
            for _ in range(lengths[name][calls.count(name) - 1] - 1):
                next(clock)
        return step

    got = equal_time.interleaved_medians({"e2e": stepper("e2e"), "sbp": stepper("sbp")},
                                         steps=3, warmup=2)
    assert calls == ["e2e", "sbp"] * 5
    assert got == {"e2e": 2.0, "sbp": 3.0}  # medians of (1, 9, 2) and (3, 3, 4)


def test_measured_step_times_of_tiny_rows(tiny_synthetic_overrides) -> None:
    times = equal_time.measure_step_times(["e2e", "sbp-frame-0.5"], list(tiny_synthetic_overrides),
                                          threads=1, steps=2, warmup=1)
    assert sorted(times) == ["e2e", "sbp-frame-0.5"] and all(t > 0 for t in times.values())


def test_bad_arguments_are_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert equal_time.main(["--rows", "no-such-row"]) == 2
    assert capsys.readouterr().err.startswith("error: --rows no-such-row: no such row")
    assert equal_time.main(["--rows", "e2e"]) == 2
    capsys.readouterr()
    assert equal_time.main(["--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --steps 0 / --warmup 5:") and err.count("\n") == 1


@pytest.mark.parametrize("e2e", [1e308, 0.0, -1.0, "1.0", True, float("nan"), 10**400])
def test_kept_step_times_out_of_bounds_are_one_error_line(
        e2e: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A recorded step time that is no positive number of seconds within the bound (one that
    would overflow the step count, divide by zero or be a string) is refused naming the file
    and the key, before anything is measured or written."""
    record = tmp_path / "step_times.json"
    text = json.dumps({"step_s": {"e2e": 1.0, "sbp-frame-0.5": 0.5}}).replace("1.0", (
        str(e2e) if isinstance(e2e, int) and not isinstance(e2e, bool) else json.dumps(e2e)))
    record.write_text(text)
    assert equal_time.main(["--rows", "sbp-frame-0.5", "--out", str(tmp_path),
                            "--measure-only"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {record}") and "step_s.e2e" in err and err.count("\n") == 1
    assert "delete it to measure again" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_times.json"]
    assert record.read_text() == text


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_tiny_sweep_resumes_and_pairs_with_e2e(tmp_path: Path, tiny_synthetic_overrides,
                                               shrink_overrides, tiny_model_overrides) -> None:
    """Two rows x two seeds of the sweep on a tiny model; run again, every job resumes finished
    (results unchanged); the summary pairs each SBP job with e2e of its seed."""
    sweep = tmp_path / "acc"
    tiny = [*tiny_synthetic_overrides, *shrink_overrides, *tiny_model_overrides,
            "data.synthetic.task=direction", "trainer.max_steps=2", "trainer.max_epochs=1",
            "trainer.val_every_n_epochs=1", "data.batch_size=4"]
    args = ["-m", "videotrain", "-m", "--config-dir", str(CONF), "+sweep=accuracy",
            "row=e2e,sbp-frame-0.5", "seed=0,1", f"hydra.sweep.dir={sweep}", *tiny]
    done = _cli(args, tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    jobs = sorted(str(p.parent.relative_to(sweep)) for p in sweep.rglob("results.json"))
    assert jobs == ["direction/e2e/seed0", "direction/e2e/seed1",
                    "direction/sbp-frame-0.5/seed0", "direction/sbp-frame-0.5/seed1"]
    before = {j: (sweep / j / "results.json").read_bytes() for j in jobs}
    again = _cli(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("resumed from") + again.stdout.count("resumed from") == 4
    assert {j: (sweep / j / "results.json").read_bytes() for j in jobs} == before

    out = tmp_path / "report"
    summary = _cli([str(SCRIPT), str(sweep), "--out", str(out)], tmp_path)
    assert summary.returncode == 0, summary.stderr
    assert (out / "summary.md").is_file() and not (sweep / "summary.md").exists()
    paired = summary.stdout.split("## Paired against e2e")[1]
    line = next(ln for ln in paired.splitlines() if ln.startswith("| sbp-frame-0.5 |"))
    assert "(n=2)" in line
    e2e = {s: json.loads(before[f"direction/e2e/seed{s}"])["val_top1"] for s in (0, 1)}
    sbp = {s: json.loads(before[f"direction/sbp-frame-0.5/seed{s}"])["val_top1"] for s in (0, 1)}
    diff = 100 * sum(sbp[s] - e2e[s] for s in (0, 1)) / 2
    assert f"{diff:+.1f}" in line.split("|")[-2]


def test_equal_time_trains_its_rows_for_the_sized_steps(tmp_path: Path, tiny_synthetic_overrides,
                                                        shrink_overrides, tiny_model_overrides) -> None:
    """``python -m benchmarks.equal_time`` with kept step times (e2e 1.0 s, the row 0.5 s): the
    row's jobs train twice e2e's steps, in its own folder, named ``ROW-at-time``."""
    out = tmp_path / "time"
    out.mkdir()
    (out / "step_times.json").write_text(json.dumps({"step_s": {"e2e": 1.0, "sbp-frame-0.5": 0.5}}))
    tiny = [*tiny_synthetic_overrides, *shrink_overrides, *tiny_model_overrides,
            "data.synthetic.task=direction", "data.batch_size=4", "seed=0"]
    per_epoch, steps = equal_time.e2e_steps(tiny)
    done = _cli(["-m", "benchmarks.equal_time", "--rows", "sbp-frame-0.5", "--out", str(out), *tiny],
                tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert f"sbp-frame-0.5: 0.500 s a step against e2e's 1.000 s: {2 * steps} steps" in done.stdout
    result = json.loads((out / "direction" / "sbp-frame-0.5-at-time" / "seed0" / "results.json").read_text())
    assert result["steps"] == 2 * steps and result["memory"]["keep_ratio"] == 0.5
    assert result["epochs"] == -(-2 * steps // per_epoch)
