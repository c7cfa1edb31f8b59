"""The cost benchmark (``python -m videotrain.bench``) on a tiny setting, and its pieces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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
    (FrameDropout(0.5), 0.8),
], ids=["sbp_frame", "dropout"])
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
        "resnet18/sbp-frame-0.5", "resnet18/sbp-frame-0.25",
        "resnet18/frame_dropout-0.5", "resnet18/frame_dropout-0.25",
        "vit_tiny/e2e", "vit_tiny/sbp-frame-0.5",
        "timm:convnext_atto/e2e", "timm:convnext_atto/sbp-frame-0.5",
        "timm:convnext_atto/checkpoint-optimal-b0.5",
        "timm:vit_tiny_patch16_224/e2e", "timm:vit_tiny_patch16_224/sbp-frame-0.5",
        "timm:vit_tiny_patch16_224/checkpoint-optimal-b0.5",
    ]
    spec = resolve([row("resnet18", "sbp", 0.5, bn_policy="frozen")], ["device=cpu"], [])[1]
    assert spec["overrides"] == ["device=cpu", "model/backbone=resnet18", "memory=sbp",
                                 "memory.keep_ratio=0.5", "memory.bn_policy=frozen",
                                 "trainer.compile=false"]  # eager unless it is a compiled twin
    assert spec["name"] == "resnet18/sbp-frame-0.5"  # SBP rows keep the names results are compared by


def test_timm_rows_compose_and_build() -> None:
    """The default suite's timm rows (model/backbone=timm) compose and their models build at
    the bench's setting (not run: the suite is slow)."""
    from videotrain.bench.cli import suite_specs
    from videotrain.config.build import build_model, compose_cfg

    specs = [s for s in suite_specs("default", "cpu") if s["backbone"].startswith("timm:")]
    assert len(specs) == 6
    for spec in specs:
        cfg = compose_cfg(spec["overrides"])
        assert cfg.model.backbone.name == spec["backbone"].split(":", 1)[1]
        model = build_model(cfg, num_classes=4)
        assert model.strategy.name == spec["strategy"]
    # moved to another backbone, a timm row drops its model.backbone.name
    moved = resolve(SUITES["default"], [], ["model/backbone=resnet10"])
    assert not any("model.backbone.name" in o for s in moved for o in s["overrides"])


def test_resolve_overrides_filter_and_reference() -> None:
    # a backbone override moves every row; rows that became identical are merged
    specs = resolve(SUITES["default"], [], ["model/backbone=resnet10"])
    names = [s["name"] for s in specs]
    assert len(names) == len(set(names)) and all(n.startswith("resnet10/") for n in names)
    # --only keeps an e2e reference per backbone
    specs = resolve(SUITES["default"], [], [], only=["sbp-frame-0.5"])
    assert [s["name"] for s in specs] == [
        "resnet18/e2e", "resnet18/sbp-frame-0.5", "vit_tiny/e2e", "vit_tiny/sbp-frame-0.5",
        "timm:convnext_atto/e2e", "timm:convnext_atto/sbp-frame-0.5",
        "timm:vit_tiny_patch16_224/e2e", "timm:vit_tiny_patch16_224/sbp-frame-0.5"]
    ckpt = resolve(SUITES["recompute"], [], [])
    assert {s["policy"] for s in ckpt if s["strategy"] == "recompute"} == {"blocks", "sqrt",
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


def test_device_name_resolves_auto_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` becomes the name of what torch sees; other names reach the rows as given
    (the rows' ``build.resolve_device`` checks them)."""
    from videotrain.bench.spawn import device_name

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_name("auto") == "cuda" and device_name("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_name("auto") == "cpu" and device_name("cuda") == "cuda"


def test_run_child_returns_the_child_error_and_the_timeout() -> None:
    """A row that raises in its process comes back as its error line (not raised here); a row
    past its timeout comes back as a timeout, both with the wall time."""
    from videotrain.bench.spawn import run_child

    spec = {"device": "cpu"}  # no overrides: the child's measure raises at once
    res = run_child(spec, timeout=300)
    assert res["error"] == "KeyError: 'overrides'", res["error"]
    assert res["wall_s"] > 0
    res = run_child(spec, timeout=0.01)
    assert res["error"] == "timed out after 0 s" and res["wall_s"] >= 0.01


def test_help_offers_only_the_cost_suites() -> None:
    """``python -m videotrain.bench`` is the strategies' cost benchmark only: the lab's suites
    (data, annotations, accuracy) and their options are not in the package's command."""
    from videotrain.bench.cli import parse_args

    proc = subprocess.run([sys.executable, "-m", "videotrain.bench", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    choices = proc.stdout.split("--suite {", 1)[1].split("}", 1)[0].split(",")
    assert sorted(choices) == sorted(SUITES) == ["all", "default", "gpu", "recompute", "sbp"]
    for gone in ("--clips", "--timed-clips", "--target-clips-per-s", "--scale", "--tasks",
                 "--seeds", "--jobs", "--runs-dir", "--keep-checkpoints", "--report-only",
                 "--equal-time"):
        assert gone not in proc.stdout, gone
    words = " ".join(proc.stdout.split())  # argparse wraps the help text
    assert "python -m benchmarks.data" in words and "docs/results" not in words
    assert "outputs/bench/gpu/<gpu>/ unless --out" in words
    for suite in ("data", "annotations", "accuracy"):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--suite", suite])
        assert exc.value.code == 2


# ---------------------------------------------------------------------- the GPU suite
GPU_NAMES = [  # the acceptance rows first, then the comparison rows
    "resnet50/e2e", "resnet50/e2e-nchw", "resnet50/sbp-frame-0.5", "resnet50/sbp-frame-0.25",
    "resnet50/sbp-frame-frozen-0.5", "resnet50/checkpoint-sqrt", "resnet50/checkpoint-optimal-b0.5",
    "vit_b_16/e2e", "vit_b_16/sbp-frame-0.5", "vit_b_16/sbp-frame-0.25",
    "resnet50/frame_dropout-0.5", "resnet50/sbp-frame-checkpoint:optimal-0.5",
    "vit_b_16/checkpoint-optimal-b0.5",
    "resnet50/auto-b0.5", "resnet50/e2e-compiled", "resnet50/sbp-frame-0.5-compiled",
    "resnet50/checkpoint-optimal-b0.5-compiled", "resnet50/sbp-frame-0.25-compiled",
    "resnet50/sbp-frame-frozen-0.5-compiled", "resnet50/checkpoint-sqrt-compiled",
    "vit_b_16/e2e-compiled", "vit_b_16/sbp-frame-0.5-compiled",
    "resnet50/e2e-compiled:reduce-overhead",
]
AUTO_ROW = GPU_NAMES.index("resnet50/auto-b0.5")


def test_gpu_suite_without_cuda_exits_at_once(tmp_path: Path) -> None:
    """No CUDA (hidden here, so this holds on a GPU machine too): status 2 and one line on
    stderr, before any row is spawned or any file written."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "videotrain.bench", "--suite", "gpu"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and "--suite gpu needs a CUDA GPU" in proc.stderr
    assert "no GPU figure" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/bench/gpu/ folder
    assert elapsed < 15


def test_only_naming_no_row_is_one_error_line(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import videotrain.bench.cli as cli

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("spawned a row"))
    assert cli.main(["--only", "no-such-row"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: no rows left after --only ['no-such-row']\n" and captured.out == ""


def test_gpu_suite_refuses_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from videotrain.bench.cli import CudaRequired

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("spawned a row"))
    with pytest.raises(CudaRequired, match="--device cpu was given"):
        run_bench(suite="gpu", device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CudaRequired, match=r"is_available\(\) is False"):
        run_bench(suite="gpu")


def test_gpu_suite_rows_compose_and_build() -> None:
    """Every row at the suite's own setting (resnet50 + transformer head, B=8 x T=16 at 224 px,
    bf16, cuda) composes, and its model instantiates (on the CPU, not run)."""
    from videotrain.bench.cli import auto_budget, suite_specs
    from videotrain.bench.suites import own_shape
    from videotrain.config.build import build_model, compose_cfg

    specs = suite_specs("gpu", "cuda")
    assert [s["name"] for s in specs] == GPU_NAMES
    # memory=auto gets half of the e2e row's measured peak, computed by the runner
    per_row = [[{"peak_mem_mb": 9000.0}]] + [[] for _ in specs[1:]]
    auto = auto_budget(specs[AUTO_ROW], specs, per_row)
    assert auto["auto_budget_mb"] == 4500.0 and auto["overrides"][-1] == "memory.budget_mb=4500.0"
    specs[AUTO_ROW] = auto
    for spec in specs:
        cfg = compose_cfg(spec["overrides"])
        vit = spec["backbone"] == "vit_b_16"  # 8 clips of 64 frames: the suite's ViT shape
        assert own_shape(spec) == ({"batch_size": 8, "frames": 64} if vit else {})
        assert (cfg.data.batch_size, cfg.data.num_frames, cfg.data.crop_size) == (
            (8, 64 if vit else 16, 224))
        assert cfg.trainer.precision == "bf16" and cfg.device == "cuda"
        assert cfg.model.head._target_.endswith("TransformerHead")
        # channels_last: auto (on for ResNet-50 on CUDA) except in the NCHW comparison row
        assert cfg.trainer.channels_last == (False if spec["name"].endswith("nchw") else "auto")
        if vit:
            assert cfg.model.backbone.hidden_dim == 768 and cfg.model.head.max_frames >= 64
            continue
        assert cfg.model.backbone.depth == 50
        model = build_model(cfg, num_classes=10)
        assert model.strategy.name == spec["strategy"] and model.backbone.feature_dim == 2048
        if spec["name"] == "resnet50/sbp-frame-frozen-0.5":
            assert model.strategy.bn_policy == "frozen"
    assert compose_cfg(auto["overrides"]).memory.budget_mb == 4500.0
    # every row eager (trainer.compile=false, not auto: CUDA would compile it) but the compiled
    # twins, which come last
    compiled = [s["name"] for s in specs if compose_cfg(s["overrides"]).trainer.compile is True]
    assert compiled == [n for n in GPU_NAMES if "-compiled" in n] == GPU_NAMES[AUTO_ROW + 1:]
    assert all(compose_cfg(s["overrides"]).trainer.compile is False for s in specs
               if s["name"] not in compiled)
    # the user's flags and overrides still win over the suite's setting
    spec = suite_specs("gpu", "cuda", batch_size=2, extra=["trainer.precision=32"])[0]
    cfg = compose_cfg(spec["overrides"])
    assert cfg.data.batch_size == 2 and str(cfg.trainer.precision) == "32" and cfg.data.crop_size == 224


def test_gpu_check_parts_cover_the_suite() -> None:
    """scripts/gpu_check.sh's two calls: part 1 runs the acceptance rows in one bench
    run (one e2e for their ratios), part 2 the rest; together every row of the suite."""
    import re

    from videotrain.bench.cli import suite_specs

    script = (Path(__file__).parents[1] / "scripts" / "gpu_check.sh").read_text()
    part = {var: "".join(re.findall(rf'^{var}\+?="([^"]*)"', script, re.M)).split(",")
            for var in ("ACCEPT", "REST")}
    names = {var: [s["name"] for s in suite_specs("gpu", "cuda", only=globs)]
             for var, globs in part.items()}
    assert names["ACCEPT"] == GPU_NAMES[:10]
    assert set(names["ACCEPT"]) | set(names["REST"]) == set(GPU_NAMES)


def test_row_of_its_own_shape_gets_a_reference_and_a_column() -> None:
    """A row with its own input shape: its e2e reference, added by --only, runs at that shape
    (a ratio to e2e compares equal batches), and the table shows a B×T column where rows differ."""
    from videotrain.bench import report
    from videotrain.bench.cli import suite_specs
    from videotrain.bench.suites import own_shape

    specs = suite_specs("gpu", "cuda", only=["vit_b_16/sbp-frame-0.5"])
    assert [s["name"] for s in specs] == ["vit_b_16/e2e", "vit_b_16/sbp-frame-0.5"]
    assert [own_shape(s) for s in specs] == [{"batch_size": 8, "frames": 64}] * 2
    assert all("data.num_frames=64" in s["overrides"] for s in specs)
    rows = [{"backbone": "resnet50", "strategy": "e2e", "batch_size": 8, "frames": 16},
            {"backbone": "vit_b_16", "strategy": "e2e", "batch_size": 8, "frames": 64}]
    table = report.markdown(rows)
    assert "| B×T |" in table and "| 8×16 |" in table and "| 8×64 |" in table
    assert "B×T" not in report.markdown(rows[:1])


def test_auto_budget_without_e2e_result() -> None:
    from videotrain.bench.cli import auto_budget, suite_specs

    specs = suite_specs("gpu", "cuda")
    failed = auto_budget(specs[AUTO_ROW], specs, [[{"error": "boom"}]] + [[] for _ in specs[1:]])
    assert "e2e row" in failed["error"] and "auto_budget_mb" not in failed


def test_gpu_slug_and_default_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --out the GPU suite writes under outputs/ (one folder per GPU model), never
    into docs/; the other suites write nothing."""
    from videotrain.bench.cli import default_out, slug

    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert slug("NVIDIA A100-SXM4-40GB") == "nvidia-a100-sxm4-40gb"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert default_out("gpu", "cuda") == Path("outputs/bench/gpu/nvidia-h100-80gb-hbm3")
    assert default_out("gpu", "cpu") is None and default_out("default", "cuda") is None


def test_estimated_step_peak_within_15_percent_and_eval_within_training() -> None:
    """The fit predictor (fake tensors) against the CPU meter the trainer uses, at the bench's
    setting (resnet18 + transformer head, 2 x 16 frames at 112 px, fp32, AdamW): every row
    within +-15%; and the validation forward (4x the clips, eval.frame_chunk=auto) never above
    the row's training step."""
    rows = [row("resnet18", "e2e"), row("resnet18", "sbp", 0.5),
            row("resnet18", "sbp", 0.25), row("resnet18", "frame_dropout", 0.5),
            row("resnet18", "recompute", policy="sqrt"),
            {**row("resnet18", "recompute", policy="optimal"), "budget": "min"}]
    results, _, table = run_bench(rows=rows, steps=1, warmup=1, device="cpu", threads=1,
                                  log=lambda *a, **k: None)
    assert len(results) == len(rows), table
    for r in results:
        assert not r.get("error"), (r["name"], r.get("error"))
        assert 0.85 <= r["step_estimated_mb"] / r["peak_mem_mb"] <= 1.15, (r["name"], table)
        assert r["eval_peak_mb"] <= r["peak_mem_mb"], (r["name"], table)


def test_time_budget_caps_and_skips_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's timeout never reaches past the run's time budget, and rows that would start
    after it are recorded as not run (the GPU suite's 10-minute guarantee)."""
    import videotrain.bench.cli as cli

    timeouts: list[float] = []

    def fake_child(spec: dict, timeout: float, **_: object) -> dict:
        timeouts.append(timeout)
        return {"error": "fake"}

    monkeypatch.setattr(cli, "run_child", fake_child)
    quiet = dict(TINY, log=lambda *a, **k: None)
    rows, meta, _ = run_bench(only=["sbp-frame-0.5"], time_budget=100, timeout=1800, **quiet)
    assert len(timeouts) == 8 and all(t <= 100 for t in timeouts)  # 4 backbones x (e2e, sbp)
    assert meta["setting"]["time_budget"] == 100
    timeouts.clear()
    rows, _, _ = run_bench(only=["sbp-frame-0.5"], time_budget=5, **quiet)
    assert timeouts == [] and all("time budget was spent" in r["error"] for r in rows)
    assert 0 < cli.setting_for("gpu").time_budget < 600  # children end by then; the report after


def test_rows_run_through_the_child_the_caller_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row runs ``python -m videotrain.bench --child`` unless the caller names its own
    child and the folder it is found in (a suite beside the package)."""
    import videotrain.bench.cli as cli

    calls: list[tuple] = []

    def fake_child(spec: dict, timeout: float, module: str = "", pythonpath: object = None) -> dict:
        calls.append((module, pythonpath))
        return {"error": "fake"}

    monkeypatch.setattr(cli, "run_child", fake_child)
    quiet = dict(TINY, log=lambda *a, **k: None)
    run_bench(rows=[row("resnet18", "sbp", 0.5)], **quiet)
    assert calls == [("videotrain.bench", None)] * 2  # e2e reference and the row
    calls.clear()
    run_bench(rows=[row("resnet18", "sbp", 0.5)], child="lab.suite", child_path="/lab", **quiet)
    assert calls == [("lab.suite", "/lab")] * 2


def test_a_run_writes_after_every_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """bench.json and bench.md after every row (``complete`` false), so a run cut short (a
    device call's time limit) keeps the rows that ran; the last write is complete, with the plot."""
    import videotrain.bench.cli as cli

    seen: list[dict] = []

    def fake_child(spec: dict, timeout: float, **_: object) -> dict:
        if (tmp_path / "bench.json").exists():
            seen.append(json.loads((tmp_path / "bench.json").read_text()))
        return {"error": "fake"}

    monkeypatch.setattr(cli, "run_child", fake_child)
    monkeypatch.setattr(cli, "estimated_steps", lambda specs, *a: [1.0] * len(specs))
    rows, meta, _ = run_bench(only=["sbp-frame-0.5"], out=tmp_path, **TINY, log=lambda *a, **k: None)
    assert [len(s["rows"]) for s in seen] == list(range(1, len(rows)))
    assert not any(s["meta"]["complete"] for s in seen) and not seen[0]["rows"][0].get("step_estimated_mb")
    final = json.loads((tmp_path / "bench.json").read_text())
    assert final["meta"]["complete"] and len(final["rows"]) == len(rows)
    assert all(r["step_estimated_mb"] == 1.0 for r in final["rows"]) and (tmp_path / "bench.png").exists()


def test_cuda_report_waits_for_estimates_a_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the estimates run beside the rows; the report takes them if they are done within
    ``ESTIMATE_WAIT_S`` of the rows' end, else reports none rather than spend the call's time."""
    import videotrain.bench.cli as cli

    specs = [{"name": "a"}, {"name": "b"}]
    monkeypatch.setattr(cli, "ESTIMATE_WAIT_S", 0.2)
    monkeypatch.setattr(cli, "estimated_steps", lambda s, *a: [2.0] * len(s))
    assert cli.start_estimates(specs, "cuda", False)() == [2.0, 2.0]
    monkeypatch.setattr(cli, "estimated_steps", lambda s, *a: time.sleep(30) or [2.0] * len(s))
    t0 = time.perf_counter()
    assert cli.start_estimates(specs, "cuda", False)() == [None, None]
    assert time.perf_counter() - t0 < 5


# ---------------------------------------------------------------------- host- or device-bound
def test_device_activity_busy_fraction_and_kernels() -> None:
    """Two profiled steps over 1000 us: kernels on two streams overlap (counted once), a copy
    counts as busy but not as a kernel."""
    from videotrain.bench.child import device_activity

    spans = [("gemm", 0.0, 300.0), ("relu", 200.0, 400.0), ("MemcpyHtoD", 500.0, 600.0),
             ("bn", 700.0, 750.0)]
    got = device_activity(spans, wall_us=1000.0, steps=2)
    assert got["kernels_per_step"] == 1.5
    assert got["gpu_busy"] == pytest.approx((400 + 100 + 50) / 1000)
    assert got["kernel_ms_per_step"] == pytest.approx((300 + 200 + 50) / 2 / 1e3)


def test_default_steps_follow_the_device() -> None:
    from videotrain.bench.cli import parse_args, timed_steps

    assert timed_steps("cuda", None, None) == (20, 5) and timed_steps("cuda:1", 30, 0) == (30, 0)
    assert timed_steps("cpu", None, None) == (5, 2)
    args = parse_args(["--suite", "gpu", "--rounds", "3"])
    assert (args.steps, args.warmup, args.rounds) == (None, None, 3)


def test_cpu_rows_report_aten_ops_per_step(tmp_path: Path) -> None:
    """On a CPU the launches column holds the aten ops a step dispatches, deterministic and
    lower for e2e than for a checkpointed row."""
    rows = [row("resnet10", "e2e"), row("resnet10", "recompute", policy="sqrt")]
    results, meta, table = run_bench(rows=rows, out=tmp_path, log=lambda *a, **k: None, **TINY)
    e2e, ckpt = results
    assert not e2e.get("error") and not ckpt.get("error"), table
    assert e2e["ops_per_step"] == e2e["launches_per_step"] > 0 and "gpu_busy" not in e2e
    assert ckpt["ops_per_step"] > e2e["ops_per_step"]
    assert "aten ops/step" in table and "GPU busy" not in table
    header = (tmp_path / "bench.md").read_text().splitlines()[2]
    assert f"torch {meta['torch']}" in header
    commit = meta["machine"].get("git")  # None or "" in a tree without git history
    assert not commit or f"commit {commit}" in header


def test_commit_from_the_environment_without_a_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a lent GPU machine the working tree comes without .git: bench.json still names the
    commit, as scripts/gpu_check.sh passes it."""
    import videotrain.bench.spawn as spawn

    def no_git(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise OSError("no git")

    monkeypatch.setattr(spawn.subprocess, "run", no_git)
    monkeypatch.setenv("VIDEOTRAIN_COMMIT", "abc1234")
    assert spawn.machine_info("cpu")["git"] == "abc1234"
    monkeypatch.delenv("VIDEOTRAIN_COMMIT")
    assert "git" not in spawn.machine_info("cpu")


def test_partial_reports_read_no_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The reports written while rows run do not read the GPU (that starts CUDA in the bench's
    own process, which would hold a context beside every row); the last one does."""
    import videotrain.bench.cli as cli
    import videotrain.bench.spawn as spawn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(spawn, "gpu_info", lambda device: {"gpu": "read"})
    assert "gpu" not in spawn.machine_info("cuda", gpu=False)
    assert spawn.machine_info("cuda")["gpu"] == "read"
    seen: list[dict] = []

    def fake_child(spec: dict, timeout: float, **_: object) -> dict:
        if (tmp_path / "bench.json").exists():
            seen.append(json.loads((tmp_path / "bench.json").read_text())["meta"]["machine"])
        return {"error": "fake"}

    monkeypatch.setattr(cli, "run_child", fake_child)
    monkeypatch.setattr(cli, "estimated_steps", lambda specs, *a: [None] * len(specs))
    run_bench(only=["sbp-frame-0.5"], out=tmp_path, **{**TINY, "device": "cuda"},
              log=lambda *a, **k: None)
    assert seen and not any("gpu" in m for m in seen)
    assert json.loads((tmp_path / "bench.json").read_text())["meta"]["machine"]["gpu"] == "read"


@pytest.mark.gpu
def test_launch_figures_on_cuda(cuda: torch.device) -> None:
    """torch.profiler over CUDA steps: kernels per step, kernel time and a busy fraction in
    (0, 1] (the GPU twin of the CPU rows' aten-op count)."""
    from videotrain.bench.child import launch_figures

    lin = torch.nn.Linear(512, 512).to(cuda)
    x = torch.randn(256, 512, device=cuda)

    def step() -> None:
        lin(x).relu().sum().backward()
        torch.cuda.synchronize(cuda)

    got = launch_figures(step, cuda, steps=3)
    assert "profile_error" not in got, got
    assert got["kernels_per_step"] >= 3 and got["launches_per_step"] == got["kernels_per_step"]
    assert 0 < got["gpu_busy"] <= 1.0 and got["kernel_ms_per_step"] > 0 and got["ops_per_step"] > 0


def test_the_compile_axis() -> None:
    """--compile both: every row and its compiled twin (trainer.compile=true, named -compiled),
    the rows eager otherwise; --compile compiled keeps an eager e2e reference; ratios are
    against the eager e2e, and the table shows the mode, graphs and recompiles."""
    from videotrain.bench import report
    from videotrain.bench.cli import parse_args, suite_specs
    from videotrain.config.build import compose_cfg

    only = ["resnet18/e2e*", "resnet18/sbp-frame-0.5*"]
    specs = suite_specs("default", "cpu", compile_axis="both", only=only)
    assert [s["name"] for s in specs] == ["resnet18/e2e", "resnet18/e2e-compiled",
                                          "resnet18/sbp-frame-0.5", "resnet18/sbp-frame-0.5-compiled"]
    assert [compose_cfg(s["overrides"]).trainer.compile for s in specs] == [False, True] * 2
    specs = suite_specs("default", "cpu", compile_axis="compiled", only=["resnet18/sbp-frame-0.5*"])
    assert [(s["name"], s["compiled"]) for s in specs] == [
        ("resnet18/e2e", False), ("resnet18/sbp-frame-0.5-compiled", True)]
    rows = [{"backbone": "r", "strategy": "e2e", "compiled": False, "step_time_s": 2.0},
            {"backbone": "r", "strategy": "e2e", "compiled": True, "step_time_s": 1.0,
             "compiled_graphs": 3, "recompiles": 0}]
    report.add_ratios(rows)
    assert [r["time_ratio"] for r in rows] == [1.0, 0.5]
    table = report.markdown(rows)
    assert "| compile |" in table and "| recompiles |" in table and "| compiled |" in table
    assert "| compile |" not in report.markdown(rows[:1])
    with pytest.raises(SystemExit):
        parse_args(["--compile", "sometimes"])
