"""The annotation suite beside the package (``benchmarks/annotations.py``): every row timed
against its plain parse at a small scale, the files it writes, and its command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.annotations import RESULTS, parse_args, run_annotation_bench

REPO = Path(__file__).resolve().parents[2]


def test_annotation_suite_tiny(tmp_path: Path) -> None:
    """The annotation suite at 1/500 of the official sizes: every row is timed against its
    plain parse, the preflight rows count the missing 90%, and bench.json / bench.md are
    written (the full-size figures are in docs/data.md)."""
    rows, meta, table = run_annotation_bench(out=tmp_path, scale=0.002, repeat=1,
                                             log=lambda *a, **k: None)
    names = [r["name"] for r in rows]
    assert names[:2] == ["SSv2 train.json index", "SSv2 validation.json index"]
    assert any(n.startswith("K700 release train.csv: prepare kinetics") for n in names)
    assert meta["sizes"]["ssv2_train"] == 337 and meta["sizes"]["k400_train"] == 480
    for r in rows:
        assert r["build_s"] > 0 and r["entries"] > 0, r
        if r["plain_s"] is not None:
            assert r["ratio"] == pytest.approx(r["build_s"] / r["plain_s"])
    pre = [r for r in rows if r["name"].startswith("preflight")]
    assert len(pre) == 2 and all(r["missing"] == 432 and r["entries"] == 480 for r in pre)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [r["name"] for r in saved["rows"]] == names
    assert table in (tmp_path / "bench.md").read_text()
    assert not list(Path(os.environ["VIDEOTRAIN_CACHE"]).glob("bench-annotations-*"))  # cleaned up


def test_command_line_help_defaults_and_bad_input() -> None:
    """``python -m benchmarks.annotations --help`` runs from the repository root; the default
    folder is under outputs/ (docs/ only when --out names it); bad sizes are refused."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.annotations", "--help"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--scale" in proc.stdout and "--repeat" in proc.stdout and "--suite" not in proc.stdout
    assert RESULTS == "outputs/bench_annotations" and RESULTS in proc.stdout
    args = parse_args([])
    assert (args.out, args.scale, args.repeat) == (RESULTS, 1.0, 3)
    assert parse_args(["--out", "docs/results/bench_annotations"]).out == "docs/results/bench_annotations"
    for bad in (["--scale", "0"], ["--repeat", "0"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(bad)
        assert exc.value.code == 2
