"""The one reader and the one writer of files: regular files only, no link ever followed.

* :func:`open_regular` / :func:`read_bytes` / :func:`read_text`: a file is read only if it is a
  regular file (``O_NOFOLLOW``: no symbolic link; ``O_NONBLOCK`` + ``fstat``: a FIFO or a
  device is refused instead of hanging), with a size bound checked before anything is read;
* the one writer: every file any command or script of the project writes goes through
  :func:`atomic_writer` (and its shorthands :func:`write_bytes` / :func:`write_text`, or
  :func:`staged_path` for a library that wants a path) or :func:`open_append`. The target folder
  is opened as a directory file descriptor: below ``root`` (a run folder, itself no link) every
  component is opened with ``O_NOFOLLOW`` and created with ``mkdir`` where missing, so no
  folder link is followed; the file is a new one (``O_EXCL | O_NOFOLLOW``, a random name in that
  folder) renamed over the name, so a link, hard link or FIFO there is replaced, never written
  through; an append goes only to a regular file with one link; :func:`point` (``last.ckpt``,
  ``best.ckpt``), :func:`rename`, :func:`remove` and :func:`list_folder` work on names in folders
  opened the same way, never on what a link points to.

Without ``root`` the folder is the user's own path (a command-line ``--out``): followed as given,
created where missing; the file itself is still never written through a link.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, BinaryIO

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


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC


def _below(path: Path, root: Path) -> tuple[str, ...]:
    """The components of ``path`` below ``root`` (both made absolute, not resolved: a link is
    a component like any other); refuses a path outside ``root`` or one with ``..``."""
    path, root = Path(os.path.abspath(path)), Path(os.path.abspath(root))
    try:
        rel = path.relative_to(root)
    except ValueError:
        raise UnsafeFileError(f"{shown(path)} is not inside the run folder {shown(root)}") from None
    if ".." in rel.parts:
        raise UnsafeFileError(f"{shown(path)}: '..' in a path inside a run folder")
    return rel.parts


def _open_root(root: Path, create: bool) -> int:
    """A directory fd of ``root``, which must be a real directory itself (not a link; created
    with its parents, the user's own path, when missing and ``create``)."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        if not create:
            raise
        root.mkdir(parents=True, exist_ok=True)
        st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFileError(f"run folder {shown(root)} is {_kind(st.st_mode)}, not a folder; "
                              "nothing was written")
    try:
        return os.open(root, _DIR_FLAGS | os.O_NOFOLLOW)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):  # became a link since the lstat
            raise UnsafeFileError(f"run folder {shown(root)} is not a folder; nothing was "
                                  "written") from None
        raise


def _step_into(dir_fd: int, name: str, create: bool, where: Path) -> int:
    """The fd of folder ``name`` inside ``dir_fd``, never following a link (created if missing
    and ``create``); closes ``dir_fd``."""
    try:
        if create:
            try:
                os.mkdir(name, 0o777, dir_fd=dir_fd)
            except FileExistsError:
                pass
        try:
            return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                mode = os.lstat(name, dir_fd=dir_fd).st_mode
                kind = "a file" if stat.S_ISREG(mode) else _kind(mode)
                raise UnsafeFileError(f"{shown(where / name)} is {kind}; videotrain writes only "
                                      "into real folders of a run (nothing was written)") from None
            raise
    finally:
        os.close(dir_fd)


def folder_fd(folder: str | Path, root: str | Path | None = None, create: bool = True) -> int:
    """An ``O_DIRECTORY`` fd of ``folder`` (the caller closes it). Below ``root`` no link is
    followed at any component (:class:`UnsafeFileError`), and ``root`` itself is no link;
    missing folders are created when ``create``. Without ``root``, ``folder`` is the user's own
    path, opened as given."""
    folder = Path(folder)
    if root is None:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        return os.open(folder, _DIR_FLAGS)
    root = Path(root)
    fd = _open_root(root, create)
    here = root
    for name in _below(folder, root):
        fd = _step_into(fd, name, create, here)
        here = here / name
    return fd


def make_dirs(folder: str | Path, root: str | Path | None = None) -> Path:
    """Create ``folder`` (and the folders above it, below ``root``) without following a link."""
    os.close(folder_fd(folder, root, create=True))
    return Path(folder)


def make_new_dir(folder: str | Path, root: str | Path | None = None) -> bool:
    """Create ``folder`` itself, new: False where anything (a folder, a file, a link) already
    stands at its name, which is never followed. The folders above it are opened as by
    :func:`folder_fd` (created where missing). ``mkdir`` is atomic: of two processes claiming
    one name, one gets True."""
    folder = Path(folder)
    fd = folder_fd(folder.parent, root, create=True)
    try:
        os.mkdir(folder.name, 0o777, dir_fd=fd)
        return True
    except FileExistsError:
        return False
    finally:
        os.close(fd)


def list_folder(folder: str | Path, root: str | Path | None = None) -> list[str]:
    """The names in ``folder`` (opened by :func:`folder_fd`, so below ``root`` no link is
    followed: a linked folder is refused, not listed); [] when it does not exist. A folder that
    cannot be listed raises (``PermissionError``): nothing is decided from a partial view."""
    try:
        fd = folder_fd(folder, root, create=False)
    except FileNotFoundError:
        return []
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def _fsync_fd(fd: int) -> None:
    with contextlib.suppress(OSError):  # a filesystem without fsync on folders
        os.fsync(fd)


@contextlib.contextmanager
def atomic_writer(path: str | Path, root: str | Path | None = None,
                  mode: int = 0o666, durable: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new contents into: a new file (``O_EXCL |
    O_NOFOLLOW``, a random name ``.NAME.*.tmp``) in ``path``'s folder (opened by
    :func:`folder_fd`), renamed over the name when the block ends without an error, removed when
    it raises. Whatever stood at ``path`` (a link, a hard link, a FIFO) is replaced, never
    written through; a reader sees the old file or the whole new one. ``durable`` (checkpoints):
    the file and then its folder are fsynced, so a crash keeps the old file or the new one."""
    path = Path(path)
    dir_fd = folder_fd(path.parent, root)
    tmp = f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, mode,
                     dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if durable:
            _fsync_fd(dir_fd)
    finally:
        os.close(dir_fd)


def point(path: str | Path, target: str, root: str | Path | None = None,
          symbolic: bool = True) -> Path:
    """Make ``path`` name ``target``, a file beside it (a plain name, no ``/``): a relative
    symbolic link when ``symbolic``, else a hard link (made without following a link), else a
    copy; built under a new temporary name in the folder (opened by :func:`folder_fd`) and
    renamed over ``path``, so whatever stood there is replaced, never written through."""
    path = Path(path)
    if "/" in target or target in ("", ".", ".."):
        raise UnsafeFileError(f"{shown(target)}: a link in a run folder names a file beside it")
    dir_fd = folder_fd(path.parent, root)
    tmp = f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        try:
            if not symbolic:
                raise OSError("a hard link is wanted")
            os.symlink(target, tmp, dir_fd=dir_fd)
        except OSError:
            try:
                os.link(target, tmp, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except OSError:  # no hard links here: a copy, read as a regular file only
                src = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC,
                              dir_fd=dir_fd)
                with os.fdopen(src, "rb") as f_in:
                    if not stat.S_ISREG(os.fstat(f_in.fileno()).st_mode):
                        raise UnsafeFileError(f"{shown(path.parent / target)} is not a regular "
                                              "file; nothing was linked") from None
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | _CLOEXEC, 0o666, dir_fd=dir_fd)
                    with os.fdopen(fd, "wb") as f_out:
                        shutil.copyfileobj(f_in, f_out, 1 << 20)
                        f_out.flush()
                        os.fsync(f_out.fileno())
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        _fsync_fd(dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        os.close(dir_fd)
    return path


def write_bytes(path: str | Path, data: bytes, root: str | Path | None = None) -> Path:
    """Write ``data`` to ``path`` through :func:`atomic_writer` (never through a link)."""
    with atomic_writer(path, root) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | Path, text: str, root: str | Path | None = None) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"), root)


@contextlib.contextmanager
def staged_path(path: str | Path, root: str | Path | None = None) -> Iterator[Path]:
    """A path in a private temporary folder (mode 0700) for a library that writes only to a
    path (an ONNX exporter, an encoder); when the block ends without an error its file is
    copied into ``path`` through :func:`atomic_writer`."""
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="videotrain-") as tmp:
        staged = Path(tmp) / path.name
        yield staged
        with open_regular(staged, what="staged output") as src, atomic_writer(path, root) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)


def open_append(path: str | Path, root: str | Path | None = None) -> IO[str]:
    """``path`` opened for appending text, created if missing, only if it is a regular file
    with no other hard link (so that nothing elsewhere is appended to): ``O_NOFOLLOW`` and
    ``O_NONBLOCK`` (a FIFO is refused, not waited on), in a folder opened by :func:`folder_fd`."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
    dir_fd = folder_fd(path.parent, root)
    try:
        fd = os.open(path.name, flags, 0o666, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO without a reader
            raise UnsafeFileError(f"{shown(path)} is a symbolic link or a FIFO; refusing to "
                                  "write to it") from None
        raise
    finally:
        os.close(dir_fd)
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


def rename(src: str | Path, dst: str | Path, root: str | Path) -> Path:
    """Rename ``src`` to ``dst``, both inside ``root``, their folders opened without following
    a link (a name is moved, never what a link points to)."""
    src, dst = Path(src), Path(dst)
    sfd = folder_fd(src.parent, root, create=False)
    try:
        dfd = folder_fd(dst.parent, root)
        try:
            os.replace(src.name, dst.name, src_dir_fd=sfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return dst


def remove(path: str | Path, root: str | Path) -> None:
    """Remove the file (or link: the name, never its target) ``path`` inside ``root``; a
    missing one is no error."""
    path = Path(path)
    try:
        fd = folder_fd(path.parent, root, create=False)
    except FileNotFoundError:
        return
    try:
        os.unlink(path.name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
