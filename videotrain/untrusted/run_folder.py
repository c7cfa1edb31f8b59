"""Run folders made by someone else: refused, before anything is written, when unsafe.

:func:`check_run_folder`: a run folder (the one a command writes to, or reads a trained run
from) that holds symbolic links out of their folder, FIFOs, devices, sockets, or hard-linked
files is refused with one error naming them. :class:`RunFolderCheck` runs it as a Hydra callback
before Hydra writes ``.hydra/`` into it and opens the log file. Datasets are not run folders:
``data.root`` and videos behind symbolic links are read as before.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from videotrain.untrusted.files import UnsafeFileError, _kind
from videotrain.untrusted.text import shown

MAX_RUN_FOLDER_ENTRIES = 100_000  # a run folder with more entries is refused unscanned
_APPENDED_OK_HARD_LINKS = (".ckpt",)  # best.ckpt is a hard link to a step file by design


class UnsafeRunFolder(UnsafeFileError):
    """A run folder that holds links out of it, FIFOs, devices or hard-linked files."""


def _sibling_link(folder: Path, name: str) -> bool:
    """A symbolic link ``folder/name`` whose target is a plain name beside it (``last.ckpt ->
    step-N.ckpt``, wandb's ``latest-run``): it stays inside the folder, whatever that name is
    (the name itself is checked as an entry of its own when it exists)."""
    try:
        target = os.readlink(folder / name)
    except OSError:
        return False
    return "/" not in target and target not in ("", ".", "..")


def run_folder_problems(folder: str | Path) -> list[str]:
    """Entries of ``folder`` (walked without following links) that a run may not read or write
    through: symbolic links except to a sibling (:func:`_sibling_link`), FIFOs, devices,
    sockets, and regular files with other hard links (except checkpoints: ``best.ckpt``)."""
    root = Path(folder)
    problems: list[str] = []
    seen = 0
    stack = [root]
    while stack:
        here = stack.pop()
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_RUN_FOLDER_ENTRIES:
                return [*problems, f"(more than {MAX_RUN_FOLDER_ENTRIES} entries: not scanned)"]
            rel = os.path.relpath(entry.path, root)
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                if not _sibling_link(here, entry.name):
                    problems.append(f"{shown(rel)} (a symbolic link to {shown(os.readlink(entry.path))})")
            elif stat.S_ISDIR(st.st_mode):
                stack.append(Path(entry.path))
            elif not stat.S_ISREG(st.st_mode):
                problems.append(f"{shown(rel)} ({_kind(st.st_mode)})")
            elif st.st_nlink > 1 and not entry.name.endswith(_APPENDED_OK_HARD_LINKS):
                problems.append(f"{shown(rel)} (a hard link to a file elsewhere)")
    return sorted(problems)


def check_run_folder(folder: str | Path, doing: str = "use") -> None:
    """Refuse (:class:`UnsafeRunFolder`, one line naming them) a run folder that holds what
    :func:`run_folder_problems` lists; a folder that does not exist yet passes."""
    folder = Path(folder)
    try:
        st = os.stat(folder)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRunFolder(f"run folder {shown(folder)} is {_kind(st.st_mode)}, not a folder")
    problems = run_folder_problems(folder)
    if problems:
        more = f" and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise UnsafeRunFolder(
            f"run folder {shown(folder)} holds {len(problems)} entr{'y' if len(problems) == 1 else 'ies'} "
            f"that videotrain will not {doing} (a shared run folder's files must be regular files "
            f"inside it): {', '.join(problems[:8])}{more}; nothing was read or written. Use "
            "another hydra.run.dir, or remove them if you trust the folder (docs/cluster.md)")


class RunFolderCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in ``configs/config.yaml``): the run folder of
    ``hydra.run.dir`` (a multirun's sweep folder) is checked by :func:`check_run_folder`
    before Hydra writes ``.hydra/`` into it and opens the log file; a refused folder ends the
    command with one ``error:`` line and exit status 2."""

    def _check(self, config: DictConfig, key: str) -> None:
        folder = OmegaConf.select(config, key, throw_on_missing=False)
        if folder is None:
            return
        try:
            check_run_folder(str(folder), "write into")
        except UnsafeRunFolder as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")
