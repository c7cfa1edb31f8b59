"""data.num_workers: auto: decoding processes from the cores this process may use,
the device and the processes per node; prefetch on CUDA so the GPU does not wait for data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from videotrain.data.loaders import (
    PREFETCH_CUDA,
    auto_num_workers,
    build_data,
    resolve_num_workers,
    usable_cpus,
)


def test_auto_workers_by_device_cores_and_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert auto_num_workers("cuda", cpus=16) == 15  # every core but the main process's
    assert auto_num_workers("cuda", cpus=64) == 16  # capped
    assert auto_num_workers("cuda", world_size=8, cpus=64) == 7  # 8 ranks share the node
    assert auto_num_workers("cuda", cpus=1) == 1
    assert auto_num_workers("cpu", cpus=2) == 1  # the default job: as before
    assert auto_num_workers("cpu", cpus=16) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 of 16 ranks on this node
    assert auto_num_workers("cuda", world_size=16, cpus=32) == 15
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_resolve_num_workers_checks_its_value() -> None:
    assert resolve_num_workers(3, "cuda") == 3
    assert resolve_num_workers("auto", "cpu") == auto_num_workers("cpu")
    for bad in (-1, "many", 1.5, True):
        with pytest.raises(ValueError, match="data.num_workers"):
            resolve_num_workers(bad, "cpu")


def test_auto_loaders_on_cuda_pin_prefetch_and_persist(tiny_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaders a CUDA run gets (built here without a GPU: nothing is iterated)."""
    import videotrain.data.loaders as loaders

    monkeypatch.setattr(loaders, "usable_cpus", lambda: 5)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    data, _ = build_data(name="kinetics", layout="kinetics", root=str(tiny_root), num_frames=4,
                         sampling_rate=2, fps=10, short_side=32, crop_size=16, train_scale=(0.5, 1.0),
                         hflip=False, batch_size=4, val_batch_size=3, num_workers="auto", val_clips=1,
                         val_crops=1, max_bad_fraction=0.1, pin_memory=True, device_type="cuda")
    for loader in (data.train, data.val):
        assert loader.num_workers == 4 and loader.pin_memory and loader.persistent_workers
        assert loader.prefetch_factor == PREFETCH_CUDA
    data, _ = build_data(name="kinetics", layout="kinetics", root=str(tiny_root), num_frames=4,
                         sampling_rate=2, fps=10, short_side=32, crop_size=16, train_scale=(0.5, 1.0),
                         hflip=False, batch_size=4, val_batch_size=3, num_workers="auto", val_clips=1,
                         val_crops=1, max_bad_fraction=0.1)
    assert data.train.num_workers == 1 and data.train.prefetch_factor == 2  # CPU: a quarter of 5
