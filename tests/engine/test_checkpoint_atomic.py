"""Atomic checkpoints and RNG state round trips."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from videotrain.engine import checkpoint as ckpt


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


def test_rng_state_round_trip(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    state = ckpt.rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    # through a file, as on resume
    ckpt.save_atomic({"rng": state}, tmp_path / "r.ckpt")
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    ckpt.set_rng_state(ckpt.load(tmp_path / "r.ckpt")["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
