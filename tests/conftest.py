"""Shared fixtures: one tiny synthetic dataset per session, an isolated cache, Hydra helpers.

Everything here is sized for a 2-core CPU: 16 train / 8 val videos of 8 frames at 32x32 px,
clips of 4 frames, and a one-layer ViT of width 32 for the runs that actually train.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import videotrain.config.build
from videotrain.data.layouts import generate
from videotrain.data.synthetic import SyntheticSpec

# One intra-op thread, here and in the subprocesses (see `isolated_env`): on a small, shared
# CPU, OpenMP's spinning worker threads make these tiny models 10-30x slower, not faster.
torch.set_num_threads(1)

TINY_SPEC = SyntheticSpec(train_per_class=4, val_per_class=2, num_frames=8, size=32, seed=0)

# The synthetic generator's settings as `data.synthetic.*` overrides (they name the cache folder).
TINY_SYNTHETIC_OVERRIDES = [
    f"data.synthetic.{k}={getattr(TINY_SPEC, k)}"
    for k in ("train_per_class", "val_per_class", "num_frames", "size", "seed")
]

# Small everything, for configs that are only composed and instantiated.
SHRINK_OVERRIDES = [
    "data.crop_size=32",
    "data.short_side=32",
    "data.num_frames=4",
    "data.batch_size=4",
    "data.val_batch_size=8",
    "data.num_workers=0",
    "logger.wandb.mode=disabled",
    "trainer.progress=false",
    "device=cpu",
]

# A model that trains in a fraction of a second per step on a CPU.
TINY_MODEL_OVERRIDES = [
    "model/backbone=vit_tiny",
    "model.backbone.num_layers=1",
    "model.backbone.hidden_dim=32",
    "model.backbone.num_heads=2",
    "model.backbone.mlp_dim=64",
    "model/head=tconv",
    "model.head.hidden_dim=16",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-xdist (``-n auto --dist loadgroup``, pyproject's addopts) spreads tests over the
    cores one by one, except that the tests of a file that share a module- or class-scoped
    fixture (a trained run, a subprocess's measurements, generated clips) go to one worker, in
    file order, so the fixture is built once. Tests that must not run at the same time as each
    other (one shared file, one port) name one group, ``@pytest.mark.xdist_group("name")``: one
    worker runs them, one after another. Session fixtures are built once per worker, in the
    worker's own temporary folder (``isolated_env``: its own ``$VIDEOTRAIN_CACHE``).

    The attack matrix (``tests/untrusted``) runs first, on every worker: its cases fork the test
    process, and a process that has run a fake-tensor backward (the estimate's tests) has
    started autograd's device threads, after which no forked child can run autograd."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/untrusted/"))  # stable
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope in ("module", "class", "package") for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


# Constants are handed out as fixtures: `from conftest import ...` is ambiguous once a
# sub-folder has its own conftest.py (pytest re-imports each as the module `conftest`).
@pytest.fixture(scope="session")
def tiny_spec() -> SyntheticSpec:
    return TINY_SPEC


@pytest.fixture(scope="session")
def tiny_synthetic_overrides() -> list[str]:
    return list(TINY_SYNTHETIC_OVERRIDES)


@pytest.fixture(scope="session")
def shrink_overrides() -> list[str]:
    return list(SHRINK_OVERRIDES)


@pytest.fixture(scope="session")
def tiny_model_overrides() -> list[str]:
    return list(TINY_MODEL_OVERRIDES)


@pytest.fixture(scope="session", autouse=True)
def isolated_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Keep the cache, wandb and torch hub out of the home folder, for us and subprocesses."""
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("videotrain_cache")
    mp.setenv("VIDEOTRAIN_CACHE", str(cache))
    mp.setenv("WANDB_MODE", "disabled")
    mp.setenv("WANDB_DIR", str(tmp_path_factory.mktemp("wandb")))
    mp.setenv("TORCH_HOME", str(tmp_path_factory.mktemp("torch_home")))
    mp.setenv("OMP_NUM_THREADS", "1")
    mp.setenv("MKL_NUM_THREADS", "1")
    yield cache
    mp.undo()


@pytest.fixture(scope="session")
def tiny_root(isolated_env: Path) -> Path:
    """The tiny synthetic dataset, generated once, where ``data=synthetic`` with
    ``TINY_SYNTHETIC_OVERRIDES`` finds it. Read-only for tests: copy it to modify it."""
    return generate(isolated_env / f"synthetic-{TINY_SPEC.digest()}", TINY_SPEC)


@pytest.fixture(scope="session")
def layout_root(isolated_env: Path, tiny_root: Path) -> Callable[[str], Path]:
    """``layout_root(layout)``: the tiny dataset's clips written in a dataset's own layout
    (``kinetics``, ``folder``, ``ucf101``, ``hmdb51``, ``ssv2``), generated once per session.
    Read-only for tests: copy it to modify it."""

    def _root(layout: str) -> Path:
        if layout in ("kinetics", "folder"):  # the session tree has both
            return tiny_root
        return generate(isolated_env / f"synthetic-{layout}-{TINY_SPEC.digest()}", TINY_SPEC, layout)

    return _root


@pytest.fixture
def tiny_copy(tiny_root: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the tiny dataset."""
    dst = tmp_path / "data"
    shutil.copytree(tiny_root, dst)
    return dst


@pytest.fixture(scope="session")
def compose_cfg() -> Callable[..., DictConfig]:
    """``compose_cfg([...overrides])`` -> the composed root config (Hydra 1.3 compose API).

    Memoized per override list (composition takes ~0.3 s); every call returns a fresh copy.
    """
    cache: dict[tuple[str, ...], DictConfig] = {}

    def _compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
        key = tuple(overrides)
        if key not in cache:
            with initialize_config_dir(config_dir=videotrain.config.build.CONFIG_DIR, version_base="1.3"):
                cache[key] = compose(config_name="config", overrides=list(key))
        return copy.deepcopy(cache[key])

    return _compose


@pytest.fixture(scope="session")
def run_overrides(tiny_root: Path) -> Callable[..., list[str]]:
    """Overrides for a real (tiny) training run on ``root`` (default: the session dataset)."""

    def _overrides(root: Path | None = None, **extra: object) -> list[str]:
        ov = [
            "data=kinetics",
            f"data.root={root or tiny_root}",
            "data.sampling_rate=2",
            "data.fps=10",
            *SHRINK_OVERRIDES,
            *TINY_MODEL_OVERRIDES,
            "trainer.log_every_n_steps=1",
            "trainer.max_epochs=1",
            # meter every step: in-process runs must not leave pytest's process in the fast
            # allocator regime, where a later test's meter would misread
            "trainer.cpu_metered_steps=null",
        ]
        return ov + [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]

    return _overrides


@pytest.fixture
def cuda() -> torch.device:
    """The CUDA device, for tests marked ``gpu`` (deselected by default; ``pytest -m gpu``).
    Without one they fail: a GPU check that skips would read as passed."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run pytest -m gpu on a GPU machine")
    return torch.device("cuda")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """A test that takes ``device`` runs on the CPU, and on CUDA in the gpu-marked run
    (``pytest -m gpu``): the CUDA twin of a CPU check, with the same assertions."""
    if request.param == "cuda":
        return request.getfixturevalue("cuda")
    return torch.device(request.param)


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    """Run ``python -m videotrain ARGS`` as a subprocess in ``cwd``."""

    def _run(args: list[str], cwd: Path, timeout: float = 300,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "videotrain", *args], cwd=cwd, env={**os.environ, **(env or {})},
            capture_output=True, text=True, timeout=timeout,
        )

    return _run


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="session")
def metrics_rows() -> Callable[[Path], list[dict]]:
    """The rows of ``RUN_DIR/metrics.jsonl``."""
    return read_metrics
