"""Hydra multirun sweeps: ``+sweep=keep_ratio`` with the basic launcher (then
``scripts/summarize_sweep.py`` on it) and with ``hydra/launcher=submitit_local``.

The tiny settings go into a throw-away ``+exp=tiny`` file (``--config-dir``), so that job
folders are named by the overrides a user would type, not by twenty test-only ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import videotrain.config.build as builder

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "summarize_sweep.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def tiny_exp(tmp_path: Path, tiny_synthetic_overrides, shrink_overrides,
             tiny_model_overrides) -> Path:
    """A config dir holding ``exp/tiny.yaml``: the tiny data and model, 2 steps."""
    body: dict = {}
    values = [o for o in (*tiny_synthetic_overrides, *shrink_overrides, *tiny_model_overrides)
              if "/" not in o.split("=")[0] and not o.startswith("logger.")]
    values += ["trainer.max_steps=2", "data.batch_size=4"]
    for item in values:
        key, value = item.split("=", 1)
        node = body
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    conf = tmp_path / "conf"
    (conf / "exp").mkdir(parents=True)
    text = "# @package _global_\ndefaults:\n  - override /model/backbone: vit_tiny\n\n"
    (conf / "exp" / "tiny.yaml").write_text(text + yaml.safe_dump(body))
    return conf


def videotrain_cli(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "videotrain", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(table: str) -> list[list[str]]:
    """The rows of the per-job table (the paired tables follow it)."""
    lines = [ln for ln in table.split("\n## ")[0].splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


EXPECTED_JOBS = ["0_+exp=tiny,memory.keep_ratio=0.5,memory=sbp",
                 "1_+exp=tiny,memory.keep_ratio=1.0,memory=sbp"]


def check_jobs(sweep: Path) -> list[dict]:
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert jobs == EXPECTED_JOBS, jobs
    results = [json.loads((sweep / j / "results.json").read_text()) for j in jobs]
    assert [r["memory"]["keep_ratio"] for r in results] == [0.5, 1.0]
    assert all(r["memory_strategy"] == "sbp" and r["steps"] == 2 for r in results)
    return results


def test_keep_ratio_sweep_then_summary(tiny_exp: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # the versioned sweep, narrowed to two values on the command line; wandb offline, to
    # check that every job finishes its own wandb run
    done = videotrain_cli(["--config-dir", str(tiny_exp), "-m", "+exp=tiny", "+sweep=keep_ratio",
                           "memory.keep_ratio=0.5,1.0", "logger.wandb.mode=offline",
                           f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    check_jobs(sweep)
    for job in EXPECTED_JOBS:
        runs = list((sweep / job / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, (job, runs)
        assert list(runs[0].glob("run-*.wandb")), job
        assert "finishing run" in (runs[0] / "logs" / "debug.log").read_text(), job

    summary = subprocess.run([sys.executable, str(SCRIPT), str(sweep)], capture_output=True,
                             text=True, timeout=300)
    assert summary.returncode == 0, summary.stderr
    rows = table_rows(summary.stdout)
    assert [(r[0], r[1], r[2], r[3], r[10]) for r in rows] == [
        # the granularity column is for sweeps of before 0.2.0 (block SBP): empty here
        (EXPECTED_JOBS[0], "sbp", "–", "0.50", "ok"),
        (EXPECTED_JOBS[1], "sbp", "–", "1.00", "ok")]
    assert all(0.0 <= float(r[4]) <= 1.0 for r in rows)  # val top-1 of each job
    assert table_rows((sweep / "summary.md").read_text()) == rows
    png = sweep / "summary.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


def test_a_later_job_of_a_multirun_warns_that_its_cpu_peak_reads_high(tiny_exp: Path,
                                                                      tmp_path: Path) -> None:
    """The basic launcher runs every job in one process: after job 0's unmetered steps (past
    ``trainer.cpu_metered_steps``), job 1's CPU meter reads high, and its log says so."""
    sweep = tmp_path / "sweep"
    done = videotrain_cli(["--config-dir", str(tiny_exp), "-m", "+exp=tiny", "seed=0,1",
                           "trainer.max_steps=3", "trainer.cpu_metered_steps=2",
                           "logger.wandb.mode=disabled", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    jobs = sorted(j for j in sweep.iterdir() if j.is_dir() and not j.name.startswith("."))
    assert [j.name.split(",")[:2] for j in jobs] == [["0_+exp=tiny", "seed=0"], ["1_+exp=tiny", "seed=1"]]
    logs = ["".join(p.read_text() for p in job.glob("*.log")) for job in jobs]
    assert all("training" in text for text in logs)  # each job's own log
    assert ["CPU peak memory reads high" in text for text in logs] == [False, True]


def test_submitit_local_launcher_runs_the_sweep(tiny_exp: Path, tmp_path: Path) -> None:
    # needs hydra-submitit-launcher (the dev and slurm extras); no skip: CI installs it
    sweep = tmp_path / "sweep"
    done = videotrain_cli(["--config-dir", str(tiny_exp), "-m", "+exp=tiny", "memory=sbp",
                           "memory.keep_ratio=0.5,1.0", "hydra/launcher=submitit_local",
                           "hydra.launcher.timeout_min=10", "logger.wandb.mode=disabled",
                           f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    check_jobs(sweep)
    # each job ran in its own submitit process: the launcher left its logs per job
    assert len(list((sweep / ".submitit").glob("*/*_log.out"))) == 2


@pytest.mark.slow  # the SLURM code path (tasks -> DDP ranks) without SLURM; ~1 min on 2 cores
def test_submitit_tasks_become_ddp_ranks(tiny_exp: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = videotrain_cli(["--config-dir", str(tiny_exp), "-m", "+exp=tiny", "data.batch_size=2",
                           "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                           "hydra.launcher.timeout_min=10", "logger.wandb.mode=disabled",
                           f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    found = list(sweep.rglob("results.json"))
    assert [p.parent.name for p in found] == ["0_+exp=tiny,data.batch_size=2"]
    results = json.loads(found[0].read_text())
    assert results["world_size"] == 2 and results["global_batch_size"] == 4
    assert results["replicas_in_sync"] and len(set(results["param_digests"])) == 1
    assert len(list((sweep / ".submitit").glob("*/*_log.out"))) == 2  # one log per task


def test_job_dirname_stays_a_short_distinct_name() -> None:
    assert builder.job_dirname("memory=sbp,model/backbone=vit_tiny") == "memory=sbp,model_backbone=vit_tiny"
    long_a, long_b = "x=" + "a" * 300, "x=" + "a" * 299 + "b"
    assert len(builder.job_dirname(long_a)) == 160
    assert builder.job_dirname(long_a) != builder.job_dirname(long_b)
