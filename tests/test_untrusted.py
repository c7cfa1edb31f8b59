"""``videotrain.untrusted``: values shown escaped and cut, and a run folder's files read and
written as what they are (no link followed, no FIFO waited on, no hard link appended to)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from videotrain.untrusted import (
    UnsafeFileError,
    open_append,
    plain_tree_problem,
    quoted,
    read_text,
    shown,
    write_text,
)


def test_shown_keeps_plain_values_and_escapes_the_rest() -> None:
    assert shown("resnet10") == "resnet10" and shown(0.001) == "0.001" and shown(None) == "None"
    assert shown("a\nb") == "'a\\nb'" and shown("\x1b]52;c;x\x07") == "'\\x1b]52;c;x\\x07'"
    assert shown("\u202eevil") == "'\\u202eevil'" and shown("x\u2028y") == "'x\\u2028y'"
    long = shown("y" * 10_000)
    assert long.startswith("y" * 100) and long.endswith("...(10000 chars)") and len(long) < 130
    path = Path("/" + "d/" * 300)  # a path is shown whole up to PATH_CHARS, not cut at 100
    assert quoted("a") == "'a'" and shown(path) == str(path)


def test_shown_is_bounded_on_a_shared_reference_bomb() -> None:
    node: list = ["x"] * 9
    for _ in range(8):
        node = [node] * 9
    start = time.monotonic()
    assert len(shown(node)) <= 120 and time.monotonic() - start < 1
    assert "shared reference" in (plain_tree_problem({"a": node}) or "")
    assert plain_tree_problem({"a": [1, "b", {"c": None}]}) is None
    deep: dict = {}
    for _ in range(40):
        deep = {"k": deep}
    assert "nested" in (plain_tree_problem(deep) or "")


def test_write_text_replaces_a_link_and_leaves_its_target(tmp_path: Path) -> None:
    target, link = tmp_path / "bashrc", tmp_path / "run" / "results.json"
    target.write_text("mine\n")
    link.parent.mkdir()
    link.symlink_to(target)
    write_text(link, "{}\n")
    assert target.read_text() == "mine\n" and not link.is_symlink() and link.read_text() == "{}\n"
    assert [p.name for p in link.parent.iterdir()] == ["results.json"]  # no temporary left


def test_open_append_refuses_links_fifos_and_hard_links(tmp_path: Path) -> None:
    target = tmp_path / "authorized_keys"
    target.write_text("ssh-ed25519 mine\n")
    (tmp_path / "link.jsonl").symlink_to(target)
    os.mkfifo(tmp_path / "fifo.jsonl")
    os.link(target, tmp_path / "hard.jsonl")
    for name in ("link.jsonl", "fifo.jsonl", "hard.jsonl"):
        start = time.monotonic()
        with pytest.raises(UnsafeFileError):
            open_append(tmp_path / name)
        assert time.monotonic() - start < 1
    assert target.read_text() == "ssh-ed25519 mine\n"
    with open_append(tmp_path / "metrics.jsonl") as f:
        f.write("{}\n")
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


def test_read_text_refuses_links_fifos_and_large_files(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("password\n")
    (tmp_path / "config.yaml").symlink_to(tmp_path / "secret")
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "big.yaml").write_text("x" * 2000)
    for name, why in (("config.yaml", "symbolic link"), ("fifo.yaml", "FIFO"), ("big.yaml", "2000 bytes")):
        with pytest.raises(UnsafeFileError, match=why) as err:
            read_text(tmp_path / name, 1000)
        assert "password" not in str(err.value)
    assert read_text(tmp_path / "secret", 1000) == "password\n"
