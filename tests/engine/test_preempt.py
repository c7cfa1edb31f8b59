"""Preemption: SIGTERM / SIGUSR1 / SIGUSR2 stop training after the current optimizer step with
a checkpoint and exit code 75; a second signal exits at once; the previous handler (submitit's)
runs after the checkpoint; resume after any number of such stops repeats the uninterrupted run
bit for bit (the kill storm, ``-m slow``), also when submitit requeues the job itself."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import videotrain.run as run
from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.preempt import EXIT_PREEMPTED, Interrupted, Preempted, StopSignals
from videotrain.engine.trainer import Trainer

# ------------------------------------------------------------------- the handlers themselves


def test_handlers_are_installed_while_inside_and_restored_after() -> None:
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGUSR2, previous)
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
        with StopSignals() as stop:
            assert stop.installed and signal.getsignal(signal.SIGUSR2) == stop._handle
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.requested == signal.SIGUSR1 and not seen  # recorded, nothing else
            with pytest.raises(Interrupted) as second:  # a second signal: out at once
                os.kill(os.getpid(), signal.SIGTERM)
            assert second.value.code == 128 + signal.SIGTERM
            stop.chain(signal.SIGUSR2)  # the previous Python handler, called on request
            assert seen == [signal.SIGUSR2]
            stop.chain(signal.SIGTERM)  # SIG_DFL before: nothing to call
        assert signal.getsignal(signal.SIGUSR2) is previous
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_forked_children_ignore_usr_signals_and_die_on_sigterm() -> None:
    """A DataLoader worker inherits the handlers: SLURM's USR notice (sent to every process of
    the job) must not kill it, and its parent's SIGTERM (used on stuck workers) still must."""
    with StopSignals() as stop:
        pid = os.fork()
        if pid == 0:  # the child
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert stop.requested is None  # the parent saw none of it
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


# ------------------------------------------------------------------- in-process runs

RUN_EXTRA = dict(trainer__max_epochs=2, trainer__checkpoint_every_n_steps=2,
                 model__head__dropout=0.5)  # 2 epochs x 4 steps; dropout uses the global RNG


def _losses(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]


@pytest.fixture(scope="module")
def reference(run_overrides, compose_cfg, tmp_path_factory) -> tuple[list[str], Path, dict]:
    overrides = run_overrides(**RUN_EXTRA)
    out = tmp_path_factory.mktemp("reference")
    return overrides, out, run.train(compose_cfg(overrides), out)


def _signal_at_step(monkeypatch: pytest.MonkeyPatch, at: dict[int, int]) -> None:
    """Send ``at[step]`` to this process during optimizer step ``step`` (1-based)."""
    real_step = Trainer._optimizer_step

    def step(self):
        signum = at.pop(self.state.step + 1, None)
        if signum is not None:
            os.kill(os.getpid(), signum)
        return real_step(self)

    monkeypatch.setattr(Trainer, "_optimizer_step", step)


def test_signal_stops_after_the_step_and_resume_is_exact(
    reference, compose_cfg, metrics_rows, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    overrides, ref_dir, ref_results = reference
    out = tmp_path / "run"
    _signal_at_step(monkeypatch, {3: signal.SIGTERM})
    handler_before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO), pytest.raises(Preempted) as stopped:
        run.train(compose_cfg(overrides), out)
    assert signal.getsignal(signal.SIGTERM) == handler_before  # restored on the way out
    assert stopped.value.code == EXIT_PREEMPTED == 75 and stopped.value.step == 3
    path = out / "checkpoints" / "step-00000003.ckpt"  # not a periodic one (every 2 steps)
    assert stopped.value.checkpoint == path and ckpt.load(path)["step"] == 3
    assert os.readlink(out / "checkpoints" / "last.ckpt") == path.name
    assert (f"SIGTERM received: stopped after optimizer step 3 (epoch 0, 12 samples into it); "
            f"checkpoint written: {path}; exiting with code 75") in caplog.text
    assert [s for s, _ in _losses(metrics_rows(out))] == [1, 2, 3]

    caplog.clear()
    with caplog.at_level(logging.INFO):
        results = run.train(compose_cfg(overrides), out)
    assert f"resumed from {path} at step 3" in caplog.text
    assert _losses(metrics_rows(out)) == _losses(metrics_rows(ref_dir))  # bit for bit
    assert results["param_digests"] == ref_results["param_digests"]


def test_previous_handler_runs_after_the_checkpoint(reference, compose_cfg, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What submitit relies on: its USR2 handler (requeue, then sys.exit) still runs, once our
    checkpoint is on disk, and the process ends the way it decides."""
    overrides, _, _ = reference
    out = tmp_path / "run"
    calls = []

    def submitit_like(signum, frame):
        calls.append((signum, sorted(p.name for p in (out / "checkpoints").iterdir())))
        sys.exit(3)  # e.g. submitit's local requeue code

    old = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        _signal_at_step(monkeypatch, {5: signal.SIGUSR2})
        with pytest.raises(SystemExit) as ended:
            run.train(compose_cfg(overrides), out)
        assert signal.getsignal(signal.SIGUSR2) is submitit_like
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert ended.value.code == 3 and not isinstance(ended.value, Preempted)
    assert calls == [(signal.SIGUSR2, ["best.ckpt", "last.ckpt", "step-00000004.ckpt",
                                       "step-00000005.ckpt"])]


def test_second_signal_while_stopping_exits_at_once(reference, compose_cfg, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    overrides, _, _ = reference
    out = tmp_path / "run"
    _signal_at_step(monkeypatch, {3: signal.SIGUSR1})
    real_save = torch.save

    def interrupted_save(obj, f, *args, **kwargs):  # the stop's checkpoint, at step 3
        if obj["step"] == 3:
            real_save(obj, f, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)  # the second signal, mid-write
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(Interrupted) as ended:
        run.train(compose_cfg(overrides), out)
    assert ended.value.code == 128 + signal.SIGTERM
    folder = out / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step-00000002.ckpt"]
    assert ckpt.load(folder / "last.ckpt")["step"] == 2  # the last complete checkpoint


# ------------------------------------------------------------------- as a process


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, start time) for every process (from /proc)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            table[int(entry.name)] = (int(fields[1]), fields[0], fields[19])
    return table


def _descendants(pid: int) -> dict[int, str]:
    """The processes below ``pid`` now, with their start times."""
    table = _proc_table()
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, _, start) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                todo.append(child)
    return found


def _still_running(procs: dict[int, str]) -> list[int]:
    table = _proc_table()
    return [p for p, start in procs.items()
            if p in table and table[p][2] == start and table[p][1] != "Z"]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _train_rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"train_loss"' in line for line in path.read_text().splitlines())


def _command(args: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "videotrain", *args, f"hydra.run.dir={run_dir}"]


def _wait_for_rows(proc: subprocess.Popen, run_dir: Path, more_than: int, timeout: float = 300,
                   poll=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while _train_rows(run_dir) <= more_than and proc.poll() is None:
        assert time.monotonic() < deadline, "training did not start"
        poll()
        time.sleep(0.01)


def test_sigterm_leaves_a_checkpoint_a_log_line_exit_75_and_no_processes(
    run_overrides, metrics_rows, tmp_path: Path,
) -> None:
    """Two DataLoader workers and an offline wandb run: after SIGTERM the run exits with 75,
    and no process it started (workers, wandb's service) outlives it."""
    run_dir = tmp_path / "run"
    args = run_overrides(data__num_workers=2, trainer__max_epochs=1000,
                         logger__wandb__mode="offline")
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_SERVICE")}  # conftest disables wandb
    log_file = tmp_path / "output.txt"
    with log_file.open("w") as sink:
        proc = subprocess.Popen(_command(args, run_dir), cwd=tmp_path, env=env, stdout=sink,
                                stderr=subprocess.STDOUT)
        children: dict[int, str] = {}
        try:
            _wait_for_rows(proc, run_dir, 0, poll=lambda: children.update(_descendants(proc.pid)))
            children.update(_descendants(proc.pid))
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                children.update(_descendants(proc.pid))  # e.g. val workers started meanwhile
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
    output = log_file.read_text()
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    found = re.search(r"SIGTERM received: stopped after optimizer step (\d+) \(epoch \d+, \d+ "
                      r"samples into it\); checkpoint written: (\S+); exiting with code 75", output)
    assert found, output[-3000:]
    step, path = int(found.group(1)), Path(found.group(2))
    assert path == run_dir / "checkpoints" / ckpt.step_name(step) and ckpt.load(path)["step"] == step
    assert [s for s, _ in _losses(metrics_rows(run_dir))] == list(range(1, step + 1))
    assert len(children) >= 3, children  # two train workers and wandb's service, at least
    time.sleep(0.5)
    assert _still_running(children) == [], output[-3000:]


# ------------------------------------------------------------------- the default logger (wandb)

# `python -m videotrain` with a stop sent by the process to itself right after the first
# checkpoint (step 2): SIGTERM as a scheduler's preemption sends it, SIGKILL as the OOM killer
# or a lost node ends a job. The same command without this wrapper then resumes.
STOP_AFTER_FIRST_CHECKPOINT = """
import os, runpy, signal, sys
from videotrain.engine.checkpoints.run import RunCheckpoints
signum = getattr(signal, sys.argv.pop(1))
real_save = RunCheckpoints.save
def save(self, parts):
    path = real_save(self, parts)
    if parts.state.step == 2:
        os.kill(os.getpid(), signum)
    return path
RunCheckpoints.save = save
sys.argv[0] = "videotrain"
runpy.run_module("videotrain", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
def test_a_stopped_run_resumes_with_the_same_command_under_wandb(
        signame: str, reference, run_overrides, metrics_rows, tmp_path: Path) -> None:
    """Under the default logger (wandb, offline), a run stopped after its first checkpoint
    (SIGTERM: exit 75; SIGKILL: killed) resumes with the same command: the run-folder check
    lets wandb's own links in ``wandb/`` pass (it refused them, and the run was stuck), and
    the per-step losses are those of the uninterrupted run."""
    _, ref_dir, _ = reference
    run_dir = tmp_path / "run"
    args = [*run_overrides(**RUN_EXTRA, logger__wandb__mode="offline"), f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_SERVICE")}  # conftest disables wandb
    first = subprocess.Popen([sys.executable, "-c", STOP_AFTER_FIRST_CHECKPOINT, signame, *args],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = first.communicate(timeout=300)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):  # wandb's service, orphaned by SIGKILL
            os.killpg(first.pid, signal.SIGKILL)
    expected = EXIT_PREEMPTED if signame == "SIGTERM" else -signal.SIGKILL
    assert first.returncode == expected, output[-3000:]
    assert (run_dir / "wandb" / "debug.log").is_symlink()  # wandb's links, as it left them
    assert [p.name for p in (run_dir / "wandb").glob("*/logs/debug-core.log")]
    assert ckpt.load(run_dir / "checkpoints" / "last.ckpt")["step"] >= 2

    again = subprocess.run([sys.executable, "-m", "videotrain", *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "resumed from" in again.stdout + again.stderr
    assert _losses(metrics_rows(run_dir)) == _losses(metrics_rows(ref_dir))  # bit for bit
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # one wandb run folder each


# ------------------------------------------------------------------- kill storm (slow)

STORM = dict(data__batch_size=1, data__num_workers=1, trainer__max_epochs=4,
             trainer__checkpoint_every_n_steps=7, model__head__dropout=0.5)  # 4 x 16 = 64 steps


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_kill_storm_resumes_bit_for_bit(run_overrides, metrics_rows, tmp_path: Path,
                                        signum: int) -> None:
    """At least 5 signals at random times into one 64-step run, each followed by the same
    command again: the same per-step losses (bit for bit), no step twice or missing, the same
    validations and the same final weights as a run that was never interrupted."""
    args = run_overrides(**STORM)
    ref, storm = tmp_path / "uninterrupted", tmp_path / "storm"
    done = subprocess.run(_command(args, ref), cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    rng = random.Random(signum)
    stops, deaths, starts = 0, 0, 0
    while True:
        starts += 1
        assert starts <= 20, "the run does not finish"
        rows_before = _train_rows(storm)
        out = tmp_path / f"start{starts}.txt"
        with out.open("w") as sink:
            proc = subprocess.Popen(_command(args, storm), cwd=tmp_path, stdout=sink,
                                    stderr=subprocess.STDOUT)
            if stops < 5:
                _wait_for_rows(proc, storm, rows_before)
                time.sleep(rng.uniform(0.0, 0.1))
                if proc.poll() is None:
                    proc.send_signal(signum)
            rc = proc.wait(timeout=600)
        text = out.read_text()
        if rc == 0:
            break
        if rc == -signum:  # landed after training, once the handlers were restored
            deaths += 1
            continue
        assert rc == EXIT_PREEMPTED, text[-3000:]
        assert f"{signal.Signals(signum).name} received: stopped after optimizer step" in text
        stops += 1
    assert stops >= 5, (stops, deaths)

    a, b = metrics_rows(ref), metrics_rows(storm)
    assert [s for s, _ in _losses(b)] == list(range(1, 65))  # each step once
    assert _losses(b) == _losses(a)  # bit-identical floats
    val = [(r["step"], r["val_top1"], r["val_loss"]) for r in a if "val_top1" in r]
    assert [(r["step"], r["val_top1"], r["val_loss"]) for r in b if "val_top1" in r] == val
    final_a = ckpt.load(ref / "checkpoints" / "last.ckpt")["model"]
    final_b = ckpt.load(storm / "checkpoints" / "last.ckpt")["model"]
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    res_a = json.loads((ref / "results.json").read_text())
    res_b = json.loads((storm / "results.json").read_text())
    assert res_a["param_digests"] == res_b["param_digests"]


@pytest.mark.slow
def test_submitit_requeues_and_resumes(tiny_synthetic_overrides, shrink_overrides,
                                       tiny_model_overrides, tmp_path: Path) -> None:
    """hydra/launcher=submitit_local: USR2 (submitit's preemption signal) to the job's task
    twice. Each time the trainer checkpoints, submitit's own handler requeues the job, the
    task starts again and resumes; the sweep ends successfully with every step once."""
    sweep = tmp_path / "sweep"
    args = [*tiny_synthetic_overrides, *shrink_overrides, *tiny_model_overrides,
            "data.batch_size=1", "trainer.max_epochs=8", "trainer.log_every_n_steps=1",
            "trainer.checkpoint_every_n_steps=5", "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=20", f"hydra.sweep.dir={sweep}"]
    out = tmp_path / "output.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "videotrain", "-m", *args], cwd=tmp_path,
                                stdout=sink, stderr=subprocess.STDOUT)
        signalled: list[int] = []
        rows_then = 0
        for _ in range(2):
            deadline = time.monotonic() + 300
            while True:  # the job's (next) task is training, past where it was signalled
                assert time.monotonic() < deadline and proc.poll() is None, out.read_text()[-3000:]
                job_dirs = [p.parent for p in sweep.glob("*/metrics.jsonl")]
                tasks = [p for p in _descendants(proc.pid) if p not in signalled
                         and b"submitit.core._submit" in _cmdline(p)]
                if tasks and job_dirs and _train_rows(job_dirs[0]) > rows_then + 5:
                    break
                time.sleep(0.02)
            assert len(tasks) == 1, tasks
            rows_then = _train_rows(job_dirs[0])
            os.kill(tasks[0], signal.SIGUSR2)
            signalled.append(tasks[0])
        rc = proc.wait(timeout=600)
    assert rc == 0, out.read_text()[-3000:]
    (job,) = job_dirs
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train_loss" in r] == list(range(1, 8 * 16 + 1))
    log_text = "".join(p.read_text() for p in job.glob("*.log"))  # Hydra's job log
    assert log_text.count("SIGUSR2 received: stopped after optimizer step") == 2
    assert log_text.count("resumed from") == 2
    submitit_log = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_log.*"))
    assert len(re.findall(r"submitit INFO .* - Requeued job", submitit_log)) == 2


def test_slurm_preset_asks_for_the_signal_and_requeue() -> None:
    """hydra/launcher=slurm: sbatch --signal=USR2@120 (submitit's preemption signal, which the
    trainer handles) and --requeue, and time-limit requeues allowed."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from submitit.slurm.slurm import _make_sbatch_string

    import videotrain.config.build as builder

    with initialize_config_dir(config_dir=builder.CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    params = instantiate(cfg.hydra.launcher).params
    assert params["max_num_timeout"] >= 1
    script = _make_sbatch_string(command="true", folder="/tmp/x",
                                 signal_delay_s=params["signal_delay_s"],
                                 additional_parameters=params["additional_parameters"])
    assert "#SBATCH --signal=USR2@120" in script.splitlines()
    assert "#SBATCH --requeue" in script.splitlines()
