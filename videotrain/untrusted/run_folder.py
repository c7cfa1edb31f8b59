"""Run folders made by someone else: refused, before anything is written, when unsafe.

:func:`check_run_folder`: a run folder (the one a command writes to, or reads a trained run
from) that is itself a symbolic link, or holds symbolic links out of their folder, FIFOs,
devices, sockets or hard-linked files, is refused with one error naming them. It fails closed: a
folder or entry it cannot list or read the status of is refused too. wandb's own links in
``wandb/`` pass (:func:`_wandb_link`). :class:`RunFolderCheck` runs it as a Hydra callback before
Hydra opens the log file, and writes ``.hydra/`` itself through the one writer (Hydra's own
writes there are turned off: ``hydra.output_subdir: null``); :class:`RunLogFile` is the log
file's handler. Datasets are not run folders: ``data.root`` and videos behind symbolic links are
read as before.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from videotrain.untrusted.files import UnsafeFileError, _kind, make_dirs, open_append, write_text
from videotrain.untrusted.text import shown

MAX_RUN_FOLDER_ENTRIES = 100_000  # a run folder with more entries is refused unscanned
# the one link videotrain makes (engine.checkpoint): to the newest step file beside it; any
# other link would be refused (or replaced) by the writer later, after work had begun
_OWN_LINKS = ("last.ckpt",)
_APPENDED_OK_HARD_LINKS = (".ckpt",)  # best.ckpt is a hard link to a step file by design
# wandb's folder in a run (``dir=`` the run folder; ``.wandb`` when that exists) and the links
# wandb itself makes there: it replaces them (remove, then a new link renamed over the name) and
# never writes through them; ``logs/debug-core.log`` is made once in a new run folder of its own
# (wandb adds a suffix to a name that exists), by a link call that fails where the name exists
WANDB_FOLDERS = ("wandb", ".wandb")
WANDB_TOP_LINKS = ("latest-run", "debug.log", "debug-internal.log")
WANDB_RUN_LINK = ("logs", "debug-core.log")


class UnsafeRunFolder(UnsafeFileError):
    """A run folder that is a link, holds links out of it, FIFOs, devices or hard-linked
    files, or cannot be checked."""


def _wandb_link(parts: tuple[str, ...]) -> bool:
    """``parts`` (a path inside the run folder) is a link wandb makes: ``wandb/latest-run``,
    ``wandb/debug.log``, ``wandb/debug-internal.log`` or ``wandb/RUN/logs/debug-core.log``, in
    the run folder's ``wandb/`` or in that of a run folder inside it (a multirun's jobs).
    videotrain never reads or writes inside ``wandb/``, and wandb replaces these links rather
    than writing through them, so whatever they point to is never opened."""
    at = next((i for i, part in enumerate(parts[:-1]) if part in WANDB_FOLDERS), None)
    if at is None:
        return False
    tail = parts[at + 1:]
    if len(tail) == 1:
        return tail[0] in WANDB_TOP_LINKS
    return len(tail) == 3 and tail[1:] == WANDB_RUN_LINK


def _sibling_link(folder: Path, name: str) -> str | None:
    """None if the symbolic link ``folder/name`` is one videotrain makes (``last.ckpt``) and
    names a file beside it (``step-N.ckpt``): it stays inside the folder, and that file is
    checked as an entry of its own. Else why not: another name, a target with a ``/``, or one
    that is a folder or another link."""
    try:
        target = os.readlink(folder / name)
    except OSError as err:
        return f"a symbolic link that cannot be read ({err.strerror})"
    if name not in _OWN_LINKS or "/" in target or target in ("", ".", ".."):
        return f"a symbolic link to {shown(target)}"
    try:
        mode = os.lstat(folder / target).st_mode
    except FileNotFoundError:
        return None  # dangling: writing through it would create a file beside it
    except OSError as err:
        return f"a symbolic link to {shown(target)}, whose status cannot be read ({err.strerror})"
    if stat.S_ISLNK(mode) or stat.S_ISDIR(mode):
        return f"a symbolic link to {shown(target)}, {_kind(mode)}"
    return None


def run_folder_problems(folder: str | Path) -> list[str]:
    """Entries of ``folder`` (walked without following links) that a run may not read or write
    through: symbolic links except ``last.ckpt`` to a file beside it (:func:`_sibling_link`)
    and wandb's own (:func:`_wandb_link`), FIFOs, devices, sockets, regular files with other
    hard links (except checkpoints: ``best.ckpt``), and any folder or entry that cannot be
    listed or whose status cannot be read (fail closed: what cannot be checked is not passed)."""
    root = Path(folder)
    problems: list[str] = []
    seen = 0
    stack: list[tuple[Path, tuple[str, ...]]] = [(root, ())]
    while stack:
        here, parts = stack.pop()
        try:
            with os.scandir(here) as it:
                entries = list(it)
        except OSError as err:
            problems.append(f"{shown(os.path.join(*parts)) if parts else '.'} (a folder that "
                            f"cannot be listed: {err.strerror})")
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_RUN_FOLDER_ENTRIES:
                return [*problems, f"(more than {MAX_RUN_FOLDER_ENTRIES} entries: not scanned)"]
            rel = (*parts, entry.name)
            name = shown(os.path.join(*rel))
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as err:
                problems.append(f"{name} (its status cannot be read: {err.strerror})")
                continue
            if stat.S_ISLNK(st.st_mode):
                why = None if _wandb_link(rel) else _sibling_link(here, entry.name)
                if why is not None:
                    problems.append(f"{name} ({why})")
            elif stat.S_ISDIR(st.st_mode):
                stack.append((Path(entry.path), rel))
            elif not stat.S_ISREG(st.st_mode):
                problems.append(f"{name} ({_kind(st.st_mode)})")
            elif st.st_nlink > 1 and not entry.name.endswith(_APPENDED_OK_HARD_LINKS):
                problems.append(f"{name} (a hard link to a file elsewhere)")
    return sorted(problems)


def check_run_folder(folder: str | Path, doing: str = "use") -> None:
    """Refuse (:class:`UnsafeRunFolder`, one line naming them) a run folder that is not a real
    folder (a symbolic link to one is refused: its files are another folder's), whose status
    cannot be read, or that holds what :func:`run_folder_problems` lists. A folder that does
    not exist yet passes: the writer creates it."""
    folder = Path(folder)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    except OSError as err:
        raise UnsafeRunFolder(f"run folder {shown(folder)} cannot be checked ({err.strerror}); "
                              f"videotrain will not {doing} a folder it cannot check") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRunFolder(f"run folder {shown(folder)} is a symbolic link (to "
                              f"{shown(os.readlink(folder))}); videotrain will not {doing} "
                              "another folder through it; nothing was read or written. Name "
                              "the folder itself")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRunFolder(f"run folder {shown(folder)} is {_kind(st.st_mode)}, not a folder")
    problems = run_folder_problems(folder)
    if problems:
        more = f" and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise UnsafeRunFolder(
            f"run folder {shown(folder)} holds {len(problems)} entr{'y' if len(problems) == 1 else 'ies'} "
            f"that videotrain will not {doing} (a shared run folder's files must be regular files "
            f"inside it, readable): {', '.join(problems[:8])}{more}; nothing was read or written. "
            "Use another hydra.run.dir, or remove them if you trust the folder (docs/cluster.md)")


class RunLogFile(logging.FileHandler):
    """The log file's handler (``configs/hydra/job_logging/run_folder.yaml``): a
    ``logging.FileHandler`` whose file is opened by :func:`open_append` below ``root`` (the run
    folder): no link is followed, a FIFO or a hard link is refused."""

    def __init__(self, filename: str, root: str, mode: str = "a", encoding: str | None = None,
                 delay: bool = False) -> None:
        self.root = root
        super().__init__(filename, mode, encoding, delay)

    def _open(self) -> Any:
        return open_append(self.baseFilename, root=self.root)


_SETS_SUBDIR = re.compile(r"^\+{0,2}hydra\.output_subdir=")


class RunFolderCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in ``configs/config.yaml``): the run folder of
    ``hydra.run.dir`` (a multirun's sweep folder) is checked by :func:`check_run_folder`
    before Hydra opens the log file; a refused folder ends the command with one ``error:``
    line and exit status 2. It writes what Hydra would write with plain ``open`` (``.hydra/``'s
    ``config.yaml``, ``hydra.yaml``, ``overrides.yaml`` in every job's folder; ``multirun.yaml``)
    through the one writer, into ``output_subdir``, or where the user's own
    ``hydra.output_subdir`` says (null: nowhere, as on DDP ranks other than 0)."""

    def __init__(self, output_subdir: str | None = ".hydra") -> None:
        self.output_subdir = output_subdir
        self._subdir: str | None = output_subdir
        self._hydra_overrides: list[str] | None = None  # as the user gave them

    @staticmethod
    def _refuse(err: Exception) -> None:
        """End the command with one ``error:`` line (Hydra turns a callback's exception into a
        warning and goes on: a refusal must not)."""
        why = str(err) if isinstance(err, UnsafeFileError) else (
            f"{shown(getattr(err, 'filename', None) or '')}: {getattr(err, 'strerror', None) or err}")
        print(f"error: {why}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None

    def _check(self, config: DictConfig, key: str) -> None:
        folder = OmegaConf.select(config, key, throw_on_missing=False)
        if folder is None:
            return
        try:
            check_run_folder(str(folder), "write into")
        except UnsafeRunFolder as err:
            self._refuse(err)

    def _take_output_subdir(self, config: DictConfig, multirun: bool) -> None:
        """Where ``.hydra/`` goes: a ``hydra.output_subdir`` the user set (a value, or null),
        else ``output_subdir``. A value is taken from Hydra (set to null, in the jobs' overrides
        too) so that Hydra does not write it with plain ``open``; ``.hydra/hydra.yaml`` still
        records it and the overrides as given."""
        value = config.hydra.output_subdir
        given = list(config.hydra.overrides.hydra)
        self._hydra_overrides = given
        if value is not None:
            self._subdir = str(value)
        elif any(_SETS_SUBDIR.match(o) for o in given):
            self._subdir = None
        else:
            self._subdir = self.output_subdir
        if value is not None:
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = None
                if multirun:  # each job's config is composed again from these
                    with read_write(config.hydra.overrides):
                        config.hydra.overrides.hydra = [*given, "hydra.output_subdir=null"]

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")
        self._take_output_subdir(config, multirun=False)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")
        self._take_output_subdir(config, multirun=True)
        sweep = Path(str(config.hydra.sweep.dir))
        try:  # Hydra's sweeper saves this with plain open next: a regular file stands there first
            make_dirs(sweep, root=sweep)
            write_text(sweep / "multirun.yaml", OmegaConf.to_yaml(self._as_given(config)),
                       root=sweep)
        except (OSError, UnsafeFileError) as err:
            self._refuse(err)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self._subdir is None:
            return
        try:
            self._save_hydra_files(config)
        except (OSError, UnsafeFileError) as err:
            self._refuse(err)

    def _save_hydra_files(self, config: DictConfig) -> None:
        out = Path(str(config.hydra.runtime.output_dir))
        hydra_dir = out / self._subdir
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            task.pop("hydra")
        write_text(hydra_dir / "config.yaml", OmegaConf.to_yaml(task), root=out)
        hydra = self._as_given(OmegaConf.masked_copy(config, "hydra"))
        write_text(hydra_dir / "hydra.yaml", OmegaConf.to_yaml(hydra), root=out)
        write_text(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(config.hydra.overrides.task),
                   root=out)

    def _as_given(self, config: DictConfig) -> DictConfig:
        """``config`` with ``hydra.output_subdir`` and ``hydra.overrides.hydra`` as the user
        gave them (what Hydra itself would have saved)."""
        config = copy.deepcopy(config)
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.output_subdir = self._subdir
            if self._hydra_overrides is not None:
                with read_write(config.hydra.overrides):
                    config.hydra.overrides.hydra = list(self._hydra_overrides)
        return config
