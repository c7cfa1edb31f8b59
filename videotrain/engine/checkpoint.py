"""Checkpoints that are never half-written, and the RNG state that makes resume exact."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

LAST = "last.ckpt"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_atomic(obj: dict[str, Any], path: str | Path) -> Path:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``.

    A crash at any moment leaves either the previous checkpoint or the new one, never a
    truncated file (``os.replace`` is atomic on POSIX within one filesystem).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    # our own files hold RNG states (numpy arrays, tuples), so weights_only=False is needed
    return torch.load(path, map_location=map_location, weights_only=False)


def find_last(ckpt_dir: str | Path) -> Path | None:
    path = Path(ckpt_dir) / LAST
    return path if path.exists() else None
