"""Checkpoint files: atomic writes (also under SIGKILL), safe loading, RNG state as plain
values, and the checkpoint folder (keep_last_k, last.ckpt, best.ckpt, corrupt fallback)."""

from __future__ import annotations

import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from videotrain.engine.checkpoints import format as ckpt
from videotrain.untrusted import UnsafeFileError


def test_save_atomic_writes_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / ckpt.LAST  # the folder is created
    obj = {"w": torch.arange(5.0), "step": 3}
    assert ckpt.save_atomic(obj, path) == path
    assert sorted(p.name for p in path.parent.iterdir()) == [ckpt.LAST]
    loaded = ckpt.load(path)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], obj["w"])
    assert ckpt.find_last(path.parent) == path
    assert ckpt.find_last(tmp_path) is None


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               error: BaseException) -> None:
    path = tmp_path / ckpt.LAST
    ckpt.save_atomic({"step": 1, "w": torch.ones(3)}, path)
    before = path.read_bytes()
    real_save = torch.save

    def half_then_fail(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # bytes hit the temporary file ...
        f.truncate(max(f.tell() // 2, 1))  # ... a partial write ...
        raise error  # ... then the process is interrupted

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(type(error)):
        ckpt.save_atomic({"step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert ckpt.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [ckpt.LAST]  # temp file removed


def test_save_atomic_replaces(tmp_path: Path) -> None:
    path = tmp_path / ckpt.LAST
    ckpt.save_atomic({"step": 1}, path)
    ckpt.save_atomic({"step": 2}, path)
    assert ckpt.load(path)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == [ckpt.LAST]


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    import torch
    from videotrain.engine.checkpoints import format as ckpt

    folder = sys.argv[1]
    ckpts = ckpt.CheckpointDir(folder, keep_last_k=2)
    ckpts.save({"videotrain_format": 2, "model": {"w": torch.ones(4)}, "step": 1}, 1)
    real_save = torch.save

    def killed_mid_write(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(f.tell() // 2)  # half of a 32 MB checkpoint is on disk ...
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # ... when the process is killed

    torch.save = killed_mid_write
    ckpts.save({"videotrain_format": 2, "model": {"w": torch.zeros(8 << 20)}, "step": 2}, 2)
""")


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(folder)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    leftovers = sorted(p.name for p in folder.glob(".*.tmp"))
    assert len(leftovers) == 1 and leftovers[0].startswith(".step-00000002.ckpt.")
    assert os.readlink(folder / ckpt.LAST) == "step-00000001.ckpt"  # never re-pointed
    ckpts = ckpt.CheckpointDir(folder)
    path, blob = ckpts.load_newest()
    assert path.name == "step-00000001.ckpt" and torch.equal(blob["model"]["w"], torch.ones(4))
    ckpts.clean_temporaries()  # what resume does before loading
    assert not list(folder.glob(".*.tmp"))


# ------------------------------------------------------------------- plain values, safe loading


def test_rng_state_round_trip_is_plain(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    random.gauss(0, 1)  # python's and numpy's cached gaussians are part of the state
    np.random.standard_normal()
    state = ckpt.rng_state()
    expected = (random.random(), random.gauss(0, 1), float(np.random.rand()),
                float(np.random.standard_normal()), float(torch.rand(1)))
    # through a file, as on resume: the safe loader (torch.load(weights_only=True)) reads it
    ckpt.save_atomic({"rng": state}, tmp_path / "r.ckpt")
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    ckpt.set_rng_state(ckpt.load(tmp_path / "r.ckpt")["rng"])
    assert (random.random(), random.gauss(0, 1), float(np.random.rand()),
            float(np.random.standard_normal()), float(torch.rand(1))) == expected


def test_plain_converts_numpy_and_refuses_objects(tmp_path: Path) -> None:
    out = ckpt.plain({"a": np.arange(3), "b": np.float64(0.5), "c": [1, (2.0, None)], 3: "x"})
    assert torch.equal(out["a"], torch.arange(3)) and type(out["b"]) is float
    assert out["c"] == [1, (2.0, None)] and out[3] == "x"
    with pytest.raises(TypeError, match=r"checkpoint\.opt\.fn is a builtins.function"):
        ckpt.save_atomic({"opt": {"fn": lambda: 0}}, tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match=r"checkpoint\.s is a builtins.set"):
        ckpt.plain({"s": {1, 2}})
    assert not (tmp_path / "x.ckpt").exists()


class CreatesAFile:
    """Unpickling this calls ``open(path, "w")``: what a malicious checkpoint could do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_unsafe_file_is_refused_and_runs_nothing(tmp_path: Path, writer: str) -> None:
    marker = tmp_path / "created-by-unpickling"
    evil = tmp_path / "evil.ckpt"
    blob = {"model": {}, "step": 1, "payload": CreatesAFile(marker)}
    if writer == "torch.save":
        torch.save(blob, evil)
    else:
        evil.write_bytes(pickle.dumps(blob))
    with pytest.raises(ckpt.UnsafeCheckpointError) as err:
        ckpt.load(evil)
    assert str(err.value).startswith(f"{evil} is not a safe videotrain checkpoint: it needs "
                                     "arbitrary unpickling (")
    assert "refusing to load it" in str(err.value)
    if writer == "torch.save":  # the global refused, read from the pickle on every torch
        assert "unsupported global io.open" in str(err.value)
    assert "weights_only=False" not in str(err.value) and "set to `False`" not in str(err.value)
    assert isinstance(err.value, ValueError) and not marker.exists()


def test_truncated_file_is_corrupt_not_unsafe(tmp_path: Path) -> None:
    good = ckpt.save_atomic({"w": torch.randn(1000)}, tmp_path / "a.ckpt")
    data = good.read_bytes()
    for size in (len(data) // 2, 10, 0):
        good.write_bytes(data[:size])
        with pytest.raises(ckpt.CorruptCheckpointError, match=f"{good} is truncated or corrupt"):
            ckpt.load(good)


# ------------------------------------------------------------------- the checkpoint folder


def _blob(step: int) -> dict:
    return {ckpt.FORMAT_KEY: ckpt.FORMAT, "model": {"w": torch.full((2,), float(step))},
            "step": step}


def test_keep_last_k_last_and_best(tmp_path: Path) -> None:
    ckpts = ckpt.CheckpointDir(tmp_path, keep_last_k=2)
    for step in range(1, 8):
        ckpts.save(_blob(step), step, best=step in (2, 3))  # validation improved at 2 and 3
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best.ckpt", "last.ckpt", "step-00000006.ckpt", "step-00000007.ckpt"]
    assert os.readlink(tmp_path / "last.ckpt") == "step-00000007.ckpt"
    assert ckpt.load(tmp_path / "last.ckpt")["step"] == 7
    assert ckpt.load(tmp_path / "best.ckpt")["step"] == 3  # outlived its step file's pruning
    keep_all = ckpt.CheckpointDir(tmp_path / "all", keep_last_k=None)
    for step in range(1, 5):
        keep_all.save(_blob(step), step)
    assert len(keep_all.step_files()) == 4


def test_a_crash_between_writes_leaves_a_consistent_set(tmp_path: Path) -> None:
    ckpts = ckpt.CheckpointDir(tmp_path, keep_last_k=2)
    ckpts.save(_blob(2), 2)
    ckpt.save_atomic(_blob(4), tmp_path / ckpt.step_name(4))  # crash before last.ckpt moved
    assert os.readlink(tmp_path / "last.ckpt") == "step-00000002.ckpt"
    path, blob = ckpts.load_newest()  # the newest complete file wins, not last.ckpt
    assert path.name == "step-00000004.ckpt" and blob["step"] == 4


def test_corrupt_newest_falls_back_with_a_warning(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    ckpts = ckpt.CheckpointDir(tmp_path, keep_last_k=3)
    for step in (2, 4, 6):
        ckpts.save(_blob(step), step)
    newest = tmp_path / "step-00000006.ckpt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated (through last.ckpt's target)
    with caplog.at_level(logging.WARNING, logger="videotrain.engine.checkpoints.format"):
        path, blob = ckpts.load_newest()
    assert path.name == "step-00000004.ckpt" and blob["step"] == 4
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"checkpoint {newest} (last.ckpt pointing to it) is unreadable" in message
    assert f"resuming from the previous checkpoint {path}" in message
    assert (tmp_path / "step-00000006.ckpt.corrupt").exists() and not newest.exists()
    assert os.readlink(tmp_path / "last.ckpt") == "step-00000004.ckpt"
    for step in (2, 4):  # nothing readable at all: an error naming the files
        (tmp_path / ckpt.step_name(step)).write_bytes(b"")
    with pytest.raises(ckpt.CorruptCheckpointError, match="no readable checkpoint in"):
        ckpt.CheckpointDir(tmp_path).load_newest()


def test_old_layout_is_refused_clearly(tmp_path: Path) -> None:
    ckpt.save_atomic({"model": {}, "step": 1}, tmp_path / ckpt.LAST)  # a lone last.ckpt file
    with pytest.raises(ckpt.CheckpointError, match="resumes from layout 2 only"):
        ckpt.CheckpointDir(tmp_path).load_newest()


def test_a_linked_checkpoint_folder_is_never_written_into_or_pruned(tmp_path: Path) -> None:
    """``RUN/checkpoints`` a link to another run's checkpoint folder: every operation of the
    folder (below ``root``, the run folder, no link is followed) is refused, and the other
    run's files are as they were; the run's own folder works as before."""
    other = ckpt.CheckpointDir(tmp_path / "other" / "checkpoints", keep_last_k=None)
    for step in (1, 2, 3):
        other.save(_blob(step), step)
    (other.folder / ".step-00000009.ckpt.x.tmp").write_bytes(b"theirs")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in other.folder.iterdir()}
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(other.folder)
    ours = ckpt.CheckpointDir(run / "checkpoints", keep_last_k=1, root=run)
    for act in (lambda: ours.save(_blob(4), 4), ours.prune, ours.clean_temporaries,
                ours.step_files, ours.load_newest, lambda: ours.set_aside("replaced-x")):
        with pytest.raises(UnsafeFileError, match="symbolic link"):
            act()
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in other.folder.iterdir()}
    assert after == before and (run / "checkpoints").is_symlink()
    (run / "checkpoints").unlink()
    ours.save(_blob(4), 4)
    assert [p.name for p in ours.step_files()] == ["step-00000004.ckpt"]
    assert ours.set_aside("replaced-x") == run / "checkpoints.replaced-x"
