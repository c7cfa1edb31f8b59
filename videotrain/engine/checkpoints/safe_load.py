"""Reading a checkpoint file that may come from someone else: ``load`` is
``torch.load(weights_only=True)`` of a regular file, after checks that need no unpickling and
before anything of it is used.

A shared checkpoint is untrusted input (docs/cluster.md, "A shared run folder is untrusted
input"). Before ``torch.load``: a regular file (no FIFO, device or link out of its folder) of
bounded length, zip records stored uncompressed, and a pickle bounded in bytes and in the work
and memory torch's unpickler would spend (``pickle_cost``). After it: the whole structure once
(``check_tensors``: bounded values and depth, no shared containers, every tensor holding the
values its shape claims), then every field videotrain reads against its schema (``CHECKPOINT``).
A file that needs arbitrary unpickling is refused naming the global (``pickle_globals``).
``videotrain.engine.checkpoints.format`` re-exports all of it; the bounds are
``videotrain.untrusted.bounds``'. Each check's reason: ``docs/design/internals.md``.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
import warnings
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from videotrain.untrusted import UnsafeFileError, open_regular, shown
from videotrain.untrusted.bounds import (
    ANY,
    BOOL,
    MAX_CHECKPOINT_BYTES,
    MAX_CHECKPOINT_DEPTH,
    MAX_CHECKPOINT_RECORDS,
    MAX_CHECKPOINT_VALUES,
    MAX_CLASSES,
    MAX_LIST,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_PICKLE_BYTES,
    MAX_PICKLE_OPS,
    MAX_STEPS,
    MAX_UNPICKLED_BYTES,
    BadValue,
    Choice,
    Either,
    Float,
    Instance,
    Int,
    Map,
    Optional,
    Seq,
    Str,
    Tree,
    checked,
    structure_problem,
)


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


# ---------------------------------------------------------------------- the pickle, unread
# What each opcode of torch's weights-only unpickler costs at most: the bytes of its argument
# (or None: variable, read below) and the memory it builds. Every value it pushes costs a slot
# (_SLOT: a list's pointer, or a dict's or set's entry with its growth) besides its object.
_SLOT = 96
_OPCODES: dict[int, tuple[int | None, int]] = {
    **{ord(op): (0, _SLOT) for op in "N\x88\x89)"},  # None, True, False, (): shared objects
    ord("]"): (0, 56 + _SLOT), ord("}"): (0, 64 + _SLOT), 0x8F: (0, 216 + _SLOT),  # [] {} set()
    ord("("): (0, 64), ord("t"): (0, 40 + _SLOT),  # a mark (a new stack list); a tuple of it
    0x85: (0, 48 + _SLOT), 0x86: (0, 56 + _SLOT), 0x87: (0, 64 + _SLOT),  # TUPLE1-3
    ord("a"): (0, 0), ord("e"): (0, 0), ord("s"): (0, 0), ord("u"): (0, 0),  # slots counted
    ord("b"): (0, 0),  # BUILD: a state already counted, copied in
    ord("K"): (1, _SLOT), ord("M"): (2, 32 + _SLOT), ord("J"): (4, 32 + _SLOT),  # ints
    ord("G"): (8, 24 + _SLOT),  # a float
    ord("h"): (1, _SLOT), ord("j"): (4, _SLOT), ord("q"): (1, 100), ord("r"): (4, 100),  # memo
    ord("R"): (0, 1024), 0x81: (0, 1024), ord("Q"): (0, 256),  # a call: a tensor, a storage
    ord("X"): (None, 80 + _SLOT), ord("U"): (None, 64 + _SLOT), 0x8A: (None, 40 + _SLOT),
    ord("c"): (None, _SLOT), 0x80: (1, 0),  # GLOBAL, PROTO
}
_STOP = ord(".")


def pickle_cost(data: bytes, max_ops: int = MAX_PICKLE_OPS,
                max_cost: int = MAX_UNPICKLED_BYTES) -> tuple[int, int]:
    """``(opcodes, bytes)``: how many opcodes torch's weights-only unpickler would run on
    ``data`` (one pickle or several in a row, as the legacy format has) and at most how much
    memory they would build, read from the opcodes without building anything. Counting stops
    past ``max_ops`` or ``max_cost``, at the end, or at an opcode that unpickler refuses (it
    stops there too)."""
    ops = cost = pos = 0
    end = len(data)
    table = _OPCODES
    while pos < end and ops <= max_ops and cost <= max_cost:
        op = data[pos]
        if op == _STOP:
            pos += 1
            if pos < end and data[pos] != 0x80:  # what follows is no further pickle
                break
            continue
        entry = table.get(op)
        if entry is None:
            break
        size, built = entry
        ops += 1
        pos += 1
        if size is None:  # an argument of its own length
            if op == ord("X"):
                (size,) = struct.unpack_from("<I", data, pos) if pos + 4 <= end else (0,)
                built += 4 * size  # UTF-8 text, at worst four bytes a character in a str
                size += 4
            elif op == ord("c"):
                second = data.find(b"\n", data.find(b"\n", pos) + 1)
                size = (second if second >= 0 else end) + 1 - pos
            else:  # SHORT_BINSTRING, LONG1: a one-byte length
                size = (data[pos] if pos < end else 0) + 1
                built += size
        cost += built
        pos += size
    return ops, cost


def _check_pickle(data: bytes, path: Path, name: str) -> None:
    """Refuse a pickle whose unpickling would run more than ``MAX_PICKLE_OPS`` opcodes or build
    more than ``MAX_UNPICKLED_BYTES`` (:func:`pickle_cost`), before torch's unpickler runs."""
    ops, cost = pickle_cost(data)
    if ops > MAX_PICKLE_OPS or cost > MAX_UNPICKLED_BYTES:
        what = (f"more than {MAX_PICKLE_OPS} opcodes" if ops > MAX_PICKLE_OPS else
                f"values of about {cost >> 20} MB, more than the {MAX_UNPICKLED_BYTES >> 20} MB")
        raise UnsafeCheckpointError(
            f"{shown(path)}: its pickle ({shown(name)}, {len(data)} bytes) would build {what} a "
            "checkpoint's pickle may; refusing it before unpickling anything")


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
    """``path`` opened if it is a regular file of at most ``MAX_CHECKPOINT_BYTES`` (its
    length: a sparse file counts whole); ``last.ckpt``, a symbolic link to a step file beside
    it, is followed to that file, and no other link is (nor a FIFO or device). ``follow``: a
    weights file the user names (``model.init_from``), which may sit behind links (a model
    cache); it must still be a regular file."""
    if follow:
        try:
            return open_regular(path, MAX_CHECKPOINT_BYTES, what="checkpoint", follow=True)
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
        return open_regular(path, MAX_CHECKPOINT_BYTES, what="checkpoint")
    except UnsafeFileError as err:
        raise UnsafeCheckpointError(str(err)) from None


_STORAGE_RECORD = re.compile(r"/data/[0-9]+\Z")  # a tensor's bytes: read as much as it claims


def _check_records(f: IO[bytes], path: Path, follow: bool = False) -> None:
    """Refuse a checkpoint whose records would inflate or whose pickle is too costly, before
    ``torch.load`` reads any: ``torch.save`` stores every record uncompressed, so a compressed
    one (a small file that inflates to gigabytes) is refused; the records that are not a
    tensor's bytes may hold ``MAX_PICKLE_BYTES`` together, and every pickle record is
    :func:`_check_pickle`'d.
    A file that is not a zip (a plain pickle, or torch's legacy format) is one pickle of at most
    ``MAX_PICKLE_BYTES``; a weights file the user names (``follow``) may be larger."""
    f.seek(0)
    if not zipfile.is_zipfile(f):
        f.seek(0)
        if follow:
            return
        data = f.read(MAX_PICKLE_BYTES + 1)
        if len(data) > MAX_PICKLE_BYTES:
            raise UnsafeCheckpointError(
                f"{shown(path)} is not a zip (torch.save's format since torch 1.6) and larger than "
                f"the {MAX_PICKLE_BYTES} bytes such a file may have; refusing it unread")
        _check_pickle(data, path, path.name)
        f.seek(0)
        return
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
            if len(infos) > MAX_CHECKPOINT_RECORDS:
                raise UnsafeCheckpointError(f"{shown(path)} holds {len(infos)} records, more than "
                                            f"the {MAX_CHECKPOINT_RECORDS} a checkpoint may hold")
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED or info.file_size > info.compress_size:
                    raise UnsafeCheckpointError(
                        f"{shown(path)}: record {shown(info.filename)} is compressed "
                        f"({info.compress_size} bytes inflate to {info.file_size}); torch.save "
                        "stores records uncompressed, and videotrain does not inflate a "
                        "checkpoint's records")
            other = sum(i.file_size for i in infos if not _STORAGE_RECORD.search(i.filename))
            if other > MAX_PICKLE_BYTES:  # the pickle and torch's small records, read whole
                raise UnsafeCheckpointError(
                    f"{shown(path)}: its records other than tensors' hold {other} bytes, more than "
                    f"the {MAX_PICKLE_BYTES} bytes they may; refusing it unread")
            for info in infos:
                if info.filename.endswith(".pkl"):
                    _check_pickle(z.read(info), path, info.filename)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CorruptCheckpointError(f"{shown(path)} is truncated or corrupt (a bad zip: "
                                     f"{shown(str(err))})", "a bad zip") from None
    f.seek(0)


# ---------------------------------------------------------------------- what was loaded
def _tensor_problem(node: Any) -> str | None:
    """Why a tensor that ``torch.load`` built may not be used: not dense, or it claims more
    values than its storage holds (a stride of 0 in a dimension of size > 1, or an extent
    past its storage)."""
    if not isinstance(node, torch.Tensor):
        return None
    if node.layout != torch.strided:
        return "a tensor that is not dense; checkpoints hold dense tensors only"
    extent = node.storage_offset() + sum((n - 1) * s for n, s in zip(node.shape, node.stride(), strict=True)
                                         if n > 0) + 1
    zero = any(s == 0 and n > 1 for n, s in zip(node.shape, node.stride(), strict=True))
    stored = node.untyped_storage().nbytes() // max(node.element_size(), 1)
    if node.numel() and (zero or extent > stored):
        return (f"a tensor of shape {tuple(node.shape)} stored in {stored} values (stride "
                f"{tuple(node.stride())}); a checkpoint's tensors store every value they hold")
    return None


def check_tensors(obj: Any, path: Path, max_nodes: int = MAX_CHECKPOINT_VALUES) -> None:
    """Walk what a checkpoint loaded once (``untrusted.bounds.structure_problem``: at most
    ``max_nodes`` values, ``MAX_CHECKPOINT_DEPTH`` deep, no container met twice: a pickle's
    shared references would expand to gigabytes where the values are copied or compared) and
    refuse a tensor that claims more memory than it stores (:func:`_tensor_problem`)."""
    problem = structure_problem(obj, max_nodes, MAX_CHECKPOINT_DEPTH, _tensor_problem)
    if problem:
        raise UnsafeCheckpointError(f"{shown(Path(path))}: {problem}; refusing it")


# ---------------------------------------------------------------------- the fields read
def _rng_tensor(numel: int | None, dtype: torch.dtype, lo: int | None = None,
                hi: int | None = None) -> Instance:
    def fits(t: torch.Tensor) -> bool:
        if t.dtype != dtype or t.dim() != 1 or (numel is not None and t.numel() != numel):
            return False
        return lo is None or not t.numel() or bool(t.min() >= lo and t.max() <= hi)
    return Instance(torch.Tensor, f"a 1-d {dtype} tensor" + (f" of {numel} values" if numel else ""),
                    fits)


_TENSOR = Instance(torch.Tensor, "a tensor")
_WEIGHTS = Map(extra=_TENSOR, keys=Str(MAX_NAME_CHARS), max_len=MAX_CHECKPOINT_RECORDS)
_SECONDS = Seq(Float(), MAX_LIST)  # per step (a difference of two clocks may dip below 0)
_GROUPS = 100_000  # an optimizer's parameter groups, a scheduler's learning rates
_RNG = Map({
    "python": Map({"version": Int(0, 100), "state": _rng_tensor(625, torch.int64, 0, 2**32 - 1),
                   "gauss_next": Optional(Float(finite=False))},
                  required=("version", "state", "gauss_next")),
    "numpy": Map({"kind": Choice("MT19937"), "keys": _rng_tensor(624, torch.int64),
                  "pos": Int(0, 624), "has_gauss": Int(0, 1),
                  "cached_gaussian": Float(finite=False)},
                 required=("kind", "keys", "pos", "has_gauss", "cached_gaussian")),
    "torch": _rng_tensor(torch.get_rng_state().numel(), torch.uint8),
    "cuda": Seq(_rng_tensor(None, torch.uint8), 4096),
}, required=("python", "numpy", "torch"))

# Every field of a videotrain checkpoint that videotrain reads (engine/run_checkpoints.py's
# TrainState and Checkpointed, trained_run, class_order, finetune), as it stores them; a field
# is checked where present (a plain state dict has none of them). Other keys (a plain state
# dict's tensors) are bounded by the structure walk and checked by their readers (the model's
# keys and shapes: models/weights.key_mismatches, engine/resume.weights_problem).
CHECKPOINT = Map({
    "videotrain_format": Int(0, 1000),
    "model": _WEIGHTS, "ema_model": _WEIGHTS, "ema_updates": Int(0, MAX_STEPS),
    "optimizer": Map({"state": Map(extra=Map(extra=ANY), keys=Int(0, MAX_CHECKPOINT_RECORDS),
                                   max_len=MAX_CHECKPOINT_RECORDS),
                      "param_groups": Seq(Map({"params": Seq(Int(0, MAX_CHECKPOINT_RECORDS),
                                                             MAX_CHECKPOINT_RECORDS)},
                                              required=("params",), extra=ANY), _GROUPS)},
                     required=("state", "param_groups"), extra=ANY),
    "scheduler": Map({"base_lrs": Seq(Float(), _GROUPS), "_last_lr": Seq(Float(), _GROUPS),
                      "last_epoch": Int(-1, MAX_STEPS), "_step_count": Int(0, MAX_STEPS),
                      "lr_lambdas": Seq(Optional(Map(extra=ANY)), _GROUPS)},
                     extra=Optional(Either(Float(finite=False), BOOL))),
    "scaler": Map(extra=Float(finite=False)),
    "strategy": Map(extra=ANY),
    "step": Int(0, MAX_STEPS), "epoch": Int(0, MAX_STEPS), "consumed": Int(0, MAX_STEPS),
    "total_steps": Int(0, MAX_STEPS), "val_step": Int(-1, MAX_STEPS),
    "best_step": Int(-1, MAX_STEPS), "best_top1": Float(-1.0, 100.0),
    "skipped": Seq(Str(MAX_PATH_CHARS), MAX_LIST),
    "step_times": _SECONDS, "data_waits": _SECONDS,
    "peaks": Seq(Float(0.0), MAX_LIST),  # MB per step: eval's memory budget (trained_run)
    "last_val": Map(extra=Optional(Float(finite=False)), max_len=10_000),
    "rng_per_rank": Seq(_RNG, 1 << 16, min_len=1), "world_size": Int(1, 1 << 16),
    "config": Optional(Tree()), "config_seal": Optional(Str(256)),
    "class_names": Optional(Seq(Str(MAX_NAME_CHARS), MAX_CLASSES)),
}, extra=ANY, max_len=MAX_CHECKPOINT_VALUES)


def checked_fields(blob: Any, path: str | Path) -> Any:
    """``blob`` (walked by :func:`check_tensors` already) if every field videotrain reads has
    its declared type and bound (:data:`CHECKPOINT`), else ``CheckpointError`` naming the file
    and the key, never the value."""
    if not isinstance(blob, dict):
        return blob  # a bare tensor or list: its reader says what it expected
    try:
        return checked(blob, CHECKPOINT, shown(Path(path)), max_nodes=None)
    except BadValue as err:
        raise CheckpointError(f"{err}; not a checkpoint videotrain wrote, refusing it") from None


# what torch.load raises on a truncated file, and its weights-only unpickler on opcodes that do
# not make a pickle (an empty stack popped, a memo key never put, a short argument)
_BROKEN = (RuntimeError, EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError,
           AssertionError, OverflowError, struct.error)


def load(path: str | Path, map_location: str | torch.device = "cpu", follow: bool = False) -> Any:
    """The one way videotrain reads a checkpoint: ``torch.load(weights_only=True)`` of a
    regular file (``_open_checkpoint``: no FIFO, device, or link out of its folder; bounded by
    its length) whose zip records are stored uncompressed and whose pickle is bounded
    (``_check_records``), then ``check_tensors`` and, for a checkpoint (not a weights file the
    user names with ``follow``), ``checked_fields``.

    Raises ``UnsafeCheckpointError`` for a file that needs arbitrary unpickling (nothing in it
    runs, and the global refused is named) or that fails those checks, ``CheckpointError`` for
    a field out of its schema, and ``CorruptCheckpointError`` for a truncated or unreadable one;
    all name the file.
    """
    path = Path(path)
    with _open_checkpoint(path, follow) as f:
        _check_records(f, path, follow)
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
        except _BROKEN as err:  # what torch raises on a cut-off or broken file
            first = shown(str(err).split(". ")[0].strip() or type(err).__name__)
            raise CorruptCheckpointError(f"{shown(path)} is truncated or corrupt ({first})",
                                         first) from err
    check_tensors(blob, path)
    return blob if follow else checked_fields(blob, path)
