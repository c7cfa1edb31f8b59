"""The built wheel is a complete product: it carries the Hydra configs, and a non-editable
install (no source tree anywhere on the path) composes and prints the job config."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_carries_configs_and_runs_without_the_source_tree(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy: an in-tree build leaves build/ in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "videotrain", src / "videotrain", ignore=ignore)
    shutil.copytree(REPO / "configs", src / "configs", ignore=ignore)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                    str(src)], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("videotrain-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("videotrain/configs/")}
    expected = {f"videotrain/configs/{p.relative_to(REPO / 'configs')}"
                for p in (REPO / "configs").rglob("*.yaml")}
    assert expected and shipped == expected, shipped ^ expected

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", "import videotrain.build as b; print(b.__file__); "
                          "print(b.CONFIG_DIR)"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, check=True)
    module, config_dir = run.stdout.split()
    assert Path(module).is_relative_to(site) and Path(config_dir) == site / "videotrain" / "configs"
    job = subprocess.run([sys.executable, "-m", "videotrain", "--cfg", "job"], env=env,
                         cwd=tmp_path, capture_output=True, text=True)
    assert job.returncode == 0, job.stderr
    assert "name: synthetic" in job.stdout and "_target_: videotrain.memory" in job.stdout
