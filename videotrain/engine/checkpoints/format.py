"""Checkpoints that are safe to load, never half-written, and kept in a consistent set.

``RUN/checkpoints/`` (``CheckpointDir``) holds ``step-NNNNNNNN.ckpt`` files (the newest
``trainer.keep_last_k`` kept), ``last.ckpt`` (a link to the newest) and ``best.ckpt`` (a hard
link to, or copy of, the best validation's). A save writes the step file atomically through
``videotrain.untrusted.files`` (no link below the run folder followed), re-points ``last.ckpt``,
then prunes; a crash leaves complete files only. Resume loads the newest step file and sets a
corrupt one aside. ``load`` is ``torch.load(weights_only=True)`` behind
``videotrain.engine.checkpoints.safe_load``'s checks; ``save_atomic`` stores only tensors and
plain values. Details: docs/design/internals.md#checkpoint-files."""

from __future__ import annotations

import logging
import os
import random
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from videotrain.engine.checkpoints.safe_load import (  # noqa: F401 - re-exported: the one loader
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    check_tensors,
    load,
)
from videotrain.untrusted.files import atomic_writer, list_folder, point, remove, rename

log = logging.getLogger(__name__)

LAST = "last.ckpt"
BEST = "best.ckpt"
FORMAT_KEY = "videotrain_format"  # in every training checkpoint; the layout's version
FORMAT = 2  # 1: the layout before safe loading (pickled numpy RNG state), which is refused
# the whole name, ASCII digits only: "$" would also match before a final newline, and "\d"
# other scripts' digits
_STEP_FILE = re.compile(r"step-([0-9]{1,12})\.ckpt")


# ---------------------------------------------------------------- RNG state as plain values


def rng_state() -> dict[str, Any]:
    """The global RNGs' state as tensors and plain values (what ``weights_only`` loads)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": int(version), "state": torch.tensor(mt, dtype=torch.int64),
                   "gauss_next": gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    np.random.set_state((npy["kind"], npy["keys"].cpu().numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# ---------------------------------------------------------------- plain values (safe loading: safe_load)

_SCALARS = (type(None), bool, int, float, str)


def plain(obj: Any, where: str = "checkpoint") -> Any:
    """``obj`` with numpy values turned into tensors and Python numbers; ``TypeError`` naming
    the key for anything ``torch.load(weights_only=True)`` would refuse (class instances, sets,
    functions, ...), so that a checkpoint that saves is a checkpoint that loads. Containers
    that need no change are returned as they are (a state dict keeps its ``_metadata``)."""
    if type(obj) in _SCALARS or isinstance(obj, (torch.Tensor, torch.Size)):
        return obj
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        items = {}
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; checkpoints hold "
                                "str and int keys only")
            items[k] = plain(v, f"{where}.{k}")
        if type(obj) in (dict, OrderedDict) and all(items[k] is obj[k] for k in items):
            return obj
        out = OrderedDict(items) if isinstance(obj, OrderedDict) else items
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if type(obj) in (list, tuple):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else type(obj)(items)
    raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; checkpoints "
                    "hold tensors and plain values only (dict, list, tuple, str, int, float, bool, "
                    "None), which torch.load(weights_only=True) reads back")


def save_atomic(obj: dict[str, Any], path: str | Path, root: str | Path | None = None) -> Path:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``
    (``untrusted.files.atomic_writer``: below ``root``, a run folder, no link is followed).

    A crash at any moment leaves either the previous file or the new one, never a truncated
    file (``os.replace`` is atomic on POSIX within one filesystem). ``obj`` must hold tensors
    and plain values only (see ``plain``).
    """
    path = Path(path)
    obj = plain(obj)
    with atomic_writer(path, root, durable=True) as f:
        torch.save(obj, f)
    return path


def check_training_checkpoint(blob: Any, path: str | Path) -> dict[str, Any]:
    """``blob`` if it is a training checkpoint of this layout, else a ``CheckpointError``."""
    if not isinstance(blob, dict) or "model" not in blob:
        raise CheckpointError(f"{path} is not a videotrain training checkpoint (no 'model' entry)")
    if blob.get(FORMAT_KEY) != FORMAT:
        raise CheckpointError(
            f"{path} is a videotrain checkpoint of layout {blob.get(FORMAT_KEY, 1)}; this version "
            f"resumes from layout {FORMAT} only (python -m videotrain.eval still reads its model)")
    return blob


# ---------------------------------------------------------------- the checkpoint folder


def step_name(step: int) -> str:
    return f"step-{step:08d}.ckpt"


def step_of(path: str | Path) -> int | None:
    """The step of a step file's name (exactly ``step-<digits>.ckpt``), else None."""
    found = _STEP_FILE.fullmatch(Path(path).name)
    return int(found.group(1)) if found else None


class CheckpointDir:
    """``step-N.ckpt`` files, ``last.ckpt`` and ``best.ckpt`` in one folder (module docstring).

    Every write, rename, removal and listing goes through ``videotrain.untrusted.files`` with
    ``root`` (the run folder; by default the folder above this one): the folder is opened
    without following a link, so a ``checkpoints`` link to another run's folder is refused, and
    nothing there is deleted or written."""

    def __init__(self, folder: str | Path, keep_last_k: int | None = 2,
                 root: str | Path | None = None) -> None:
        self.folder = Path(folder)
        self.keep_last_k = keep_last_k
        self.root = Path(root) if root is not None else self.folder.parent

    @property
    def last(self) -> Path:
        return self.folder / LAST

    @property
    def best(self) -> Path:
        return self.folder / BEST

    def step_files(self) -> list[Path]:
        """Step files, newest first."""
        names = list_folder(self.folder, self.root)  # the folder itself, never a link's target
        found = [(step_of(n), self.folder / n) for n in names if step_of(n) is not None]
        return [p for _, p in sorted(found, reverse=True)]

    def save(self, blob: dict[str, Any], step: int, best: bool = False) -> Path:
        path = save_atomic(blob, self.folder / step_name(step), self.root)
        point(self.last, path.name, self.root, symbolic=True)
        if best:
            point(self.best, path.name, self.root, symbolic=False)  # a hard link survives pruning
        self.prune()
        return path

    def prune(self) -> None:
        if self.keep_last_k is None:
            return
        for old in self.step_files()[self.keep_last_k:]:
            remove(old, self.root)

    def clean_temporaries(self) -> None:
        """Remove temporary files a killed writer left (``.NAME.*.tmp``); never loaded."""
        for name in list_folder(self.folder, self.root):
            if name.startswith(".") and name.endswith(".tmp"):
                log.info("removing %s, left by an interrupted checkpoint write", self.folder / name)
                remove(self.folder / name, self.root)

    def candidates(self) -> list[Path]:
        """What resume tries, in order: the step files, newest first, then ``last.ckpt`` if it
        is a file of its own (a copy, or the single-file layout of older versions)."""
        out = self.step_files()
        last = self.last
        if last.is_file() and not last.is_symlink() and not any(_same(last, p) for p in out):
            out.append(last)
        return out

    def describe(self, path: Path) -> str:
        """``path``, and which of last.ckpt / best.ckpt name it."""
        names = [n for n in (LAST, BEST) if (self.folder / n).exists() and _same(self.folder / n, path)
                 and path.name != n]
        return f"{path} ({' and '.join(names)} pointing to it)" if names else str(path)

    def load_newest(self, map_location: str | torch.device = "cpu") -> tuple[Path, dict] | None:
        """The newest readable training checkpoint and its contents, or None if there is none.

        A truncated or corrupt newer file is renamed ``NAME.corrupt`` and the previous one is
        used, with a warning naming both. An unsafe file (``UnsafeCheckpointError``) or one of
        another layout stops the search: it is an error, not something to skip silently.
        """
        bad: list[tuple[Path, str, CorruptCheckpointError]] = []
        for path in self.candidates():
            described = self.describe(path)
            try:
                blob = check_training_checkpoint(load(path, map_location), path)
            except CorruptCheckpointError as err:
                bad.append((path, described, err))
                continue
            for old, old_described, err in bad:
                aside = old.with_name(old.name + ".corrupt")
                log.warning("checkpoint %s is unreadable (%s); resuming from the previous "
                            "checkpoint %s instead (the unreadable file is kept as %s)",
                            old_described, err.reason, path, aside.name)
                rename(old, aside, self.root)
            if bad:
                point(self.last, path.name, self.root, symbolic=True)
            return path, blob
        if bad:
            raise CorruptCheckpointError(
                f"no readable checkpoint in {self.folder}: "
                + "; ".join(str(err) for _, _, err in bad))
        return None

    def set_aside(self, suffix: str) -> Path | None:
        """Rename the folder to ``checkpoints.SUFFIX`` (nothing in it is loaded again)."""
        if not list_folder(self.folder, self.root):  # a linked folder is refused, not moved
            return None
        dest = self.folder.with_name(f"{self.folder.name}.{suffix}")
        rename(self.folder, dest, self.root)
        return dest


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def find_last(ckpt_dir: str | Path) -> Path | None:
    """The newest checkpoint in ``ckpt_dir`` by name (not opened), or None."""
    found = CheckpointDir(ckpt_dir).candidates()
    last = Path(ckpt_dir) / LAST
    if last.exists():
        return last
    return found[0] if found else None
