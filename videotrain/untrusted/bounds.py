"""The one reader's bounds: what a value read from someone else's file may be.

Every value read from a checkpoint, ``results.json``, ``metrics.jsonl``, a sweep folder or a
config is checked here before use, and this module owns the bounds: every size, count and
depth an untrusted reader applies is a named constant below, which the readers import.

* :func:`structure_problem` / :func:`plain_tree_problem`: a structure as a whole, walked once
  without recursion: at most so many values, so deep, and no container met twice (a pickle's
  memo or a YAML alias: a few KB that expand to gigabytes where something copies or compares);
* a declared schema (``Int``, ``Float``, ``Str``, ``BOOL``, ``Choice``, ``Optional``, ``Seq``,
  ``Map``, ``Either``, ``Instance``, ``Tree``, ``ANY``) and :func:`checked`, which raises one
  error type, :class:`BadValue`, naming the file and the key path and what was expected, never
  the value.

The bounded readers of JSON, JSON lines and YAML that apply them are ``untrusted.formats``'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from videotrain.untrusted.text import shown

MAX_CONFIG_NODES = 20_000  # a run's resolved config has a few hundred
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_BYTES = 1 << 20  # a run's config.yaml is a few KB (and YAML parses ~1 MB/s)
MAX_OVERRIDES_BYTES = 256 << 10  # .hydra/overrides.yaml: a list of key=value lines
MAX_ANNOTATION_BYTES = 128 << 20  # the largest official list (Kinetics-700 train) is ~30 MB
# lines of one annotation list (Kinetics-700's train list has ~545k, Moments in Time's ~802k),
# counted in chunks before any line is parsed, and the characters of one line (a path, a label)
MAX_ANNOTATION_LINES = 1_000_000
MAX_ANNOTATION_LINE_CHARS = 16 << 10
# an annotation JSON (SSv2's train.json: ~169k entries, ~26 MB, ~3.7 million values as counted
# on its text): its size, and its values counted before it is parsed
MAX_ANNOTATION_JSON_BYTES = 64 << 20
MAX_ANNOTATION_JSON_VALUES = 8_000_000

# results.json (class names, a sweep job's figures) and metrics.jsonl (read back on resume: a
# row of ~250 bytes every trainer.log_every_n_steps, 10 by default, so five million steps fit;
# a line is parsed in ~10 us)
MAX_RESULTS_BYTES = 64 << 20
MAX_JSON_VALUES = 2_000_000  # values in one JSON document, counted before it is parsed
MAX_METRICS_BYTES = 256 << 20
MAX_METRICS_LINES = 500_000
MAX_METRICS_LINE_BYTES = 64 << 10

# checkpoints (videotrain.engine.checkpoints.safe_load). The file counts by its length (st_size: a sparse
# file's holes count). Its pickle (data.pkl) is bounded before torch's unpickler runs: bytes,
# and the opcodes and the memory they build, counted from the pickle itself (~1 us per opcode;
# a step's recorded times cost ~27 bytes, so ~500,000 steps fit); then every value once.
MAX_CHECKPOINT_BYTES = 16 << 30
MAX_CHECKPOINT_RECORDS = 1_000_000  # zip records (tensors)
MAX_PICKLE_BYTES = 64 << 20
MAX_PICKLE_OPS = 4_000_000
MAX_UNPICKLED_BYTES = 256 << 20
MAX_CHECKPOINT_VALUES = 4_000_000  # values (each container once) after loading
MAX_CHECKPOINT_DEPTH = 32

# values inside those files
MAX_CLASSES = 1_000_000  # a head with more rows is not a video classifier's
MAX_NAME_CHARS = 1024  # a class name as stored (shown cut much shorter: text.NAME_CHARS)
MAX_PATH_CHARS = 4096  # a path as stored (PATH_MAX)
MAX_KEY_CHARS = 256  # a metric's or a setting's name
MAX_STEPS = 10**12  # a step, epoch or sample count
MAX_LIST = 10_000_000  # items in one list of numbers (a run's per-step records)

# a sweep folder (scripts/summarize_sweep.py): walked without following links
MAX_SWEEP_ENTRIES = 200_000
MAX_SWEEP_DEPTH = 16

# What one video may cost (predict, eval, training: videotrain.data.media_budget checks them,
# from the header before decoding and on every decoded frame before it becomes RGB). A few KB
# of H.264 can declare 8192x8192 frames or fifty million of them; docs/data.md states these.
MAX_FRAME_PIXELS = 4096 * 4096  # width x height of one frame (16.8 MP: 4K DCI fits)
MAX_VIDEO_FRAMES = 36_000  # frames in one video: 20 minutes at 30 fps, 10 at 60
MAX_DECODED_PIXELS = 2**35  # decoded in one read of a video: 16,000 frames at 1920x1080
MAX_DECODED_BYTES = 320 * 2**20  # held at once by one read: frames waiting + the RGB returned
MAX_FFMPEG_ALLOC = 64 * 2**20  # any one allocation FFmpeg makes (its index of a file's frames)

# what a config read from a file that this user did not seal may set of the clip the model sees
# (videotrain.config.files.model_part); larger values are refused naming the key. A frame of
# 512 px short side and 128 frames is past every shipped model; the command line may go further.
FILE_DATA_BOUNDS = {"num_frames": 128, "crop_size": 448, "short_side": 512,
                    "sampling_rate": 64, "fps": 240}


_SCALAR_TYPES = (str, int, float, bool, type(None))
_CONTAINERS = (dict, list, tuple)


def _shareable(node: Any) -> bool:
    """A short tuple of scalars, which nothing expands: torch's optimizer hands every
    parameter group the same ``betas`` tuple, so a checkpoint's pickle shares it."""
    return type(node) is tuple and len(node) <= 16 and all(type(v) in _SCALAR_TYPES for v in node)


def _where(chain: tuple | None) -> str:
    """The key path of a ``(parent chain, key)`` chain: ``a.b[3].c`` (a list's index is a
    1-tuple), escaped and cut when shown."""
    keys: list[Any] = []
    while chain is not None:
        chain, key = chain
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out = f"{out}[{key[0]}]" if type(key) is tuple else (f"{out}.{key}" if out else str(key))
    return shown(out)


def structure_problem(obj: Any, max_nodes: int, max_depth: int,
                      leaf: Callable[[Any], str | None] | None = None) -> str | None:
    """Why ``obj`` may not be used, or None: more than ``max_nodes`` values, nested deeper than
    ``max_depth``, a container (dict, list, tuple) met twice (a shared reference; a short tuple
    of scalars excepted, :func:`_shareable`), a mapping key that is not ``str`` or ``int``, or
    what ``leaf(value)`` says of a value that is neither a container nor a scalar. Walked
    without recursion, each container once (key paths are built only for the message); stops
    at the first problem, after at most ``max_nodes`` visits."""
    seen: set[int] = set()
    stack: list[tuple[Any, int, tuple | None]] = [(obj, 0, None)]
    count = 0
    scalars = _SCALAR_TYPES
    while stack:
        node, depth, chain = stack.pop()
        count += 1
        if count > max_nodes:
            return f"more than {max_nodes} values"
        if depth > max_depth:
            return f"nested more than {max_depth} levels deep (at {_where(chain)})"
        if isinstance(node, _CONTAINERS):
            if id(node) in seen:
                if _shareable(node):
                    continue
                return f"a shared reference at {_where(chain)} (an alias: one node used twice)"
            seen.add(id(node))
            pairs = node.items() if isinstance(node, dict) else enumerate(node)
            is_dict = isinstance(node, dict)
            for key, value in pairs:
                if is_dict and type(key) not in (str, int):
                    return f"a key of type {type(key).__name__} at {_where(chain)}"
                if type(value) in scalars:  # counted here, not stacked
                    count += 1
                    if count > max_nodes:
                        return f"more than {max_nodes} values"
                else:
                    stack.append((value, depth + 1, (chain, key if is_dict else (key,))))
        elif leaf is not None and type(node) not in scalars:
            problem = leaf(node)
            if problem:
                return f"{problem} (at {_where(chain)})"
    return None


def _plain_leaf(node: Any) -> str | None:
    return f"a {type(node).__name__}"


def plain_tree_problem(obj: Any, max_nodes: int = MAX_CONFIG_NODES,
                       max_depth: int = MAX_CONFIG_DEPTH) -> str | None:
    """Why ``obj`` (a config read from a file or a checkpoint, as plain Python values) may not
    be expanded, or None: :func:`structure_problem`, and a value that is not
    ``dict``/``list``/``tuple``/``str``/``int``/``float``/``bool``/None."""
    return structure_problem(obj, max_nodes, max_depth, _plain_leaf)


# ---------------------------------------------------------------------- the declared schema
class BadValue(ValueError):
    """A value read from a file that its declared schema refuses. The message names the file
    (and line), the key path and what was expected; of the value only its kind and size."""


class _Mismatch(Exception):
    """Raised by a spec; each container on the way up adds its key (``keys``, innermost
    first), so a path is built only for the value that failed."""

    def __init__(self, expected: str, value: Any, missing: bool = False) -> None:
        super().__init__(expected)
        self.expected, self.value, self.missing = expected, value, missing
        self.keys: list[Any] = []

    def inside(self, key: Any) -> _Mismatch:
        self.keys.append(key)
        return self

    def where(self) -> str:
        out = ""
        for key in reversed(self.keys):
            out = f"{out}[{key}]" if type(key) is int else (f"{out}.{key}" if out else str(key))
        return shown(out, 200) if out else "the value"


def _kind_of(value: Any) -> str:
    """What ``value`` is, as an error may say it: a number itself (bounded), else its kind and
    size; never a string's or a key's text."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if abs(value) < 10**15 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    if isinstance(value, Mapping):
        return f"a mapping of {len(value)} keys"
    return f"a {type(value).__name__}"


class Spec:
    """A declared type and bound of a value read from a file; ``expected`` says it in words.
    ``check`` raises ``_Mismatch`` (which :func:`checked` turns into :class:`BadValue`)."""

    expected = "a value"

    def check(self, value: Any) -> None:
        raise NotImplementedError

    def _fail(self, value: Any) -> _Mismatch:
        return _Mismatch(self.expected, value)


class _Any(Spec):
    def check(self, value: Any) -> None:
        return None


ANY: Spec = _Any()  # not checked here (the structure walk still bounds it; a reader checks it)


def _range(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f" from {lo} to {hi}"
    if lo is not None:
        return f" of at least {lo}"
    return f" of at most {hi}" if hi is not None else ""


class Int(Spec):
    """An integer (not a bool) in ``[lo, hi]``."""

    def __init__(self, lo: int | None = None, hi: int | None = None) -> None:
        self.lo, self.hi = lo, hi
        self.expected = f"an integer{_range(lo, hi)}"

    def check(self, value: Any) -> None:
        if type(value) is not int or (self.lo is not None and value < self.lo) \
                or (self.hi is not None and value > self.hi):
            raise self._fail(value)


_FLOAT_MAX = 2**1023


class Float(Spec):
    """A number (an int or a float, not a bool) in ``[lo, hi]``; finite unless ``finite`` is
    False (NaN and infinities pass then, bounds aside)."""

    def __init__(self, lo: float | None = None, hi: float | None = None,
                 finite: bool = True) -> None:
        self.lo, self.hi, self.finite = lo, hi, finite
        self.expected = f"a {'finite ' if finite else ''}number{_range(lo, hi)}"

    def check(self, value: Any) -> None:
        if type(value) not in (int, float) or (type(value) is int and abs(value) > _FLOAT_MAX):
            raise self._fail(value)  # an int no float can hold fails where it is formatted
        if not math.isfinite(value):
            if self.finite:
                raise self._fail(value)
            return
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise self._fail(value)


class Str(Spec):
    """A string of at most ``max_len`` characters."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.expected = f"a string of at most {max_len} characters"

    def check(self, value: Any) -> None:
        if type(value) is not str or len(value) > self.max_len:
            raise self._fail(value)


class _Bool(Spec):
    expected = "true or false"

    def check(self, value: Any) -> None:
        if type(value) is not bool:
            raise self._fail(value)


BOOL: Spec = _Bool()


class Choice(Spec):
    """One of ``values`` (strings or numbers, compared by type and value)."""

    def __init__(self, *values: Any) -> None:
        self.values = values
        self.expected = "one of " + ", ".join(repr(v) for v in values)

    def check(self, value: Any) -> None:
        if not any(type(value) is type(v) and value == v for v in self.values):
            raise self._fail(value)


class Optional(Spec):
    """None, or what ``spec`` accepts."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.expected = f"null or {spec.expected}"

    def check(self, value: Any) -> None:
        if value is not None:
            try:
                self.spec.check(value)
            except _Mismatch as bad:
                if bad.keys or bad.missing:  # below this value: that key's own expectation
                    raise
                raise self._fail(value) from None


class Either(Spec):
    """What any of ``specs`` accepts (tried in turn)."""

    def __init__(self, *specs: Spec) -> None:
        self.specs = specs
        self.expected = " or ".join(s.expected for s in specs)

    def check(self, value: Any) -> None:
        for spec in self.specs:
            try:
                spec.check(value)
                return
            except _Mismatch:
                continue
        raise self._fail(value)


class Seq(Spec):
    """A list (or tuple) of ``min_len`` to ``max_len`` items, each what ``of`` accepts."""

    def __init__(self, of: Spec, max_len: int, min_len: int = 0) -> None:
        self.of, self.max_len, self.min_len = of, max_len, min_len
        self.expected = f"a list of {min_len} to {max_len} items"

    def check(self, value: Any) -> None:
        if type(value) not in (list, tuple) or not self.min_len <= len(value) <= self.max_len:
            raise self._fail(value)
        if self.of is ANY:
            return
        check = self.of.check
        for i, item in enumerate(value):
            try:
                check(item)
            except _Mismatch as bad:
                raise bad.inside(i) from None


class Map(Spec):
    """A mapping of at most ``max_len`` keys: ``fields`` are checked by name (those in
    ``required`` must be there); any other key is checked by ``keys`` (by default a string of
    at most :data:`MAX_KEY_CHARS`, unless ``extra`` is ``ANY``) and its value by ``extra``, or
    refused where ``extra`` is None."""

    def __init__(self, fields: Mapping[str, Spec] | None = None, required: tuple[str, ...] = (),
                 extra: Spec | None = None, keys: Spec | None = None,
                 max_len: int = MAX_CONFIG_NODES) -> None:
        self.fields, self.required, self.extra = dict(fields or {}), required, extra
        self.keys = keys if keys is not None or extra is ANY else Str(MAX_KEY_CHARS)
        self.max_len = max_len
        self.expected = f"a mapping of at most {max_len} keys"

    def check(self, value: Any) -> None:
        if not isinstance(value, dict) or len(value) > self.max_len:
            raise self._fail(value)
        for name in self.required:
            if name not in value:
                raise _Mismatch("", None, missing=True).inside(name)
        fields, extra, keys = self.fields, self.extra, self.keys
        if extra is ANY and keys is None:  # only the declared fields are checked: look them up
            for name, spec in fields.items():
                if name in value and spec is not ANY:
                    try:
                        spec.check(value[name])
                    except _Mismatch as bad:
                        raise bad.inside(name) from None
            return
        for key, item in value.items():
            spec = fields.get(key) if type(key) is str else None
            if spec is None:
                if extra is None:
                    raise _Mismatch("absent (not a key this file has)", item).inside(key)
                if keys is not None:
                    try:
                        keys.check(key)
                    except _Mismatch:
                        raise _Mismatch(f"a mapping whose keys are {keys.expected}", key) from None
                spec = extra
            if spec is ANY:
                continue
            try:
                spec.check(item)
            except _Mismatch as bad:
                raise bad.inside(key) from None


class Instance(Spec):
    """An instance of ``cls`` for which ``test`` (if given) is true; ``expected`` says it."""

    def __init__(self, cls: type, expected: str, test: Callable[[Any], bool] | None = None) -> None:
        self.cls, self.test, self.expected = cls, test, expected

    def check(self, value: Any) -> None:
        if not isinstance(value, self.cls) or (self.test is not None and not self.test(value)):
            raise self._fail(value)


class Tree(Spec):
    """A tree of plain values (:func:`plain_tree_problem`), a mapping where ``mapping``: a
    config as stored."""

    def __init__(self, max_nodes: int = MAX_CONFIG_NODES, max_depth: int = MAX_CONFIG_DEPTH,
                 mapping: bool = True) -> None:
        self.max_nodes, self.max_depth, self.mapping = max_nodes, max_depth, mapping
        self.expected = (f"{'a mapping' if mapping else 'a tree'} of at most {max_nodes} plain "
                         f"values, {max_depth} levels deep")

    def check(self, value: Any) -> None:
        if (self.mapping and not isinstance(value, dict)) \
                or plain_tree_problem(value, self.max_nodes, self.max_depth):
            raise self._fail(value)


def checked(value: Any, spec: Spec, where: str, max_nodes: int | None = MAX_JSON_VALUES,
            max_depth: int = MAX_CONFIG_DEPTH) -> Any:
    """``value`` (read from ``where``: a file, a line of one, a checkpoint) if ``spec`` accepts
    it, else :class:`BadValue` naming ``where``, the key path and what was expected. First the
    whole structure (:func:`structure_problem`; ``max_nodes=None``: walked already, as
    ``safe_load`` walks a checkpoint with its tensors). Returns ``value`` itself."""
    if max_nodes is not None:
        problem = structure_problem(value, max_nodes, max_depth)
        if problem:
            raise BadValue(f"{where}: {problem}")
    try:
        spec.check(value)
    except _Mismatch as bad:
        if bad.missing:
            raise BadValue(f"{where}: {bad.where()} is missing (a required key)") from None
        raise BadValue(f"{where}: {bad.where()} must be {bad.expected}, not "
                       f"{_kind_of(bad.value)}") from None
    return value
