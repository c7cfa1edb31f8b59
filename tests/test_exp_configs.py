"""The dataset experiments (``+exp=<dataset>_sbp``) compose and train for two steps, each on a
tiny tree written in its dataset's own layout, and test with multiple views after fit.

Everything the experiment sets is used as is (data layout and options, SBP, optimizer,
schedule, test after fit) except the model and precision: resnet50 in bf16 takes about two
minutes for two steps on a CPU, so the runs use the tiny ViT in fp32. That the experiment's own
model builds and runs is checked by tests/test_configs.py (every ``+exp`` option)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import videotrain.run as run

DATASET_EXPS = {"kinetics_sbp": "kinetics", "ucf101_sbp": "ucf101", "hmdb51_sbp": "hmdb51",
                "ssv2_sbp": "ssv2"}


@pytest.mark.parametrize("exp", list(DATASET_EXPS))
def test_dataset_exp_trains_two_steps(exp: str, layout_root, compose_cfg, shrink_overrides,
                                      tiny_model_overrides, tmp_path: Path) -> None:
    layout = DATASET_EXPS[exp]
    overrides = [
        f"+exp={exp}", f"data.root={layout_root(layout)}", *shrink_overrides,
        "model.pretrained=null",  # no network in tests
        "trainer.max_steps=2", "eval.clips=2", "eval.crops=3", "eval.batch_size=4",
    ]
    cfg = compose_cfg(overrides)
    # what the experiment sets, as composed
    assert cfg.data.name == cfg.data.layout == layout
    assert cfg.memory._target_.endswith("StochasticBackprop") and cfg.memory.keep_ratio == 0.5
    assert cfg.model.backbone.depth == 50 and cfg.trainer.precision == "bf16"
    assert cfg.trainer.test_after_fit is True and cfg.optim.name == "sgd"
    if layout in ("ucf101", "hmdb51"):
        assert cfg.data.fold == 1
    if layout == "ssv2":
        assert cfg.data.hflip is False  # "left to right" classes
    results = run.train(compose_cfg([*overrides, *tiny_model_overrides, "trainer.precision=32"]),
                        tmp_path)
    assert results["steps"] == 2 and results["skipped_videos"] == 0
    assert results["memory_strategy"] == "sbp" and results["num_classes"] == 4
    test = json.loads((tmp_path / "eval.json").read_text())
    assert test["views"] == 6 and test["videos"] == 8 and 0.0 <= test["video_top1"] <= 1.0
    assert (tmp_path / "per_class.csv").exists() and (tmp_path / "confusion.png").exists()
