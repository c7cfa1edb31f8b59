"""Property-based tests of the one reader: random and hostile structures (shared references,
deep nesting, wide lists, huge numbers, long and control-character text, random opcodes) for
a checkpoint's fields and pickle, a run's config, a job's ``results.json`` and a sweep's
``.hydra/overrides.yaml``. Every case ends in success or the reader's one error type (a
``ValueError``: ``BadValue``, ``CheckpointError``, ``RefusedConfig``, ``UnsafeFileError``),
within ``hypothesis``' deadline of 10 s, with no planted text in the error, and the test's
memory growth (the process's peak resident set) within 500 MB."""

from __future__ import annotations

import importlib.util
import io
import json
import resource
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from videotrain.config.files import (
    RefusedConfig,
    load_yaml,
    read_config_file,
    shipped_options,
    shipped_targets,
)
from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.checkpoints.safe_load import CHECKPOINT
from videotrain.untrusted.bounds import (
    MAX_RESULTS_BYTES,
    BadValue,
    checked,
)
from videotrain.untrusted.formats import load_yaml_data, read_json

MARK = "PLANTED-7e3a"  # in the generated text; never in an error message
GROWTH_MB = 500
PROPERTY = settings(max_examples=60, deadline=10_000, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(10**600), 10**600),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.just(MARK * 100), st.text(st.sampled_from("\x00\x1b\n\r|$[]{}&*!:'\"\u202e"), max_size=20),
)
KEYS = st.one_of(st.text(max_size=12), st.sampled_from(sorted(CHECKPOINT.fields)))  # keys are named


def trees(keys: st.SearchStrategy = KEYS) -> st.SearchStrategy:
    return st.recursive(SCALARS, lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(keys, inner, max_size=5)), max_leaves=30)


@st.composite
def hostile(draw: st.DrawFn, keys: st.SearchStrategy = KEYS, max_depth: int = 400,
            max_wide: int = 300_000, max_bomb: int = 12) -> Any:
    """A random tree made hostile one way: a shared reference (one container used several
    times, as a pickle's memo or a YAML alias makes it; a bomb of ``max_bomb`` levels), deep
    nesting (to ``max_depth``), or a wide list (to ``max_wide`` items). Text formats get
    smaller ones: their writers (the test's own input) expand or are slow on the large."""
    tree = draw(trees(keys))
    how = draw(st.sampled_from(["plain", "shared", "bomb", "deep", "wide"]))
    if how == "shared":
        node = draw(st.lists(trees(keys), min_size=1, max_size=3))
        return {"a": [node, node], "b": tree}
    if how == "bomb":
        node: Any = [tree] * 3
        for _ in range(draw(st.integers(2, max_bomb))):
            node = [node] * 3
        return node
    if how == "deep":
        for _ in range(draw(st.integers(33, max_depth))):
            tree = [tree]
        return tree
    if how == "wide":
        return [draw(SCALARS)] * draw(st.integers(1, max_wide))
    return tree


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture(autouse=True)
def bounded_memory() -> Iterator[None]:
    """The test's growth of the process's peak memory: within ``GROWTH_MB``."""
    before = _maxrss_mb()
    yield
    assert _maxrss_mb() - before < GROWTH_MB


def _clean(err: BaseException) -> None:
    text = str(err)
    assert MARK not in text and "\x1b" not in text and "\n" not in text, text[:500]


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    """``scripts/summarize_sweep.py``, imported by path (a script, not a module)."""
    spec = importlib.util.spec_from_file_location(
        "summarize_sweep", Path(__file__).resolve().parents[2] / "scripts" / "summarize_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    shipped_targets()  # the allowlists, scanned once from configs/ (not the reader's cost)
    shipped_options()
    with tempfile.TemporaryDirectory(prefix="videotrain-properties-") as tmp:
        yield Path(tmp)


# ---------------------------------------------------------------------- checkpoints
@PROPERTY
@given(field=st.sampled_from([*sorted(CHECKPOINT.fields), "extra"]), value=hostile())
def test_any_checkpoint_field_loads_or_is_refused(folder: Path, field: str, value: Any) -> None:
    path = folder / "c.ckpt"
    try:
        torch.save({"videotrain_format": 2, "model": {"w": torch.zeros(2)}, field: value}, path)
    except RecursionError:  # the pickler's own limit: such a file cannot be written this way
        return
    try:
        ckpt.load(path)
    except ckpt.CheckpointError as err:
        _clean(err)


OPCODES = b"\x80\x02()]}\x8faestu\x85\x86\x87N\x88\x89KMJGhjqrRQbXUc.\x8a"


@PROPERTY
@given(ops=st.lists(st.one_of(st.sampled_from(OPCODES), st.integers(0, 255)), max_size=60),
       repeat=st.integers(1, 200_000))
def test_random_pickle_opcodes_load_or_are_refused(folder: Path, ops: list[int],
                                                   repeat: int) -> None:
    """A checkpoint whose ``data.pkl`` is random opcodes (repeated): what torch's unpickler
    makes of it, or one ``CheckpointError``; never an ``IndexError`` traceback."""
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    path = folder / "ops.ckpt"
    with zipfile.ZipFile(buf) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, bytes(ops) * repeat if info.filename.endswith("data.pkl") else data)
    try:
        ckpt.load(path)
    except ckpt.CheckpointError as err:
        _clean(err)


# ---------------------------------------------------------------------- configs
YAML_TEXT = st.text(st.sampled_from("[]{}&*!:-,?|>#'\" \n\tab1.%@`"), max_size=400)


@settings(PROPERTY, max_examples=25)  # each example is checked against the whole schema
@given(tree=hostile(st.text(max_size=12), max_depth=300, max_wide=30_000), raw=YAML_TEXT)
def test_any_config_file_is_read_or_refused(folder: Path, tree: Any, raw: str) -> None:
    """A run's ``config.yaml`` (a hostile tree dumped as YAML, anchors and all, or YAML-ish
    text): read as plain data (``load_yaml``: nothing of the text in a refusal) and checked
    (``read_config_file``), or refused with one ``ValueError``."""
    for text in (raw, _dumped(tree)):
        if text is None:
            continue
        try:
            load_yaml(text, "config.yaml")
        except RefusedConfig as err:
            _clean(err)
        path = folder / "config.yaml"
        path.write_text(text)
        try:
            read_config_file(path)
        except ValueError as err:  # the schema's refusal may quote a value, escaped and cut
            assert "\n" not in str(err) and "\x1b" not in str(err)


def _dumped(tree: Any) -> str | None:
    try:
        return yaml.safe_dump({"model": tree, "data": {"name": MARK}})
    except (RecursionError, yaml.YAMLError):
        return None


# ---------------------------------------------------------------------- results.json
JSON_TEXT = st.text(st.sampled_from('[]{}",:0123456789.eE-+ \\nulltruefalseNaN'), max_size=400)


@PROPERTY
@given(tree=hostile(max_depth=300, max_wide=100_000, max_bomb=6), raw=JSON_TEXT)
def test_any_results_json_is_read_or_refused(folder: Path, sweep: ModuleType, tree: Any,
                                             raw: str) -> None:
    """A job's ``results.json`` as the sweep summary and the trained-run loader read it."""
    from videotrain.config.trained_run import RESULTS

    try:
        dumped = json.dumps(tree if isinstance(tree, dict) else {"val_top1": tree})
    except (RecursionError, ValueError):
        dumped = None
    for text in (raw, dumped):
        if text is None:
            continue
        path = folder / "results.json"
        path.write_text(text)
        for spec in (sweep.RESULTS, RESULTS):
            try:
                read_json(path, spec, MAX_RESULTS_BYTES, "results.json")
            except ValueError as err:
                _clean(err)


# ---------------------------------------------------------------------- a sweep's overrides
@PROPERTY
@given(items=st.lists(st.one_of(st.text(max_size=40), hostile(max_depth=300, max_wide=30_000)),
                      max_size=8),
       raw=YAML_TEXT)
def test_any_overrides_file_gives_a_row(folder: Path, sweep: ModuleType, items: list[Any],
                                        raw: str) -> None:
    """``.hydra/overrides.yaml`` (a hostile list dumped as YAML, or YAML-ish text): the job's
    row is made, failed where the file is refused; ``load_job`` itself never raises."""
    job = folder / "job"
    (job / ".hydra").mkdir(parents=True, exist_ok=True)
    try:
        dumped = yaml.safe_dump(items)
    except (RecursionError, yaml.YAMLError):
        dumped = None
    for text in (raw, dumped):
        if text is None:
            continue
        (job / ".hydra" / "overrides.yaml").write_text(text)
        row = sweep.load_job(job, folder)
        assert row["status"] in ("ok", "failed")
        cells = sweep.markdown([row])
        assert len(cells.splitlines()) == 3 and MARK * 2 not in cells


@PROPERTY
@given(value=hostile())
def test_checked_returns_the_value_or_one_error(value: Any) -> None:
    """The schema of a checkpoint applied to any tree: the value itself, or one ``BadValue``."""
    try:
        assert checked({"model": {}, "last_val": value}, CHECKPOINT, "c.ckpt") is not None
    except BadValue as err:
        _clean(err)


@PROPERTY
@given(text=YAML_TEXT)
def test_yaml_data_is_read_or_refused(text: str) -> None:
    try:
        load_yaml_data(text, "f.yaml")
    except BadValue as err:
        _clean(err)
