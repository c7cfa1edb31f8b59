"""Text and files that may come from someone else: shown escaped, opened as what they are.

A run folder, a checkpoint, a config or an annotation file can be shared by a stranger and
crafted (docs/cluster.md, "A shared run folder"). This module is the bottom layer every other
one may import (it imports no other videotrain module), so the same few rules hold everywhere:

* :func:`shown`: a value read from a file, as it may appear in a log line, an error or on a
  terminal: unchanged when it is short and printable, else ``repr``-escaped (newlines, escape
  sequences, bidirectional controls visible) and cut to :data:`SHOWN_CHARS` characters;
* :func:`open_regular` / :func:`read_bytes` / :func:`read_text`: a run folder's own file is read
  only if it is a regular file (``O_NOFOLLOW``: no symbolic link; ``O_NONBLOCK`` + ``fstat``: a
  FIFO or a device is refused instead of hanging), with a size bound;
* :func:`write_text` / :func:`open_append`: files written into a run folder never follow a
  link: a new file renamed over the name (the name is replaced, never what it points to), or an
  append to a regular file with one link only (``O_NOFOLLOW``);
* :func:`check_run_folder`: a run folder (the one a command writes to, or reads a trained run
  from) that holds symbolic links out of their folder, FIFOs, devices, sockets, or hard-linked
  files is refused with one error naming them, before anything is written into it.
  :class:`RunFolderCheck` runs it as a Hydra callback before Hydra writes ``.hydra/`` and opens
  the log file.

Datasets are not run folders: ``data.root`` and videos behind symbolic links are read as before.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import sys
import uuid
from pathlib import Path
from typing import IO, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

SHOWN_CHARS = 100  # a value read from a file is cut to this many characters when shown
PATH_CHARS = 1000  # a path (a Path object) is cut at this many
MAX_RUN_FOLDER_ENTRIES = 100_000  # a run folder with more entries is refused unscanned
_APPENDED_OK_HARD_LINKS = (".ckpt",)  # best.ckpt is a hard link to a step file by design


class UnsafeFileError(ValueError):
    """A file that is not what it should be: a symbolic link, a FIFO, a device, too large."""


class UnsafeRunFolder(UnsafeFileError):
    """A run folder that holds links out of it, FIFOs, devices or hard-linked files."""


# ---------------------------------------------------------------------- text
def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` as it may be logged or printed: a short printable string as it is, anything
    else ``repr``-style (control characters, newlines and terminal escapes visible), cut to
    ``limit`` characters with the length said. Never expands more than ``limit`` characters of
    a large value (a long string, a deep list)."""
    if isinstance(value, Path):  # a path is shown whole up to PATH_CHARS: it says where
        value, limit = str(value), max(limit, PATH_CHARS)
    if isinstance(value, str):
        if len(value) <= limit and value.isprintable():
            return value
        cut = value[:limit]
        text = cut if cut.isprintable() else repr(cut)
        return text if len(value) <= limit else f"{text}...({len(value)} chars)"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    import reprlib  # bounded: a few items per level, a few levels deep

    r = reprlib.Repr()
    r.maxstring = r.maxother = limit
    r.maxlevel = 4
    text = r.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...(cut)"


def quoted(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` (a string: a class name, a key) always ``repr``-quoted, escaped and cut to
    ``limit`` characters; other values as :func:`shown` gives them."""
    if not isinstance(value, str):
        return shown(value, limit)
    text = repr(value[:limit])
    return text if len(value) <= limit else f"{text}...({len(value)} chars)"


# ---------------------------------------------------------------------- plain data
MAX_CONFIG_NODES = 20_000  # a run's resolved config has a few hundred
MAX_CONFIG_DEPTH = 32


def plain_tree_problem(obj: Any, max_nodes: int = MAX_CONFIG_NODES,
                       max_depth: int = MAX_CONFIG_DEPTH) -> str | None:
    """Why ``obj`` (a config read from a file or a checkpoint, as plain Python values) may not
    be expanded, or None: more than ``max_nodes`` values, deeper than ``max_depth``, a container
    met twice (a pickle's or YAML's shared reference: 3 KB that expand to gigabytes), or a
    value that is not ``dict``/``list``/``str``/``int``/``float``/``bool``/None. Stops at the
    first problem, after at most ``max_nodes`` visits."""
    seen: set[int] = set()
    stack: list[tuple[Any, int, str]] = [(obj, 0, "")]
    count = 0
    while stack:
        node, depth, where = stack.pop()
        count += 1
        if count > max_nodes:
            return f"more than {max_nodes} values"
        if depth > max_depth:
            return f"nested more than {max_depth} levels deep (at {shown(where)})"
        if isinstance(node, (dict, list, tuple)):
            if id(node) in seen:
                return f"a shared reference at {shown(where)} (an alias: one node used twice)"
            seen.add(id(node))
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in items:
                if isinstance(node, dict) and not isinstance(key, (str, int)):
                    return f"a key of type {type(key).__name__} at {shown(where)}"
                stack.append((value, depth + 1, f"{where}.{key}" if where else str(key)))
        elif node is not None and not isinstance(node, (str, int, float, bool)):
            return f"a {type(node).__name__} at {shown(where)}"
    return None


# ---------------------------------------------------------------------- reading
def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def open_regular(path: str | Path, limit: int | None = None, what: str = "file",
                 follow: bool = False) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file (not a symbolic link, FIFO or
    device; none of those is followed or blocks), of at most ``limit`` bytes; else
    :class:`UnsafeFileError` naming it. ``FileNotFoundError`` when it does not exist.
    ``follow``: a dataset's file, which may sit behind links (it must still be regular)."""
    flags = (os.O_RDONLY | (0 if follow else os.O_NOFOLLOW) | os.O_NONBLOCK
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise UnsafeFileError(f"{what} {shown(path)} is a symbolic link; videotrain reads a "
                                  "run's own files only as regular files") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{what} {shown(path)} is {_kind(st.st_mode)}, not a regular "
                                  "file; refusing to read it")
        if limit is not None and st.st_size > limit:
            raise UnsafeFileError(f"{what} {shown(path)} is {st.st_size} bytes, more than the "
                                  f"{limit} bytes such a file may have")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | Path, limit: int, what: str = "file", follow: bool = False) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), at most ``limit``."""
    with open_regular(path, limit, what, follow) as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while read
        raise UnsafeFileError(f"{what} {shown(path)} is more than {limit} bytes")
    return data


def read_text(path: str | Path, limit: int, what: str = "file") -> str:
    """The UTF-8 text of the regular file ``path`` (:func:`read_bytes`); an error names the
    file and the byte offset, never the text."""
    data = read_bytes(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UnsafeFileError(f"{what} {shown(path)}: byte {err.start} is not UTF-8") from None


def is_regular(path: str | Path) -> bool:
    """``path`` exists and is a regular file itself (``lstat``: a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


# ---------------------------------------------------------------------- writing
def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` without following a link there: a new file (``O_EXCL``, a
    random name in the same folder) renamed over ``path``. A symbolic link, hard link or FIFO
    at ``path`` is replaced, never written through."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"))


def open_append(path: str | Path) -> IO[str]:
    """``path`` opened for appending text, created if missing, only if it is a regular file
    with no other hard link (so that nothing elsewhere is appended to): ``O_NOFOLLOW`` and
    ``O_NONBLOCK`` (a FIFO is refused, not waited on)."""
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO without a reader
            raise UnsafeFileError(f"{shown(path)} is a symbolic link or a FIFO; refusing to "
                                  "write to it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            what = _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else "a hard link"
            raise UnsafeFileError(f"{shown(path)} is {what}; refusing to write to it")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "a", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


# ---------------------------------------------------------------------- run folders
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
