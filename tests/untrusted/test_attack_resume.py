"""The legitimate path the checks must keep open: a run under the default logger (wandb
offline, ``configs/logger/wandb.yaml``: its run folder under ``RUN/wandb/`` holds wandb's own
links, ``debug.log`` and ``debug-internal.log``, and ``logs/debug-core.log`` into wandb's cache)
stopped by SIGTERM after its step-2 checkpoint (exit 75, as a scheduler's preemption) or killed
with SIGKILL after it (the OOM killer, a lost node), then the same command again, as a
requeue does: it resumes, and its per-step losses are an uninterrupted run's, bit for bit.
Fresh interpreters: the signal, the exit status and wandb's service process are the real ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXIT_PREEMPTED = 75
STEPS = 6  # checkpoints at steps 2, 4 and 6 (and at the epoch end, step 4)


def _losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]
    return [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]


@pytest.fixture(scope="module")
def command(train_args) -> list[str]:
    """The run's command line with the default logger: wandb offline, as shipped."""
    args = [a for a in train_args(trainer__max_steps=STEPS, trainer__max_epochs=2,
                                  trainer__checkpoint_every_n_steps=2)
            if not a.startswith("logger.wandb.mode=")]
    return [sys.executable, "-m", "videotrain", *args]


def _env(tmp: Path) -> dict[str, str]:
    # the suite disables wandb (WANDB_MODE); WANDB_SERVICE: a service an earlier test's wandb
    # run started in this worker, whose streams outlive a killed child ("run ID in use")
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_SERVICE")}
    return {**env, "HOME": str(tmp), "WANDB_DIR": str(tmp / "wandb-cache"),
            "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
            "WANDB_CONFIG_DIR": str(tmp / "wandb-config")}


def _run(command: list[str], run: Path, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*command, f"hydra.run.dir={run}"], cwd=tmp, env=_env(tmp),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def uninterrupted(command: list[str], tmp_path_factory: pytest.TempPathFactory) -> list:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    done = _run(command, tmp / "run", tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp / "run" / "wandb").is_dir(), "the default logger did not run"
    return _losses(tmp / "run")


def _stop_after_step_2(command: list[str], run: Path, tmp: Path, signum: int) -> int:
    """Start the run, wait for its step-2 checkpoint, send ``signum`` (SIGKILL: to the whole
    process group, wandb's service too, as a lost node loses it); the exit status."""
    proc = subprocess.Popen([*command, f"hydra.run.dir={run}"], cwd=tmp, env=_env(tmp),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while not (run / "checkpoints" / "step-00000002.ckpt").is_file():
            assert proc.poll() is None, "the run ended before its step-2 checkpoint"
            assert time.monotonic() < deadline, "no step-2 checkpoint"
            time.sleep(0.01)
        if signum == signal.SIGKILL:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.send_signal(signum)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_run_resumes_with_the_same_command(signum: int, command: list[str],
                                                     uninterrupted: list, tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = _stop_after_step_2(command, run, tmp_path, signum)
    assert code == (EXIT_PREEMPTED if signum == signal.SIGTERM else -signal.SIGKILL)
    assert (run / "wandb" / "debug.log").is_symlink(), "no wandb links: the case is not the one"
    again = _run(command, run, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [ln for ln in again.stderr.splitlines() if ln.startswith("error:")] == []
    assert _losses(run) == uninterrupted  # each step once, the same floats
    assert [s for s, _ in uninterrupted] == list(range(1, STEPS + 1))
