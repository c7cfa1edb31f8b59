"""The built wheel is a complete product: it carries the Hydra configs, and a non-editable
install (no source tree anywhere on the path) composes and prints the job config."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
# modules of the lab's suites that once lived in videotrain/bench/ and are not in the wheel
LAB_SUITES = ("data", "clips", "annotations", "accuracy")


def test_wheel_carries_configs_and_runs_without_the_source_tree(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy: an in-tree build leaves build/ in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "videotrain", src / "videotrain", ignore=ignore)
    shutil.copytree(REPO / "configs", src / "configs", ignore=ignore)
    shutil.copytree(REPO / "benchmarks", src / "benchmarks", ignore=ignore)  # beside, not in it
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                    str(src)], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("videotrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # the library, not the lab: the suites beside the package (benchmarks/) stay out of it
    assert not [n for n in names if n.split("/")[0] == "benchmarks"]
    assert not {f"videotrain/bench/{m}.py" for m in LAB_SUITES} & set(names)
    assert "videotrain/bench/cli.py" in names  # the strategies' cost benchmark is a user feature
    shipped = {n for n in names if n.startswith("videotrain/configs/")}
    expected = {f"videotrain/configs/{p.relative_to(REPO / 'configs')}"
                for p in (REPO / "configs").rglob("*.yaml")}
    assert expected and shipped == expected, shipped ^ expected

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", "import videotrain.config.build as b; print(b.__file__); "
                          "print(b.CONFIG_DIR)"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, check=True)
    module, config_dir = run.stdout.split()
    assert Path(module).is_relative_to(site) and Path(config_dir) == site / "videotrain" / "configs"
    job = subprocess.run([sys.executable, "-m", "videotrain", "--cfg", "job"], env=env,
                         cwd=tmp_path, capture_output=True, text=True)
    assert job.returncode == 0, job.stderr
    assert "name: synthetic" in job.stdout and "_target_: videotrain.memory" in job.stdout


def _pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a constraints file -> {normalised name: version}."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    for extra in project["project"]["optional-dependencies"].values():
        reqs += [r for r in extra if not r.startswith("videotrain")]
    return [Requirement(r) for r in reqs]


def test_every_declared_floor_is_the_floor_jobs_pin() -> None:
    """What users install is what was tested: each lower bound in pyproject.toml is the version
    that constraints/floor.txt (the floor job of .ci/run) installs, and the floor file pins
    nothing pyproject does not declare."""
    floor = _pins(REPO / "constraints" / "floor.txt")
    declared = {}
    for req in _declared():
        lows = [s.version for s in req.specifier if s.operator in (">=", "==")]
        assert lows, f"{req}: a range without a floor cannot be tested at its floor"
        declared[canonicalize_name(req.name)] = Version(lows[0])
    assert floor == declared, {k: (str(floor.get(k)), str(declared.get(k)))
                               for k in floor.keys() | declared.keys() if floor.get(k) != declared.get(k)}


def test_the_tested_pins_are_inside_the_declared_ranges() -> None:
    tested = _pins(REPO / "constraints" / "tested.txt")
    assert set(tested) == {"torch", "torchvision"}
    for req in _declared():
        name = canonicalize_name(req.name)
        if name in tested:
            assert req.specifier.contains(tested[name]), (str(req), tested[name])
    ci = (REPO / ".ci" / "run").read_text()
    assert "-c constraints/floor.txt" in ci and "-c constraints/tested.txt" in ci
    readme = (REPO / "README.md").read_text()
    assert 'pip install -e ".[dev]" -c constraints/tested.txt' in readme
