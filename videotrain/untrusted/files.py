"""The one reader and the one writer of files: regular files only, no link ever followed.

* :func:`open_regular` / :func:`read_bytes` / :func:`read_text`: a file is read only if it is a
  regular file (``O_NOFOLLOW``: no symbolic link; ``O_NONBLOCK`` + ``fstat``: a FIFO or a
  device is refused instead of hanging), with a size bound checked before anything is read;
* :func:`write_bytes` / :func:`write_text` / :func:`open_append`: every file the project writes
  goes through these: a new file renamed over the name (the name is replaced, never what it
  points to), or an append to a regular file with one link only (``O_NOFOLLOW``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import uuid
from pathlib import Path
from typing import IO

from videotrain.untrusted.text import shown


class UnsafeFileError(ValueError):
    """A file that is not what it should be: a symbolic link, a FIFO, a device, too large."""


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
