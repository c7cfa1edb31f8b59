"""The data suite beside the package (``benchmarks/data.py``, ``data_child.py``, ``clips.py``,
``data_report.py``): its rows, the generated clip sets, one row measured in-process and through
the runner's fresh processes, the report's arithmetic, and its command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.clips import CLIP_SETS, clip_set, ensure_clip_set, probe, set_info
from benchmarks.data import DATA_BACKENDS, REPO, data_row, data_rows, run_data_bench, worker_counts
from benchmarks.data_child import measure_data, set_overrides, timed_batches, unavailable
from benchmarks.data_report import add_data_ratios, combine_data, target_workers, workers_needed
from videotrain.bench import SUITES
from videotrain.bench.spawn import run_child
from videotrain.data.annotations import kinetics_index

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_data_suite_rows() -> None:
    names = [r["name"] for r in data_rows()]
    assert worker_counts(2) == (1, 2) and worker_counts(16) == (1, 2, 16) and worker_counts(1) == (1, 2)
    assert len(names) == len(set(names)) == 2 * 2 * len(DATA_BACKENDS) * len(worker_counts())
    assert names[:4] == ["data/kinetics/train/pyav-w1", "data/kinetics/train/pytorchvideo-w1",
                         "data/kinetics/train/torchcodec-w1", "data/kinetics/train/segment-w1"]
    assert "data/ssv2/test/pytorchvideo-w2" in names
    assert "data" not in SUITES and not any(r.get("kind") == "data" for r in SUITES["all"])
    with pytest.raises(ValueError, match="backend must be one of"):
        data_row("no-such-backend", 1)


# tiny versions of the two clip sets (2 videos, 1-2 s, keyframe every 25 / 12 frames): the
# real encoders, sizes and frame rates, a fraction of the time
TINY_SETS = {"kinetics": {"count": 2, "seconds": 2.0, "gop": 25},
             "ssv2": {"count": 2, "seconds": 2.0, "gop": 12}}
# small clips through the same pipelines: 4 frames at stride 2, 64 px short side, crop 56
TINY_PIPELINE = ["data.num_frames=4", "data.sampling_rate=2", "data.short_side=64",
                 "data.crop_size=56", "data.batch_size=1", "data.val_clips=2", "data.val_crops=3"]


@pytest.fixture(scope="module")
def tiny_sets(isolated_env: Path) -> dict:
    specs = {name: clip_set(name, **kw) for name, kw in TINY_SETS.items()}
    return {name: (spec, ensure_clip_set(spec)) for name, spec in specs.items()}


@pytest.mark.parametrize("name, codec, fmt, size, fps, keyframes", [
    ("kinetics", "h264", "mp4", (340, 256), 25.0, [0, 25]),
    ("ssv2", "vp9", "webm", (427, 240), 12.0, [0, 12]),
])
def test_clip_sets_are_shaped_like_the_datasets(tiny_sets, name, codec, fmt, size, fps,
                                                keyframes) -> None:
    spec, root = tiny_sets[name]
    index = kinetics_index(root, "train")  # the project's reader takes the layout
    assert len(index) == 2 and index.class_names[0] == "class_0"
    assert (root / "val.csv").read_text() == (root / "train.csv").read_text()
    for path, _ in index.paths:
        p = probe(path)
        assert (p["codec"], (p["width"], p["height"]), p["fps"]) == (codec, size, fps)
        assert fmt in p["format"] and p["pix_fmt"] == "yuv420p" and p["audio_streams"] == 0
        assert p["frames"] == spec.num_frames and p["keyframes"] == keyframes
    info = set_info(root)
    assert info["mean_kbps"] > 50 and info["generation_s"] > 0  # not trivially compressible
    # the full-size sets: the datasets' lengths, rates and keyframe spacing (one in a video)
    full = CLIP_SETS[name]
    assert (full.seconds, full.fps, full.gop) == ((10.0, 25, 250) if name == "kinetics"
                                                 else (4.0, 12, 128))
    assert full.num_frames <= full.gop


def _tiny_overrides(tiny_sets, name: str) -> list[str]:
    spec, root = tiny_sets[name]
    return [*set_overrides(str(root), spec.fps), *TINY_PIPELINE, "device=cpu"]


@pytest.mark.parametrize("pipeline", ["train", "test"])
@pytest.mark.parametrize("loader", ["videotrain", "pytorchvideo"])
def test_data_row_measures_the_same_clips(tiny_sets, loader: str, pipeline: str) -> None:
    """Both loaders, in-process and without workers: the same clips, counted the same way
    (test: 2 temporal clips per video, each with 3 crops)."""
    r = measure_data({"loader": loader, "pipeline": pipeline, "num_workers": 0,
                      "overrides": _tiny_overrides(tiny_sets, "kinetics"), "device": "cpu",
                      "timed_clips": 4})
    assert r["clips"] == 4 and r["videos"] == 2 and r["clips_per_s"] > 0
    assert r["clip_shape"] == ((4, 3, 56, 56) if pipeline == "train" else (3, 4, 3, 56, 56))
    assert r["clips_per_s"] == pytest.approx(r["clips"] / r["elapsed_s"])


def test_timed_batches_are_whole_waves() -> None:
    assert timed_batches(48, 4, 1) == 12 and timed_batches(48, 4, 2) == 12
    assert timed_batches(40, 10, 2) == 4 and timed_batches(10, 10, 3) == 3
    assert timed_batches(1, 4, 2) == 2


def test_workers_needed_arithmetic() -> None:
    assert workers_needed(4.0, 5.0, 9.0) == (1, 0.9)  # one worker is enough
    n, eff = workers_needed(90.0, 5.0, 9.0)  # 4.5 clips/s per worker at scale
    assert eff == pytest.approx(0.9) and n == 20
    assert workers_needed(90.0, 5.0, 12.0) == (18, 1.0)  # superlinear is capped at linear
    assert workers_needed(6.0, 5.0, None) == (2, 1.0)
    rows = [{"set": "kinetics", "pipeline": "train", "backend": b, "num_workers": w,
             "clips_per_s": c} for b, w, c in (("pyav", 1, 5.0), ("pyav", 2, 9.0),
                                               ("pytorchvideo", 1, 3.0),
                                               ("pytorchvideo", 2, 6.0))]
    rows.append({"set": "kinetics", "pipeline": "train", "backend": "torchcodec",
                 "num_workers": 1, "unavailable": "not installed"})
    rows += [{"set": "kinetics", "pipeline": "train", "backend": "segment", "sampler": "segment",
              "num_workers": w, "clips_per_s": 50.0 * w} for w in (1, 2)]  # other frames
    (t,) = target_workers(rows, 90.0)
    assert (t["backend"], t["workers"], t["rate_per_worker_at_scale"]) == ("pyav", 20, 4.5)


def test_torchcodec_row_unavailable_without_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # import torchcodec -> ImportError
    reason = unavailable(data_row("torchcodec", 1), {"decoder": "pyav"})
    assert reason.startswith("not installed (") and "torchcodec" in reason
    assert unavailable(data_row("segment", 1), {"decoder": "pyav"}) == (
        "unavailable: this version has no data.sampler option")
    assert unavailable(data_row("segment", 1), {"sampler": "random"}) is None
    assert unavailable(data_row("pyav", 1), {}) is None


def test_data_rows_combine_and_ratios() -> None:
    runs = [{"clips_per_s": c, "startup_s": 0.5, "clips": 12} for c in (10.0, 30.0, 20.0)]
    w1 = combine_data(data_row("pyav", 1), runs)
    assert w1["clips_per_s"] == 20.0 and w1["clips_per_s_range"] == "10.0–30.0"
    w2 = combine_data(data_row("pyav", 2), [{"clips_per_s": 50.0, "startup_s": 1.0}])
    assert w2["clips_per_s_per_worker"] == 25.0
    peer = combine_data(data_row("pytorchvideo", 2), [{"clips_per_s": 40.0, "startup_s": 1.0}])
    bad = combine_data(data_row("pyav", 1, "ssv2"), [{"error": "boom"}])
    na = combine_data(data_row("torchcodec", 2), [{"unavailable": "not installed (x)"}])
    rows = [w1, bad, w2, peer, na]
    add_data_ratios(rows)
    assert w2["vs_peer"] == pytest.approx(1.25) and w2["vs_w1"] == pytest.approx(2.5)
    assert w1["vs_peer"] is None and bad["vs_peer"] is None and peer["vs_peer"] == 1.0
    assert na["vs_peer"] is None and na["unavailable"] == "not installed (x)"


def test_data_bench_tiny(tmp_path: Path, tiny_sets, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows through the runner (a fresh process each), a torchcodec row that cannot import its
    module, and the files written: table with a ratio column, JSON, PNG, worker targets."""
    monkeypatch.setitem(sys.modules, "torchcodec", None)
    out = tmp_path / "bench"
    rows, meta, table = run_data_bench(
        out=out, device="cpu", extra_overrides=TINY_PIPELINE, timed_clips=2, target=50.0,
        rows=[data_row(b, 1) for b in ("pyav", "pytorchvideo", "torchcodec")],
        sets={name: spec for name, (spec, _) in tiny_sets.items()}, log=lambda *a, **k: None)
    pyav, peer, codec = rows
    assert not pyav.get("error") and not peer.get("error"), (pyav.get("error"), peer.get("error"))
    assert pyav["clips"] == peer["clips"] == 2 and pyav["clips_per_s"] > 0 < peer["clips_per_s"]
    assert pyav["vs_peer"] == pytest.approx(pyav["clips_per_s"] / peer["clips_per_s"])
    assert codec["unavailable"].startswith("not installed") and "wall_s" not in codec
    data = json.loads((out / "bench.json").read_text())
    assert [r["kind"] for r in data["rows"]] == ["data"] * 3
    assert data["meta"]["setting"]["num_frames"] == 4
    assert data["meta"]["setting"]["sets"]["kinetics"]["codec"] == "libx264"
    (target,) = data["targets"]
    assert target["backend"] in ("pyav", "pytorchvideo") and target["workers"] >= 1
    md = (out / "bench.md").read_text()
    assert table in md and "× pytorchvideo, same workers" in md and "FAILED" not in md
    assert "| kinetics | train | pyav | 1 |" in md and "not installed (" in md
    assert "Workers to feed 50 clips/s" in md
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC


# ---------------------------------------------------------------------- its command line
def test_run_child_runs_the_data_suites_own_child() -> None:
    """A data row runs as ``python -m benchmarks.data --child SPEC`` (found through the
    repository root, wherever the parent runs); one that raises there comes back as its error
    line, one past its timeout as a timeout."""
    spec = {"loader": "no-such-loader", "device": "cpu"}
    res = run_child(spec, timeout=300, module="benchmarks.data", metered=False, pythonpath=REPO)
    assert res["error"].startswith("ValueError: loader must be one of"), res["error"]
    assert res["wall_s"] > 0
    res = run_child(spec, timeout=0.01, module="benchmarks.data", metered=False, pythonpath=REPO)
    assert res["error"] == "timed out after 0 s" and res["wall_s"] >= 0.01


def test_command_line_help_and_bad_input(tmp_path: Path) -> None:
    """``python -m benchmarks.data --help`` names its own options and the default folder under
    outputs/ (never docs/); an --only that names no row is one error line, status 2, before
    any clip set is generated or any file written."""
    cmd = [sys.executable, "-m", "benchmarks.data"]
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for option in ("--clips", "--timed-clips", "--target-clips-per-s", "--rounds", "--only"):
        assert option in proc.stdout, option
    assert "outputs/bench_data" in proc.stdout and "--suite" not in proc.stdout
    proc = subprocess.run([*cmd, "--only", "no-such-row", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: no rows left after --only ['no-such-row']\n", proc.stderr
    assert not (tmp_path / "out").exists()
    proc = subprocess.run([*cmd, "--rounds", "0"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 2 and "--rounds" in proc.stderr.splitlines()[-1]
