"""No writer bypasses the door: every file the project's code writes (``videotrain/``,
``benchmarks/``, ``scripts/``) is written by ``videotrain/untrusted/files.py`` (the one writer:
no link followed, a folder that cannot be checked refused). This scans the source (AST) for the
calls that write, create, rename or link a file by path on their own, so that a new writer
cannot slip in unnoticed: ``open``/``Path.open``/``os.fdopen`` with a write mode, ``os.open``
with write flags, ``Path.write_text/write_bytes/touch/mkdir/rename/symlink_to/hardlink_to``,
``os.replace/rename/link/symlink/mkdir/makedirs``, ``shutil.copy*``/``move``, ``savefig``,
``torch.save``, ``torch.export.save``, ``torch.onnx.export``, ``av.open(..., mode="w")``,
``numpy.save*`` and logging's file handlers to a path. A sink is fine where it writes into
what the writer handed out (a name bound by ``with atomic_writer(...) as f`` or
``staged_path``) or into memory (``io.BytesIO``). ``ALLOWED`` lists the few exceptions, each
with its reason; a stale entry fails too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("videotrain", "benchmarks", "scripts")
THE_WRITER = "videotrain/untrusted/files.py"

# (file, the call's source text): why it may write on its own
ALLOWED: dict[tuple[str, str], str] = {
    ("videotrain/metrics/memory.py", 'Path("/proc/self/clear_refs").write_text("5")'):
        "a kernel control file of this process (resets its referenced-page counters), under "
        "/proc/self, where nothing can be planted: no file in any folder is written",
}

WRITE_MODE = re.compile(r"^[rbt]*[wax+][rwaxbt+]*(:\w*)?$")  # tarfile: "w:gz"
WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC")
BY_PATH = {  # module functions that write, create, rename or link by path
    "os.replace", "os.rename", "os.renames", "os.link", "os.symlink", "os.mkdir", "os.makedirs",
    "os.mkfifo", "os.mknod", "os.truncate", "shutil.copy", "shutil.copy2", "shutil.copyfile",
    "shutil.copytree", "shutil.copymode", "shutil.copystat", "shutil.move", "np.save",
    "np.savez", "np.savez_compressed", "np.savetxt", "numpy.save", "numpy.savez",
    "numpy.savetxt", "logging.FileHandler", "logging.handlers.RotatingFileHandler",
    "logging.handlers.TimedRotatingFileHandler", "logging.handlers.WatchedFileHandler",
    "FileHandler", "RotatingFileHandler", "WatchedFileHandler", "save_file",
    "safetensors.torch.save_file",
}
PATH_METHODS = {"write_text", "write_bytes", "touch", "mkdir", "rename", "symlink_to",
                "hardlink_to", "link_to"}
WRITER_MODULES = ("videotrain.untrusted", "videotrain.untrusted.files")


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node)


def _const(node: ast.AST | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def _mode(call: ast.Call, position: int) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == "mode":
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _writes(mode: ast.AST | None) -> bool:
    """A mode that writes (a non-constant mode counts: it cannot be checked)."""
    value = _const(mode)
    return mode is not None and (not isinstance(value, str) or bool(WRITE_MODE.match(value)))


class _Module:
    """What one file's code binds: names the writer handed out, in-memory buffers, and the
    aliases of the writer's modules."""

    def __init__(self, tree: ast.Module) -> None:
        self.handed: set[str] = set()
        self.memory: set[str] = set()
        self.writer_aliases: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.withitem) and isinstance(node.context_expr, ast.Call):
                callee = _dotted(node.context_expr.func).rsplit(".", 1)[-1]
                if callee in ("atomic_writer", "staged_path", "open_append") and isinstance(
                        node.optional_vars, ast.Name):
                    self.handed.add(node.optional_vars.id)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                callee = _dotted(node.value.func).rsplit(".", 1)[-1]
                if callee in ("BytesIO", "StringIO"):
                    self.memory.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Import):
                self.writer_aliases.update((a.asname or a.name) for a in node.names
                                           if a.name in WRITER_MODULES)
            elif isinstance(node, ast.ImportFrom) and node.module == "videotrain.untrusted":
                self.writer_aliases.update((a.asname or a.name) for a in node.names
                                           if a.name == "files")

    def is_handed(self, node: ast.AST | None) -> bool:
        """``f`` or ``str(f)`` where the writer handed out ``f``."""
        if isinstance(node, ast.Call) and _dotted(node.func) == "str" and len(node.args) == 1:
            node = node.args[0]
        return isinstance(node, ast.Name) and node.id in self.handed


def _arg(call: ast.Call, i: int) -> ast.AST | None:
    return call.args[i] if len(call.args) > i else None


# open-like calls whose mode follows the path
PATH_THEN_MODE = {"open", "io.open", "builtins.open", "os.fdopen", "codecs.open", "gzip.open",
                  "bz2.open", "lzma.open", "tarfile.open", "zipfile.ZipFile", "ZipFile"}


def _path_open_writes(call: ast.Call) -> bool:
    """``Path.open`` and its kin (the mode first): a ``mode=`` that writes, or a first argument
    that is a constant write mode (a non-constant first argument is a path: ``gzip.open``)."""
    if any(kw.arg == "mode" for kw in call.keywords):
        return _writes(_mode(call, 0))
    first = _const(_arg(call, 0))
    return isinstance(first, str) and bool(WRITE_MODE.match(first))


def bypasses(source: str) -> list[tuple[int, str]]:
    """``(line, call text)`` of each call in ``source`` that writes without the one writer."""
    tree = ast.parse(source)
    mod = _Module(tree)
    found = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        name = _dotted(call.func)
        attr = call.func.attr if isinstance(call.func, ast.Attribute) else None
        owner = _dotted(call.func.value) if isinstance(call.func, ast.Attribute) else ""
        bad = False
        if name in PATH_THEN_MODE:
            bad = _writes(_mode(call, 1))
        elif name == "os.open":
            flags = _arg(call, 1)
            bad = flags is not None and any(f in _dotted(flags) for f in WRITE_FLAGS)
        elif name == "av.open":
            bad = _writes(_mode(call, 1)) and not mod.is_handed(_arg(call, 0))
        elif attr == "open":
            bad = _path_open_writes(call)
        elif name in BY_PATH:
            bad = True
        elif attr in PATH_METHODS:
            bad = owner not in mod.writer_aliases
        elif attr == "savefig":
            first = _arg(call, 0)
            bad = not (isinstance(first, ast.Name) and first.id in mod.memory)
        elif name in ("torch.save", "torch.export.save"):
            bad = not mod.is_handed(_arg(call, 1))
        elif name in ("torch.onnx.export", "onnx.save", "onnx.save_model"):
            bad = not mod.is_handed(_arg(call, 2 if name == "torch.onnx.export" else 1))
        if bad:
            found.append((call.lineno, ast.get_source_segment(source, call) or name))
    return found


def scan() -> dict[tuple[str, str], int]:
    """Every bypass in the scanned folders: ``(file, call text) -> line``."""
    out = {}
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == THE_WRITER:
                continue
            for line, text in bypasses(path.read_text(encoding="utf-8")):
                out[(rel, text)] = line
    return out


def test_no_writer_bypasses_the_door() -> None:
    left = {key: line for key, line in scan().items() if key not in ALLOWED}
    listing = "\n".join(f"  {rel}:{line}: {text.splitlines()[0]}"
                        for (rel, text), line in sorted(left.items(), key=lambda kv: kv[0]))
    assert not left, f"{len(left)} write(s) outside the one writer (untrusted/files.py):\n{listing}"


def test_every_allowed_bypass_still_exists() -> None:
    """An allowlist entry whose call is gone is removed with it (no exception kept open)."""
    assert not set(ALLOWED) - set(scan())


BYPASSES = '''
import os, shutil, torch, av
from pathlib import Path
open(p, "w"); open(p, mode="ab"); open(p, m); Path(p).open("w", encoding="utf-8")
os.fdopen(fd, "wb"); os.open(p, os.O_WRONLY | os.O_CREAT)
Path(p).write_text("x"); p.write_bytes(b""); p.mkdir(parents=True); p.touch(); p.rename(q)
p.symlink_to(q); os.replace(a, b); os.rename(a, b); os.link(a, b); os.symlink(a, b)
os.mkdir(p); os.makedirs(p); shutil.copy(a, b); shutil.copyfile(a, b); shutil.move(a, b)
fig.savefig(p); fig.savefig("x.png"); torch.save(obj, p); torch.export.save(ep, p)
torch.onnx.export(m, (x,), str(p)); av.open(str(p), mode="w"); logging.FileHandler(p)
gzip.open(p, "wt"); tarfile.open(p, "w:gz"); zipfile.ZipFile(p, "w"); p.open(mode=m)
'''
SANCTIONED = '''
import io, os, torch, av
from videotrain.untrusted import files
from videotrain.untrusted.files import atomic_writer, staged_path, write_text
open(p); open(p, "rb"); Path(p).open(encoding="utf-8"); os.open(p, os.O_RDONLY)
gzip.open(p); tarfile.open(p, "r"); Image.open(p); av.open(str(p)); p.open("rb")
write_text(p, "x", root); files.write_bytes(p, b""); files.make_dirs(p)
png = io.BytesIO()
fig.savefig(png, format="png")
with atomic_writer(p, root) as f, av.open(f, mode="w", format="mp4") as c:
    torch.save(obj, f)
with staged_path(p, root) as staged:
    torch.onnx.export(m, (x,), str(staged))
text.replace("a", "b"); shutil.rmtree(tmp)
'''


def test_the_scan_finds_each_kind_of_bypass_and_passes_the_writers_own() -> None:
    found = [text for _, text in bypasses(BYPASSES)]
    expected = sum(line.count(";") + 1 for line in BYPASSES.strip().splitlines()[2:])
    assert len(found) == expected, found
    assert bypasses(SANCTIONED) == []
