"""The entry points cannot drift apart: the modules and scripts that have a ``__main__`` (a
command someone runs), the harness's ``ENTRY_POINTS``, and docs/cluster.md's entry-point table
name the same commands; every test the table names exists, and every attack test is named by a
row of the table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MAIN = re.compile(r"^if __name__ == [\"']__main__[\"']:|^@hydra\.main\(", re.M)
NAMED_TEST = re.compile(r"`(test_attack_\w+\.py)::(test_\w+)`")
NOT_ATTACKS = ("test_attack_harness.py", "test_attack_table.py")


def code_entry_points() -> set[str]:
    """``videotrain.eval``, ``videotrain`` (its ``__main__.py``), ``scripts/x.py``, ...: every
    file under ``videotrain/``, ``benchmarks/`` and ``scripts/`` that runs as a command."""
    found = set()
    for top in ("videotrain", "benchmarks", "scripts"):
        for path in sorted((REPO / top).rglob("*.py")):
            if not MAIN.search(path.read_text()):
                continue
            rel = path.relative_to(REPO)
            if top == "scripts":
                found.add(str(rel))
            else:
                parts = rel.with_suffix("").parts
                found.add(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found


def table_rows() -> list[list[str]]:
    """The cells of docs/cluster.md's entry-point table."""
    text = (REPO / "docs" / "cluster.md").read_text()
    start = text.index("**Every entry point:")
    lines = text[start:].split("\n\n")[1].splitlines()
    assert lines[0].startswith("| entry point |"), lines[0]
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in lines[2:]]


def test_the_harness_names_every_command_the_code_has(entry_points) -> None:
    harnessed = {e.module or e.script for e in entry_points.values()}
    assert harnessed == code_entry_points()


def test_the_table_names_the_harness_entry_points(entry_points) -> None:
    commands = [re.match(r"`([^`]+)`", row[0]).group(1) for row in table_rows()]
    assert sorted(commands) == sorted(e.command for e in entry_points.values())


def test_the_table_and_the_attack_tests_name_each_other() -> None:
    defined = {path.name: {n.name for n in ast.parse(path.read_text()).body
                           if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
               for path in HERE.glob("test_attack_*.py")}
    named: set[tuple[str, str]] = set()
    for row in table_rows():
        found = NAMED_TEST.findall(row[-1])
        assert found, f"the row for {row[0]} names no test"
        named.update(found)
    missing = sorted(f"{f}::{t}" for f, t in named if t not in defined.get(f, set()))
    assert not missing, f"the table names tests that do not exist: {missing}"
    unnamed = sorted(f"{f}::{t}" for f, tests in defined.items() if f not in NOT_ATTACKS
                     for t in tests if (f, t) not in named)
    assert not unnamed, f"attack tests no row of the table names: {unnamed}"
