"""docs/layout.md is the map of the package: every module is on it, every module it names
exists, and the layering rules it states hold in the import graph (lazy imports included)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_import_cycles import import_graph, module_files

MAP = Path(__file__).resolve().parent.parent / "docs" / "layout.md"

# the parts (layer 3) and the videotrain packages each may import besides itself
PARTS_MAY_IMPORT: dict[str, set[str]] = {
    "untrusted": set(),  # the bottom: text and files from someone else, imported by every layer
    "data": {"untrusted"},
    "metrics": {"untrusted"},
    "simulate.step": {"memory", "metrics", "untrusted"},
    "memory": {"metrics", "simulate.step", "untrusted"},
    "models": {"memory", "simulate.step", "engine", "untrusted"},
    "engine": {"data", "memory", "metrics", "untrusted"},
}
# memory=auto measures real steps of the model at the trainer's scale
EXCEPTIONS = {("memory.auto.profile", "engine"), ("memory.auto.profile", "models")}
COMMANDS = ("eval", "predict", "export")


def part_of(module: str) -> str | None:
    """The part (a key of ``PARTS_MAY_IMPORT``) that ``videotrain.<module>`` belongs to."""
    name = module.removeprefix("videotrain.")
    if name == "simulate.step":
        return name
    top = name.split(".")[0]
    return top if top in PARTS_MAY_IMPORT else None


def mapped_paths(text: str) -> set[str]:
    """Module paths the map's tree names, relative to videotrain/ (``memory/sbp/split.py``)."""
    block = text.split("```\nvideotrain/\n", 1)[1].split("```", 1)[0]
    paths, stack = set(), []  # stack: (indent, folder)
    for line in block.splitlines():
        m = re.match(r"^( +)(\S+)", line)
        if not m or not (m.group(2).endswith(".py") or m.group(2).endswith("/")):
            continue
        indent, name = len(m.group(1)), m.group(2)
        if indent < 2 or (indent - 2) % 2:  # a continuation line of a description
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prefix = "".join(folder for _, folder in stack)
        if name.endswith("/"):
            stack.append((indent, name))
        else:
            paths.add(prefix + name)
    return paths


def test_every_module_is_on_the_map_and_the_map_names_only_modules() -> None:
    files = module_files()
    root = Path(files["videotrain"]).parent
    actual = {str(Path(p).relative_to(root)) for p in files.values()}
    named = mapped_paths(MAP.read_text())
    assert not actual - named, f"modules missing from docs/layout.md: {sorted(actual - named)}"
    assert not named - actual, f"docs/layout.md names modules that do not exist: {sorted(named - actual)}"


def test_mapped_paths_reads_nested_folders() -> None:
    text = "```\nvideotrain/\n  a.py         x\n  pkg/\n    b.py       y\n    sub/x.py   z\n  c.py\n```\n"
    assert mapped_paths(text) == {"a.py", "pkg/b.py", "pkg/sub/x.py", "c.py"}


def _edges() -> set[tuple[str, str]]:
    return {(a.removeprefix("videotrain."), b.removeprefix("videotrain.")) for a, b in import_graph(module_files())}


@pytest.mark.parametrize("part", list(PARTS_MAY_IMPORT))
def test_parts_import_only_what_the_map_allows(part: str) -> None:
    wrong = []
    for a, b in _edges():
        if part_of(a) != part:
            continue
        target = part_of(b) or b  # a layer above (build, run, ...) names itself
        if target != part and target not in PARTS_MAY_IMPORT[part] and (a, part_of(b)) not in EXCEPTIONS:
            wrong.append(f"{a} imports {b}")
    assert not wrong, f"docs/layout.md says {part} may import {sorted(PARTS_MAY_IMPORT[part]) or 'nothing'}: {wrong}"


def test_build_does_not_import_the_config_simulator_and_commands_share_one_loader() -> None:
    edges = _edges()
    assert ("build", "simulate.config_run") not in edges
    for cmd in COMMANDS:
        assert (cmd, "trained_run") in edges
        assert not [b for a, b in edges if a == cmd and b in COMMANDS], f"{cmd} imports another command"
