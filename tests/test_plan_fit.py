"""``python -m videotrain.plan --fit GB``: every strategy row, predicted on fake tensors, with the
JSON fields users script against; a frozen backbone predicted as training builds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from videotrain.config.build import compose_cfg
from videotrain.memory.estimate import GIB
from videotrain.plan import FIT_ROWS, fit_report
from videotrain.plan import main as plan_main

TINY = ["model/backbone=resnet10", "model.backbone.temporal_shift=0", "model/head=tconv",
        "data.num_frames=8", "data.crop_size=96", "data.batch_size=2", "data.val_batch_size=2",
        "trainer.precision=bf16"]  # per-frame: every row applies (with the shift, see below)
ROW_KEYS = {"strategy", "keep_ratio", "policy", "estimated_train_peak_gb", "estimated_eval_peak_gb",
            "fits", "max_batch_size", "max_num_frames"}


@pytest.fixture(scope="module")
def report() -> dict:
    return fit_report(TINY, device_gb=1.0)


def test_fit_report_has_every_row_and_field(report: dict) -> None:
    assert {"device", "device_memory_gb", "precision", "backbone", "batch_size", "num_frames",
            "crop_size", "rows"} <= set(report)
    assert (report["device"], report["precision"], report["backbone"]) == ("cuda", "bf16", "resnet10")
    assert [(r["strategy"], r["keep_ratio"], r["policy"]) for r in report["rows"]] == \
        [(s, k, p) for s, k, p, _ in FIT_ROWS]
    for r in report["rows"]:
        assert "error" not in r, r
        assert ROW_KEYS <= set(r)


def test_fit_rows_order_as_their_strategies_say(report: dict) -> None:
    rows = {(r["strategy"], r["keep_ratio"], r["policy"]): r for r in report["rows"]}
    peak = {k: r["estimated_step_increase_mb"] for k, r in rows.items()}
    e2e = peak[("e2e", None, None)]
    assert peak[("sbp", 0.25, None)] < peak[("sbp", 0.5, None)] < e2e
    assert peak[("frame_dropout", 0.5, None)] < e2e
    assert peak[("recompute", None, "optimal")] < e2e
    assert peak[("sbp", 0.5, "optimal")] < peak[("sbp", 0.5, None)]
    for r in rows.values():  # a row that fits at its batch allows at least that batch
        assert r["fits"] == (r["max_batch_size"] >= 2)
        assert r["max_num_frames"] >= 8 or not r["fits"]


def test_a_card_too_small_fits_nothing() -> None:
    small = fit_report(TINY, device_gb=0.55)  # 0.5 GiB of it is the CUDA context
    assert not any(r["fits"] for r in small["rows"])
    assert all(r["max_batch_size"] == 0 for r in small["rows"])


def test_plan_fit_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "f.json"
    assert plan_main(["--fit", "1", "--out", str(out), *TINY]) == 0
    table = capsys.readouterr().out
    assert "sbp 0.5 +optimal" in table and "max batch" in table
    saved = json.loads(out.read_text())
    assert saved["device_memory_gb"] == 1.0 and len(saved["rows"]) == len(FIT_ROWS)


def test_plan_fit_refuses_a_non_positive_size(capsys: pytest.CaptureFixture) -> None:
    assert plan_main(["--fit", "0", *TINY]) == 2
    assert "--fit takes the device's memory in GiB" in capsys.readouterr().err


def test_fit_estimates_the_frozen_backbone_step_training_builds(report: dict) -> None:
    """``model.freeze_backbone=true`` (a linear probe): the e2e row's training step is what a
    fake step of the frozen model counts, built by hand as ``build_model`` builds it, and less than the
    unfrozen row (no backbone gradients, no optimizer state for them, nothing saved)."""
    from hydra.utils import instantiate

    from videotrain.config.build import optimizer_from_cfg
    from videotrain.engine.precision import PRECISIONS
    from videotrain.memory.e2e import EndToEnd
    from videotrain.memory.estimate import simulate_step
    from videotrain.models.finetune import freeze_backbone
    from videotrain.models.video import VideoClassifier

    frozen = fit_report([*TINY, "model.freeze_backbone=true"], device_gb=1.0)
    row = next(r for r in frozen["rows"] if r["strategy"] == "e2e")
    cfg = compose_cfg([*TINY, "model.freeze_backbone=true"])

    def make_model() -> VideoClassifier:
        backbone = instantiate(cfg.model.backbone, pretrained=None)
        model = VideoClassifier(backbone, instantiate(cfg.model.head, in_dim=backbone.feature_dim,
                                                      num_classes=400), EndToEnd())
        freeze_backbone(model)
        return model

    def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = optimizer_from_cfg(cfg, model)
        for group in optimizer.param_groups:
            group["foreach"] = True  # as for a CUDA target
        return optimizer

    ref = simulate_step(make_model, make_optimizer, (2, 8, 3, 96, 96), 400,
                        autocast_dtype=PRECISIONS["bf16"], grad_clip=cfg.trainer.grad_clip,
                        label_smoothing=float(cfg.trainer.label_smoothing))
    assert row["estimated_train_peak_gb"] == ref.train_peak / GIB
    assert row["held_gb"] == ref.held / GIB
    unfrozen = next(r for r in report["rows"] if r["strategy"] == "e2e")
    assert row["estimated_train_peak_gb"] < 0.8 * unfrozen["estimated_train_peak_gb"]
    assert row["held_gb"] < unfrozen["held_gb"]


def test_a_shifting_backbone_skips_the_frame_level_sbp_recompute_row(tmp_path) -> None:
    """The default resnet10 mixes frames: SBP rows run the lockstep code, and the SBP +
    recompute row (record/apply, which cannot shift) is skipped with a reason, not a failure
    (exit 0)."""
    args = ["model.backbone.temporal_shift=0.125" if a.startswith("model.backbone.temporal_shift")
            else a for a in TINY]
    out = tmp_path / "f.json"
    assert plan_main(["--fit", "1", "--out", str(out), *args]) == 0
    rows = json.loads(out.read_text())["rows"]
    skipped = [r for r in rows if "skipped" in r]
    assert [(r["strategy"], r["policy"]) for r in skipped] == [("sbp", "optimal")]
    assert "temporal_shift" in skipped[0]["skipped"]
    assert not any("error" in r for r in rows) and len(rows) == len(FIT_ROWS)
