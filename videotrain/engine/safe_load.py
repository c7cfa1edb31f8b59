"""Reading a checkpoint file that may come from someone else: ``load`` is
``torch.load(weights_only=True)`` of a regular file, after checks that need no unpickling.

A shared checkpoint is untrusted input (docs/cluster.md, "A shared run folder is untrusted
input"). Before ``torch.load``: the file must be a regular file (no FIFO or device, which would
block or never end; no symbolic link out of its folder, except that the user may name a weights
file behind links with ``follow``), and its zip records must be stored uncompressed, as
``torch.save`` writes them (a 3 MB file with a deflated record of 3 GiB of zeros is refused from
the zip's directory, before anything is inflated). After it: every tensor must hold the values
its shape claims (a stride of 0 makes 4 bytes a 10^7-class head), and the whole is bounded. A
file that needs arbitrary unpickling is refused naming the global, read from the pickle itself
(``pickle_globals``), on every torch. ``videotrain.engine.checkpoint`` re-exports all of it.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from videotrain.untrusted import UnsafeFileError, open_regular, shown

MAX_RECORDS = 1_000_000  # zip records (tensors) a checkpoint may hold
MAX_NODES = 5_000_000  # values (each container once) a checkpoint may hold
MAX_PICKLE_BYTES = 256 << 20  # the pickle read to name a refused global


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and says why."""


class UnsafeCheckpointError(CheckpointError):
    """The file needs arbitrary unpickling (code in the file would run): never loaded."""


class CorruptCheckpointError(CheckpointError):
    """The file is truncated or otherwise unreadable (e.g. a crash or a full disk)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


# globals torch's weights_only unpickler takes (tensors, storages, OrderedDict, ...); any other
# global in a checkpoint's pickle is what it refuses, named in the error on every torch
_SAFE_GLOBALS = ("torch.", "collections.OrderedDict", "_codecs.encode", "builtins.set",
                 "builtins.frozenset", "builtins.bytearray", "builtins.slice", "builtins.complex",
                 "builtins.int", "builtins.float", "builtins.str", "builtins.bool")


def pickle_globals(data: bytes) -> list[str]:
    """``module.name`` of every global a pickle imports (``GLOBAL``, ``STACK_GLOBAL``),
    read with ``pickletools`` without running anything."""
    import pickletools

    found: list[str] = []
    strings: list[Any] = []  # the values pushed, as far as STACK_GLOBAL needs them
    memo: dict[int, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                found.append(".".join(str(arg).split(" ", 1)))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
                strings.append(None)
            elif isinstance(arg, str) and ("UNICODE" in op.name or op.name.endswith("STRING")):
                strings.append(arg)
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = strings[-1] if strings else None
            elif op.name == "MEMOIZE":
                memo[len(memo)] = strings[-1] if strings else None
            elif op.name in ("BINGET", "LONG_BINGET", "GET"):
                strings.append(memo.get(int(arg)))
            else:
                strings.append(None)
    except Exception:  # noqa: BLE001 - a broken pickle: what was read so far
        pass
    return found


def _pickle_bytes(f: IO[bytes]) -> bytes:
    """The pickle of a checkpoint file (``*/data.pkl`` of the zip, else the file), bounded."""
    f.seek(0)
    if zipfile.is_zipfile(f):
        f.seek(0)
        with zipfile.ZipFile(f) as z:
            for info in z.infolist():
                if info.filename.endswith("data.pkl") and info.file_size <= MAX_PICKLE_BYTES:
                    return z.read(info)
        return b""
    f.seek(0)
    return f.read(MAX_PICKLE_BYTES)


def _unpickling_reason(err: Exception, f: IO[bytes]) -> str:
    """The global torch refused, read from the pickle itself (torch 2.11 and 2.14 word it
    differently, and 2.14 puts its advice to turn weights_only off first), escaped."""
    try:
        names = pickle_globals(_pickle_bytes(f))
    except Exception:  # noqa: BLE001
        names = []
    refused = [n for n in names if not n.startswith(_SAFE_GLOBALS)]
    if refused:
        return f"unsupported global {shown(refused[0])}"
    text = str(err)
    found = re.search(r"GLOBAL\s+(\S+)", text) or re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n\n|$)", text, re.S)
    return shown(" ".join(found.group(1).split())) if found else "a value weights_only refuses"


def _open_checkpoint(path: Path, follow: bool = False) -> IO[bytes]:
    """``path`` opened if it is a regular file; ``last.ckpt``, a symbolic link to a step file
    beside it, is followed to that file, and no other link is (nor a FIFO or device).
    ``follow``: a weights file the user names (``model.init_from``), which may sit behind links
    (a model cache); it must still be a regular file."""
    if follow:
        try:
            return open_regular(path, what="checkpoint", follow=True)
        except UnsafeFileError as err:
            raise UnsafeCheckpointError(str(err)) from None
    if path.is_symlink():
        target = os.readlink(path)
        if "/" in target or target in (".", ".."):
            raise UnsafeCheckpointError(
                f"checkpoint {shown(path)} is a symbolic link out of its folder (to "
                f"{shown(target)}); videotrain follows only last.ckpt's link to a file beside it. "
                "If you trust it, pass the file it names as checkpoint=")
        path = path.with_name(target)
    try:
        return open_regular(path, what="checkpoint")
    except UnsafeFileError as err:
        raise UnsafeCheckpointError(str(err)) from None


def _check_records(f: IO[bytes], path: Path) -> None:
    """Refuse a zip checkpoint whose records would inflate: ``torch.save`` stores every record
    uncompressed, so a compressed one (a small file that inflates to gigabytes) is refused
    before ``torch.load`` inflates it."""
    f.seek(0)
    if not zipfile.is_zipfile(f):
        f.seek(0)
        return
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CorruptCheckpointError(f"{shown(path)} is truncated or corrupt (a bad zip: "
                                     f"{shown(str(err))})", "a bad zip") from None
    if len(infos) > MAX_RECORDS:
        raise UnsafeCheckpointError(f"{shown(path)} holds {len(infos)} records, more than the "
                                    f"{MAX_RECORDS} a checkpoint may hold")
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > info.compress_size:
            raise UnsafeCheckpointError(
                f"{shown(path)}: record {shown(info.filename)} is compressed ({info.compress_size} "
                f"bytes inflate to {info.file_size}); torch.save stores records uncompressed, and "
                "videotrain does not inflate a checkpoint's records")
    f.seek(0)


def check_tensors(obj: Any, path: Path, max_nodes: int = MAX_NODES) -> None:
    """Walk what a checkpoint loaded (each container once, at most ``max_nodes`` values: shared
    references are bounded where they are expanded, e.g. ``untrusted.plain_tree_problem`` for a
    stored config) and refuse a tensor that claims more memory than it stores: a
    stride of 0 in a dimension of size > 1 (4 bytes on disk read as a 10^7-class head), or an
    extent past its storage."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    seen: set[int] = set()  # a container or tensor met again (a pickle's shared reference)
    visits = 0
    while stack:
        node, where = stack.pop()
        if isinstance(node, (dict, list, tuple, torch.Tensor)):
            if id(node) in seen:
                continue
            seen.add(id(node))
        visits += 1
        if visits > max_nodes:
            raise UnsafeCheckpointError(f"{shown(path)} holds more than {max_nodes} values (or "
                                        "shared references that expand to as many); refusing it")
        if isinstance(node, torch.Tensor):
            if node.layout != torch.strided:
                raise UnsafeCheckpointError(f"{shown(path)}: tensor {shown(where)} is not a dense "
                                            "tensor; checkpoints hold dense tensors only")
            extent = node.storage_offset() + sum((n - 1) * s for n, s in zip(node.shape, node.stride(), strict=True)
                                                 if n > 0) + 1
            zero = any(s == 0 and n > 1 for n, s in zip(node.shape, node.stride(), strict=True))
            stored = node.untyped_storage().nbytes() // max(node.element_size(), 1)
            if node.numel() and (zero or extent > stored):
                raise UnsafeCheckpointError(
                    f"{shown(path)}: tensor {shown(where)} of shape {tuple(node.shape)} is stored "
                    f"in {stored} values (stride {tuple(node.stride())}); a checkpoint's tensors "
                    "store every value they hold")
        elif isinstance(node, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))


def load(path: str | Path, map_location: str | torch.device = "cpu", follow: bool = False) -> Any:
    """The one way videotrain reads a checkpoint: ``torch.load(weights_only=True)`` of a
    regular file (``_open_checkpoint``: no FIFO, device, or link out of its folder) whose zip
    records are stored uncompressed (``_check_records``), then ``check_tensors``.

    Raises ``UnsafeCheckpointError`` for a file that needs arbitrary unpickling (nothing in it
    runs, and the global refused is named) or that fails those checks, and
    ``CorruptCheckpointError`` for a truncated or unreadable one; both name the file.
    """
    path = Path(path)
    with _open_checkpoint(path, follow) as f:
        _check_records(f, path)
        try:
            with warnings.catch_warnings():  # torch's note on plain pickle files, refused anyway
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                blob = torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"{shown(path)} is not a safe videotrain checkpoint: it needs arbitrary unpickling "
                f"({_unpickling_reason(err, f)}); refusing to load it. videotrain reads "
                "checkpoints with torch.load(weights_only=True): tensors and plain Python values "
                "only") from None
        except (RuntimeError, EOFError, ValueError) as err:  # what torch raises on a cut-off file
            first = shown(str(err).split(". ")[0].strip() or type(err).__name__)
            raise CorruptCheckpointError(f"{shown(path)} is truncated or corrupt ({first})",
                                         first) from err
    check_tensors(blob, path)
    return blob
