"""docs/layout.md is the map of the package: every module is on it, every module it names
exists, and the layering rules it states hold in the import graph (lazy imports included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_import_cycles import import_graph, module_files

MAP = Path(__file__).resolve().parent.parent / "docs" / "layout.md"

# The layers of docs/layout.md, bottom to top: a strict stack. A part may import itself and
# the parts of the layers below its own, nothing else: not a part of its own layer, not a
# layer above. There is no exception list. Each part is a top-level module or package of
# videotrain (``videotrain`` itself: the package's ``__init__``, its version).
LAYERS: list[tuple[str, ...]] = [
    ("videotrain", "untrusted"),  # the bottom: text and files from someone else
    ("data", "metrics"),  # the leaves: no other part
    ("memory",),  # the strategies, and the step on fake tensors (memory/estimate.py)
    ("engine",),  # the trainer: any nn.Module through a memory strategy
    ("models",),  # backbones, heads, VideoClassifier; weights read with engine's safe loader
    ("config",),  # the config layer: schema, build, configs from files, trained runs, estimates
    ("run", "eval", "predict", "export", "plan", "prepare"),  # the commands
    ("__main__", "bench"),  # python -m videotrain (train: run), the cost benchmark
]
LEVEL: dict[str, int] = {part: level for level, parts in enumerate(LAYERS) for part in parts}
COMMANDS = ("eval", "predict", "export")


def part_of(module: str) -> str:
    """The part (a name in ``LAYERS``) that ``videotrain.<module>`` belongs to: its top-level
    module or package, ``videotrain`` for the package itself."""
    name = module.removeprefix("videotrain.")
    return name.split(".")[0]


def upward_imports(edges: set[tuple[str, str]]) -> list[str]:
    """Every import that does not point down the stack: into a part of the same layer, or up."""
    return sorted(f"{a} imports {b}" for a, b in edges
                  if part_of(a) != part_of(b) and LEVEL[part_of(b)] >= LEVEL[part_of(a)])


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


def test_every_module_is_in_one_layer() -> None:
    parts = {part_of(m) for m in module_files()}
    assert not parts - set(LEVEL), f"modules in no layer of LAYERS: {sorted(parts - set(LEVEL))}"
    assert not set(LEVEL) - parts, f"LAYERS names parts that do not exist: {sorted(set(LEVEL) - parts)}"
    assert sum(len(layer) for layer in LAYERS) == len(LEVEL), "a part in two layers"


def test_every_import_points_down_the_layers() -> None:
    wrong = upward_imports(_edges())
    assert not wrong, f"imports that do not point down the layers of docs/layout.md: {wrong}"


def test_upward_imports_finds_imports_up_and_across_a_layer() -> None:
    edges = {("models.video", "memory.base"), ("memory.auto.profile", "models.video"),
             ("data.loaders", "metrics.accuracy"), ("memory.sbp", "memory.base")}
    assert upward_imports(edges) == ["data.loaders imports metrics.accuracy",
                                     "memory.auto.profile imports models.video"]


def test_the_map_lists_the_layers_in_this_order() -> None:
    """docs/layout.md's numbered layers, top to bottom, name the parts of ``LAYERS`` top down."""
    text = MAP.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\d+\. \*\*[^*]+\*\*: (.*)$", text, flags=re.M)
    named = [tuple(re.findall(r"`([\w.]+?)/?`", line)) for line in listed]
    assert named == [tuple(layer) for layer in reversed(LAYERS)]


def lab_imports(files: dict[str, Path]) -> list[str]:
    """Every import of the lab beside the package (``benchmarks``) in ``files``, lazy ones too."""
    found = []
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            found += [f"{module} imports {n}" for n in names if n.split(".")[0] == "benchmarks"]
    return sorted(found)


def test_the_package_never_imports_the_lab(tmp_path: Path) -> None:
    """benchmarks/ builds on the package, never the other way: the wheel has no benchmarks/."""
    assert lab_imports(module_files()) == []
    lab = tmp_path / "m.py"
    lab.write_text("def f():\n    from benchmarks.sac_peer import apply_sac_milp\n")
    assert lab_imports({"videotrain.m": lab}) == ["videotrain.m imports benchmarks.sac_peer"]


def test_build_does_not_import_the_config_simulator_and_commands_share_one_loader() -> None:
    edges = _edges()
    assert ("config.build", "config.estimate") not in edges
    for cmd in COMMANDS:
        assert (cmd, "config.trained_run") in edges
        assert not [b for a, b in edges if a == cmd and b in COMMANDS], f"{cmd} imports another command"
