"""The cost benchmark (``python -m videotrain.bench``) on a tiny setting, and its pieces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from videotrain.bench import SUITES, row, run_bench, synthetic_batch
from videotrain.bench.suites import resolve
from videotrain.memory.e2e import EndToEnd
from videotrain.memory.frame_dropout import FrameDropout
from videotrain.memory.sbp.strategy import StochasticBackprop
from videotrain.metrics.saved import saved_activation_bytes
from videotrain.models.backbones import resnet
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier

TINY = dict(batch_size=1, frames=4, size=32, steps=2, warmup=1, device="cpu", threads=1)
ROW_KEYS = {"name", "backbone", "strategy", "keep_ratio", "granularity", "policy", "peak_mem_mb",
            "step_time_s", "clips_per_s", "saved_act_mb", "mem_ratio", "time_ratio", "device",
            "torch", "overrides"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_model(strategy=None) -> VideoClassifier:
    torch.manual_seed(0)
    backbone = resnet(layers=[1, 1, 1, 1])
    return VideoClassifier(backbone, TConvHead(backbone.feature_dim, 4, hidden_dim=16), strategy)


# ---------------------------------------------------------------------- saved activations
def test_saved_activation_bytes_e2e_vs_no_grad() -> None:
    video, _ = synthetic_batch(2, 4, 32, 4)
    model = tiny_model().train()
    e2e = saved_activation_bytes(model, video)
    assert e2e > 0
    assert saved_activation_bytes(model, video) == e2e  # deterministic
    with torch.no_grad():
        assert saved_activation_bytes(model, video) == 0


@pytest.mark.parametrize(("strategy", "at_most"), [
    (StochasticBackprop(0.5), 0.8),
    (StochasticBackprop(0.5, granularity="block"), 1.0),  # only the first blocks' branches split
    (FrameDropout(0.5), 0.8),
], ids=["sbp_frame", "sbp_block", "dropout"])
def test_saved_activation_bytes_shrink_with_keep_ratio(strategy, at_most: float) -> None:
    video, _ = synthetic_batch(2, 8, 32, 4)
    e2e = saved_activation_bytes(tiny_model(EndToEnd()).train(), video)
    assert 0 < saved_activation_bytes(tiny_model(strategy).train(), video) < at_most * e2e


def test_synthetic_batch_is_fixed() -> None:
    (v1, l1), (v2, l2) = synthetic_batch(2, 3, 8, 5), synthetic_batch(2, 3, 8, 5)
    assert v1.shape == (2, 3, 3, 8, 8) and torch.equal(v1, v2) and torch.equal(l1, l2)


# ---------------------------------------------------------------------- suites
def test_default_suite_rows() -> None:
    names = [s["name"] for s in resolve(SUITES["default"], [], [])]
    assert names == [
        "resnet18/e2e", "resnet18/sbp-frame-1", "resnet18/sbp-frame-0.75",
        "resnet18/sbp-frame-0.5", "resnet18/sbp-frame-0.25", "resnet18/sbp-block-0.5",
        "resnet18/sbp-block-0.25", "resnet18/frame_dropout-0.5", "resnet18/frame_dropout-0.25",
        "vit_tiny/e2e", "vit_tiny/sbp-frame-0.5", "vit_tiny/sbp-block-0.5",
        "vit_tiny/sbp-block-0.25",
    ]
    spec = resolve([row("resnet18", "sbp", 0.5, "block")], ["device=cpu"], [])[1]
    assert spec["overrides"] == ["device=cpu", "model/backbone=resnet18", "memory=sbp",
                                 "memory.keep_ratio=0.5", "memory.granularity=block"]


def test_resolve_overrides_filter_and_reference() -> None:
    # a backbone override moves every row; rows that became identical are merged
    specs = resolve(SUITES["default"], [], ["model/backbone=resnet10"])
    names = [s["name"] for s in specs]
    assert len(names) == len(set(names)) and all(n.startswith("resnet10/") for n in names)
    # --only keeps an e2e reference per backbone
    specs = resolve(SUITES["default"], [], [], only=["sbp-block-0.25"])
    assert [s["name"] for s in specs] == ["resnet18/e2e", "resnet18/sbp-block-0.25",
                                          "vit_tiny/e2e", "vit_tiny/sbp-block-0.25"]
    ckpt = resolve(SUITES["checkpoint"], [], [])
    assert {s["policy"] for s in ckpt if s["strategy"] == "checkpoint"} == {"blocks", "sqrt",
                                                                           "optimal"}


# ---------------------------------------------------------------------- end to end
def test_bench_tiny(tmp_path: Path) -> None:
    """Two rows, each in its own subprocess: fields, ratios, bench.json/.md/.png."""
    out = tmp_path / "bench"
    _, _, table = run_bench(suite="default", only=["sbp-frame-0.5"], out=out,
                            extra_overrides=["model/backbone=resnet10"],
                            log=lambda *a, **k: None, **TINY)
    data = json.loads((out / "bench.json").read_text())
    assert [r["name"] for r in data["rows"]] == ["resnet10/e2e", "resnet10/sbp-frame-0.5"]
    e2e, sbp = data["rows"]
    for r in (e2e, sbp):
        assert ROW_KEYS <= set(r) and not r.get("error"), r.get("error")
        assert r["peak_mem_mb"] > 0 and r["step_time_s"] > 0 and r["saved_act_mb"] > 0
        assert r["clips_per_s"] == pytest.approx(1 / r["step_time_s"])
        assert len(r["step_times_s"]) == 2 and r["device"] == "cpu"
    assert e2e["mem_ratio"] == 1.0 and e2e["time_ratio"] == 1.0 and e2e["act_ratio"] == 1.0
    assert sbp["keep_ratio"] == 0.5 and sbp["granularity"] == "frame"
    assert sbp["saved_act_mb"] < e2e["saved_act_mb"]
    assert sbp["mem_ratio"] == pytest.approx(sbp["peak_mem_mb"] / e2e["peak_mem_mb"])
    assert data["meta"]["setting"]["frames"] == 4 and data["meta"]["torch"] == torch.__version__
    md = (out / "bench.md").read_text()
    assert table in md and md.count("| resnet10 |") == 2 and "FAILED" not in md
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_failed_row_exits_nonzero(tmp_path: Path) -> None:
    """A row whose config does not compose is recorded (not raised), and the CLI exits 1."""
    cmd = [sys.executable, "-m", "videotrain.bench", "--only", "e2e", "--batch-size", "1",
           "--frames", "2", "--size", "32", "--steps", "1", "--warmup", "0", "--device", "cpu",
           "--out", str(tmp_path), "model/backbone=resnet10", "memory.no_such_key=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "| resnet10 | e2e |" in proc.stdout and "FAILED" in proc.stdout
    assert "1 row(s) failed: resnet10/e2e" in proc.stderr
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(rows) == 1 and "no_such_key" in rows[0]["error"]


# ---------------------------------------------------------------------- the data suite
def test_data_suite_rows() -> None:
    from videotrain.bench.suites import DATA_SUITES

    assert [r["name"] for r in DATA_SUITES["data"]] == [
        "data/videotrain-w0", "data/videotrain-w1", "data/videotrain-w2", "data/pytorchvideo-w2"]
    assert "data" not in SUITES and not any(r.get("kind") == "data" for r in SUITES["all"])


TINY_DATA = ["data.crop_size=32", "data.short_side=32", "data.num_frames=4", "data.batch_size=4",
             "data=synthetic", "device=cpu"]


@pytest.mark.parametrize("pipeline", ["videotrain", "pytorchvideo"])
def test_data_row_measures_the_same_clips(pipeline: str, tiny_synthetic_overrides, isolated_env) -> None:
    """Both pipelines, in-process and without workers, on the tiny session dataset: the same
    clips, counted the same way."""
    from videotrain.bench.data import measure_data

    overrides = [*TINY_DATA, f"data.root={isolated_env}", *tiny_synthetic_overrides]
    r = measure_data({"pipeline": pipeline, "num_workers": 0, "overrides": overrides,
                      "device": "cpu"})
    # 16 videos, batch 4: the first batch is start-up, the other 3 are timed
    assert r["clips"] == 12 and r["batches"] == 3 and r["videos"] == 16
    assert r["clip_shape"] == (4, 3, 32, 32) and r["pin_memory"] is False
    assert r["clips_per_s"] == pytest.approx(r["clips"] / r["elapsed_s"])


def test_data_rows_combine_and_ratios() -> None:
    from videotrain.bench.report import add_data_ratios, combine_data
    from videotrain.bench.suites import data_row

    runs = [{"clips_per_s": c, "startup_s": 0.5, "clips": 12} for c in (10.0, 30.0, 20.0)]
    w0 = combine_data(data_row("videotrain", 0), runs)
    assert w0["clips_per_s"] == 20.0 and w0["clips_per_s_range"] == "10.0–30.0"
    w2 = combine_data(data_row("videotrain", 2), [{"clips_per_s": 50.0, "startup_s": 1.0}])
    peer = combine_data(data_row("pytorchvideo", 2), [{"clips_per_s": 40.0, "startup_s": 1.0}])
    bad = combine_data(data_row("videotrain", 1), [{"error": "boom"}])
    rows = [w0, bad, w2, peer]
    add_data_ratios(rows)
    assert w2["vs_peer"] == pytest.approx(1.25) and w2["vs_w0"] == pytest.approx(2.5)
    assert w0["vs_peer"] is None and bad["vs_peer"] is None and peer["vs_peer"] == 1.0


def test_data_bench_tiny(tmp_path: Path, tiny_synthetic_overrides, isolated_env) -> None:
    """One row through the runner (a fresh process) and the files it writes."""
    from videotrain.bench.cli import run_data_bench
    from videotrain.bench.suites import data_row

    out = tmp_path / "bench"
    overrides = [*TINY_DATA, f"data.root={isolated_env}", *tiny_synthetic_overrides]
    rows, meta, table = run_data_bench(out=out, device="cpu", extra_overrides=overrides,
                                       rows=[data_row("videotrain", 0)], log=lambda *a, **k: None)
    (row,) = rows
    assert not row.get("error"), row.get("error")
    assert row["name"] == "data/videotrain-w0" and row["clips"] == 12 and row["vs_w0"] == 1.0
    data = json.loads((out / "bench.json").read_text())
    assert [r["kind"] for r in data["rows"]] == ["data"]
    assert data["meta"]["setting"]["num_frames"] == 4 and data["meta"]["setting"]["batch_size"] == 4
    md = (out / "bench.md").read_text()
    assert table in md and "| videotrain | 0 |" in md and "FAILED" not in md
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC
