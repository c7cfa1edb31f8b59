"""``videotrain.untrusted.bounds``, the one reader: a declared schema whose one error names the
file and the key path but never the value; structures walked once (no shared container, bounded
depth and size); JSON, JSON lines and YAML bounded before they are parsed; and the readers that
use them (a checkpoint's pickle and fields, ``metrics.jsonl``, ``config_files.load_yaml``).
Every hostile case here ends in the one error type, quickly, with its text nowhere in it."""

from __future__ import annotations

import io
import json
import os
import pickle
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch

from videotrain.config.files import RefusedConfig, load_yaml
from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.checkpoints import safe_load
from videotrain.metrics.logger import MetricsLogger
from videotrain.untrusted import UnsafeFileError
from videotrain.untrusted.bounds import (
    ANY,
    BOOL,
    MAX_CHECKPOINT_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_METRICS_BYTES,
    MAX_METRICS_LINES,
    MAX_PICKLE_BYTES,
    BadValue,
    Choice,
    Either,
    Float,
    Int,
    Map,
    Optional,
    Seq,
    Str,
    checked,
    structure_problem,
)
from videotrain.untrusted.formats import (
    check_yaml,
    load_yaml_data,
    parse_json,
    read_json,
    read_jsonl,
)

SECRET = "SECRET-TEXT-4f1c"  # planted in values; never in an error


def deep_list(levels: int) -> list:
    """A list nested ``levels`` deep, built without recursion."""
    root: list = []
    node = root
    for _ in range(levels):
        child: list = []
        node.append(child)
        node = child
    return root


def shared_bomb(levels: int = 8) -> list:
    """9 ** levels leaves from ``levels`` lists: each level holds the one below nine times."""
    node: list = ["x"] * 9
    for _ in range(levels - 1):
        node = [node] * 9
    return node


def refused(fn, *args, error: type[Exception] = BadValue, **kwargs) -> str:
    """The message of the ``error`` that ``fn(*args)`` raises, within a few seconds; none of
    the values planted (``SECRET``) in it, and one line."""
    start = time.monotonic()
    with pytest.raises(error) as raised:
        fn(*args, **kwargs)
    assert time.monotonic() - start < 5, "took too long"
    message = str(raised.value)
    assert SECRET not in message and "\n" not in message
    return message


# ---------------------------------------------------------------------- the schema
SPEC = Map({"step": Int(0, 10), "name": Str(8), "lr": Optional(Float(0, 1)),
            "tags": Seq(Choice("a", "b"), 3), "on": BOOL, "any": ANY,
            "inner": Map({"n": Either(Int(), Str(4))}, extra=Float())},
           required=("step",))


def test_checked_returns_what_fits_its_schema() -> None:
    value = {"step": 3, "name": "resnet", "lr": None, "tags": ["a", "b"], "on": True,
             "any": {"x": [1, 2]}, "inner": {"n": "ab", "other": 2.5}}
    assert checked(value, SPEC, "f.json") is value


@pytest.mark.parametrize(("value", "says"), [
    ({}, "f.json: step is missing (a required key)"),
    ({"step": True}, "step must be an integer from 0 to 10, not True"),
    ({"step": 11}, "step must be an integer from 0 to 10, not 11"),
    ({"step": 10**400}, "not an integer of 1329 bits"),
    ({"step": 1, "name": SECRET}, "name must be a string of at most 8 characters, not a string of 16"),
    ({"step": 1, "lr": float("nan")}, "lr must be null or a finite number from 0 to 1, not nan"),
    ({"step": 1, "lr": SECRET}, "lr must be null or a finite number"),
    ({"step": 1, "tags": ["a", SECRET]}, "tags[1] must be one of 'a', 'b'"),
    ({"step": 1, "tags": ["a"] * 4}, "tags must be a list of 0 to 3 items, not a list of 4 items"),
    ({"step": 1, "on": 1}, "on must be true or false, not 1"),
    ({"step": 1, "inner": {"n": [SECRET]}}, "inner.n must be an integer or a string"),
    ({"step": 1, "inner": {SECRET * 20: 1.0}}, "inner must be a mapping whose keys are a string"),
    ({"step": 1, "inner": {"x": SECRET}}, "inner.x must be a finite number"),
    ({"step": 1, "surplus": SECRET}, "surplus must be absent (not a key this file has)"),
    ([SECRET], "the value must be a mapping"),
])
def test_checked_names_the_key_path_never_the_value(value: object, says: str) -> None:
    message = refused(checked, value, SPEC, "f.json")
    assert message.startswith("f.json: ") and says in message, message


def test_a_key_is_shown_escaped_in_the_path() -> None:
    message = refused(checked, {"step": 1, "inner": {"\x1b[31mred\n": "x"}}, SPEC, "f")
    assert "\x1b" not in message and "inner.\\x1b[31mred\\n" in message


def test_a_shared_container_is_refused_anywhere() -> None:
    """A pickle's memo or a YAML alias makes one container appear twice: refused wherever it
    is, at once (9^8 leaves would expand to gigabytes where copied or compared)."""
    bomb = {"step": 1, "any": {"deep": [shared_bomb()]}}
    message = refused(checked, bomb, SPEC, "f")
    assert "a shared reference at any.deep[0]" in message
    x = [1]
    assert "shared reference" in refused(checked, {"step": 1, "any": [x, x]}, SPEC, "f")


def test_a_short_tuple_of_numbers_may_be_shared() -> None:
    """torch's optimizer gives every parameter group the same ``betas`` tuple."""
    betas = (0.9, 0.999)
    groups = [{"betas": betas, "lr": 1e-3} for _ in range(4)]
    assert structure_problem({"param_groups": groups}, 1000, 8) is None
    assert "shared reference" in structure_problem({"a": [groups[0]] * 2}, 1000, 8)


def test_depth_and_size_are_bounded_without_recursion() -> None:
    start = time.monotonic()
    assert "nested more than 32 levels" in structure_problem(deep_list(200_000), 10**7, 32)
    assert structure_problem(deep_list(32), 100, 32) is None
    assert structure_problem(list(range(2_000_000)), 1_000_000, 4) == "more than 1000000 values"
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------------- JSON and JSON lines
@pytest.mark.parametrize(("text", "says"), [
    ("[" * 100_000 + "]" * 100_000, "nested more than 32 levels deep"),
    ('{"a": ' * 50 + "1" + "}" * 50, "nested more than 32 levels deep"),
    ("[" + "{}," * 3_000_000 + "{}]", "more than 2000000 values"),
    ('["' + SECRET + '", ' + "1" * 5000 + "]", "not JSON (ValueError)"),
    ('{"a": "' + SECRET + '"', "f.json:1: not JSON (Expecting ',' delimiter)"),
])
def test_json_is_bounded_before_it_is_parsed(text: str, says: str) -> None:
    assert says in refused(parse_json, text, "f.json")


def test_brackets_inside_json_strings_are_not_nesting() -> None:
    text = json.dumps({"names": ["[" * 100, "{" * 100, '"[' * 50]})
    assert parse_json(text, "f")["names"][0] == "[" * 100


def test_read_json_reads_a_regular_bounded_file(tmp_path: Path) -> None:
    good = tmp_path / "results.json"
    good.write_text(json.dumps({"step": 2, "name": "x"}))
    assert read_json(good, SPEC, 1000)["step"] == 2
    link = tmp_path / "link.json"
    link.symlink_to(good)
    assert "symbolic link" in refused(read_json, link, SPEC, 1000, error=UnsafeFileError)
    big = tmp_path / "big.json"
    big.write_text(" " * 1001)
    assert "more than the 1000 bytes" in refused(read_json, big, SPEC, 1000, error=UnsafeFileError)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"step": SECRET}))
    assert refused(read_json, wrong, SPEC, 1000).startswith(f"{wrong}: step must be an integer")


ROW = Map({"step": Int(0)}, required=("step",), extra=ANY)


def test_read_jsonl_counts_lines_before_parsing_any(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\n{"step": 2, "x": [1]}\n')
    assert [(n, row["step"]) for n, _, row in read_jsonl(path, ROW)] == [(1, 1), (3, 2)]
    path.write_bytes(b"\n" * (MAX_METRICS_LINES + 1))  # a file of newlines: counted, not split
    tracemalloc.start()
    message = refused(lambda: list(read_jsonl(path, ROW)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert f"more than {MAX_METRICS_LINES} lines" in message and peak < 16 << 20
    os.truncate(path, MAX_METRICS_BYTES + 1)  # sparse: counted by its length, nothing read
    assert "bytes" in refused(lambda: list(read_jsonl(path, ROW)), error=UnsafeFileError)


@pytest.mark.parametrize(("line", "says"), [
    (b'{"step": "' + SECRET.encode() + b'"}', "f.jsonl:2: step must be an integer"),
    (b'{"x": 1}', "f.jsonl:2: step is missing"),
    (b"[" * 5000, "f.jsonl:2: nested more than 32 levels"),
    (b'{"step": 1, "s": "' + b"x" * (70 << 10) + b'"}', "f.jsonl:2: a line longer than"),
    (b"\xff" + SECRET.encode(), "f.jsonl:2: byte 0 is not UTF-8"),
    (SECRET.encode(), "f.jsonl:2:1: not JSON (Expecting value)"),
])
def test_a_bad_line_is_named_by_its_number(tmp_path: Path, line: bytes, says: str) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"step": 1}\n' + line + b"\n")
    assert says in refused(lambda: list(read_jsonl(path, ROW))).replace(str(tmp_path) + "/", "")


def test_metrics_read_back_on_resume_keep_their_lines(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path)
    for step in (1, 2, 3, 4):
        logger.log({"loss": step / 10}, step)
    logger.truncate_after(2)
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b"\n" * (MAX_METRICS_LINES + 10))
    refused(logger.truncate_after, 2)
    assert (tmp_path / "metrics.jsonl").stat().st_size > MAX_METRICS_LINES  # left as it was


# ---------------------------------------------------------------------- YAML
ALIAS_BOMB = ("- &a [x, x, x, x, x, x, x, x, x]\n"
              + "".join(f"- &{c} [" + ", ".join([f"*{p}"] * 9) + "]\n"
                        for p, c in zip("abcdefgh", "bcdefghi", strict=True)))


@pytest.mark.parametrize(("text", "says"), [
    (ALIAS_BOMB, "f.yaml:1: a YAML anchor or alias"),
    ("a: " + "[" * 100_000, "f.yaml:1: nested more than 32 levels deep"),
    ("".join(" " * i + f"k{i}:\n" for i in range(40)), "nested more than 32 levels"),
    ("- !!python/object/apply:os.system ['touch x']\n", "f.yaml:1: cannot be read as a YAML config (a YAML tag"),
    ("a: !secret " + SECRET, "a YAML tag"),
    ("a: [1, 2\nb: " + SECRET, "cannot be read as a YAML config"),
    ("".join(f"k{i}: {i}\n" for i in range(50_000)), "more than 20000 values"),
    ("when: 2001-13-45", "cannot be read as YAML data"),
])
def test_yaml_is_checked_from_its_events_before_anything_is_built(text: str, says: str) -> None:
    assert says in refused(load_yaml_data, text, "f.yaml")


def test_plain_yaml_is_read() -> None:
    assert load_yaml_data("- memory=sbp\n- seed=1\n", "f") == ["memory=sbp", "seed=1"]
    assert load_yaml_data("a: !!str 1\nb: [1, {c: d}]\n", "f") == {"a": "1", "b": [1, {"c": "d"}]}
    depth = MAX_CONFIG_DEPTH - 1  # under the top mapping
    check_yaml("x: " + "[" * depth + "]" * depth, "f")


def test_a_config_file_nested_deep_is_one_refusal() -> None:
    """``config_files.load_yaml`` (a run's config.yaml): a RefusedConfig, not a RecursionError."""
    assert "nested more than" in refused(load_yaml, "deep: " + "[" * 100_000 + "]" * 100_000,
                                         "config.yaml", error=RefusedConfig)
    assert "anchor or alias" in refused(load_yaml, ALIAS_BOMB, "c.yaml", error=RefusedConfig)


# ---------------------------------------------------------------------- checkpoints
def _zip_with_pickle(path: Path, pkl: bytes) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/version", "3\n")
    return path


@pytest.mark.parametrize(("ops", "says"), [
    (b"\x80\x02](" + b"\x8f" * 1_500_000 + b"e.", "would build values of about"),  # empty sets
    (b"\x80\x02](" + b"}" * 3_000_000 + b"e.", "would build values of about"),
    (b"\x80\x02]" + b"Na" * 2_500_000 + b".", "more than 4000000 opcodes"),  # None appended
])
def test_a_costly_pickle_is_refused_before_unpickling(tmp_path: Path, ops: bytes, says: str) -> None:
    path = _zip_with_pickle(tmp_path / "c.ckpt", ops)
    message = refused(ckpt.load, path, error=ckpt.UnsafeCheckpointError)
    assert says in message and "before unpickling anything" in message


def test_a_real_checkpoint_costs_what_it_holds(tmp_path: Path) -> None:
    """A run of half a million steps (three lists of floats a step) passes the pickle's bounds."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias]}])
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    def times() -> list[float]:
        return [0.01 + i * 1e-9 for i in range(500_000)]

    blob = {"videotrain_format": 2, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "step_times": times(), "data_waits": times(), "peaks": times()}
    buf = io.BytesIO()
    torch.save(blob, buf)
    with zipfile.ZipFile(buf) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    ops, cost = safe_load.pickle_cost(data)
    assert 500_000 < ops < 4_000_000 and cost < 256 << 20
    path = tmp_path / "big.ckpt"
    path.write_bytes(buf.getvalue())
    loaded = ckpt.load(path)  # the optimizer's groups share one betas tuple: allowed
    assert loaded["optimizer"]["param_groups"][0]["betas"] is loaded["optimizer"]["param_groups"][1]["betas"]


def test_sizes_are_bounded_before_reading(tmp_path: Path) -> None:
    sparse = tmp_path / "sparse.ckpt"
    torch.save({"model": {}}, sparse)
    os.truncate(sparse, MAX_CHECKPOINT_BYTES + 1)  # no disk used: counted by its length
    assert "bytes" in refused(ckpt.load, sparse, error=ckpt.UnsafeCheckpointError)
    plain = tmp_path / "plain.ckpt"
    plain.write_bytes(pickle.dumps([0]) + b"\0" * MAX_PICKLE_BYTES)
    assert "not a zip" in refused(ckpt.load, plain, error=ckpt.UnsafeCheckpointError)
    record = tmp_path / "record.ckpt"
    with zipfile.ZipFile(record, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        z.writestr("archive/version", b"3" * (MAX_PICKLE_BYTES + 1))
    assert "its records other than tensors' hold" in refused(ckpt.load, record,
                                                            error=ckpt.UnsafeCheckpointError)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("peaks", ["9" * 100_000], "peaks[0] must be a finite number of at least 0.0, not a string"),
    ("step", SECRET, "step must be an integer from 0 to"),
    ("class_names", [SECRET * 100], "class_names[0] must be a string of at most 1024 characters"),
    ("last_val", {"val_top1": [SECRET]}, "last_val.val_top1 must be null or a number"),
    ("config", {"a": deep_list(40)}, "nested more than 32 levels deep (at config.a[0]"),
    ("config", ["a"], "config must be null or a mapping of at most"),
    ("rng_per_rank", [], "rng_per_rank must be a list of 1 to"),
    ("optimizer", {"state": {}}, "optimizer.param_groups is missing"),
])
def test_every_field_read_is_checked_when_loaded(tmp_path: Path, field: str, value: object,
                                                 says: str) -> None:
    path = tmp_path / "c.ckpt"
    torch.save({"videotrain_format": 2, "model": {"w": torch.zeros(2)}, field: value}, path)
    message = refused(ckpt.load, path, error=ckpt.CheckpointError)
    assert says in message and message.startswith(str(path)), message


def test_a_shared_reference_in_any_field_is_refused(tmp_path: Path) -> None:
    """The stored validation results, not only the config: resume went to 8.8 GB."""
    path = tmp_path / "c.ckpt"
    torch.save({"model": {}, "last_val": {"bomb": shared_bomb()}}, path)
    assert path.stat().st_size < 100_000
    assert "a shared reference at last_val.bomb" in refused(ckpt.load, path,
                                                            error=ckpt.UnsafeCheckpointError)


def test_a_weights_file_the_user_names_is_not_held_to_the_fields(tmp_path: Path) -> None:
    """``follow`` (model.init_from): someone's training script's own keys are not videotrain's
    fields; the structure is still walked."""
    path = tmp_path / "w.pth"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "epoch": -1, "config": "resnet"}, path)
    assert ckpt.load(path, follow=True)["epoch"] == -1
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(path)


def test_a_step_file_is_named_exactly() -> None:
    assert ckpt.step_of("step-00000004.ckpt") == 4
    for name in ("step-00000004.ckpt\n", "step-\u0664.ckpt", "step-1.ckpt.corrupt", " step-1.ckpt",
                 "step-" + "9" * 13 + ".ckpt"):
        assert ckpt.step_of(name) is None, name
