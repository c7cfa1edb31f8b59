"""Fine-tuning: ``model.init_from`` (backbone always, head when its shape matches, else
re-initialised and reported) and ``model.freeze_backbone``."""

from __future__ import annotations

import itertools
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import videotrain.config.build as builder
import videotrain.run as run
from videotrain.engine.checkpoints import format as ckpt
from videotrain.models.finetune import InitFromMismatch, init_from

TINY_VIT = ["model/backbone=vit_tiny", "model.backbone.num_layers=1", "model.backbone.hidden_dim=32",
            "model.backbone.num_heads=2", "model.backbone.mlp_dim=64", "model.head.hidden_dim=16",
            "data.crop_size=32"]


@pytest.fixture
def model_of(compose_cfg):
    seeds = itertools.count()

    def _model(num_classes: int):  # each model with its own random weights
        torch.manual_seed(next(seeds))
        return builder.build_model(compose_cfg(TINY_VIT), num_classes)

    return _model


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_head_of_another_shape_is_reinitialised_and_reported(model_of, tmp_path: Path, caplog) -> None:
    source, target = model_of(4), model_of(3)
    fresh_head = {k: v.clone() for k, v in target.head.state_dict().items()}
    torch.save(source.state_dict(), tmp_path / "k4.pt")
    with caplog.at_level(logging.WARNING, logger="videotrain.models.finetune"):
        got = init_from(target, tmp_path / "k4.pt")
    assert got["head"] == "re-initialised" and got["weights"] == "state dict"
    assert _same(target.backbone.state_dict(), source.backbone.state_dict())
    assert _same(target.head.state_dict(), fresh_head)  # the new head kept its initialisation
    assert "head was re-initialised" in caplog.text and "(4, 16) vs (3, 16)" in caplog.text.replace(
        "fc.weight ", "")  # the classifier's shapes, file vs model


def test_matching_head_is_loaded_from_a_checkpoint_preferring_ema(model_of, tmp_path: Path) -> None:
    source, ema, target = model_of(4), model_of(4), model_of(4)
    blob = {ckpt.FORMAT_KEY: ckpt.FORMAT, "model": source.state_dict(), "ema_model": ema.state_dict()}
    ckpt.save_atomic(blob, tmp_path / "run.ckpt")
    got = init_from(target, tmp_path / "run.ckpt")
    assert got == {"source": str(tmp_path / "run.ckpt"), "weights": "EMA weights", "head": "loaded",
                   "head_mismatch": []}
    assert _same(target.state_dict(), ema.state_dict())  # the weights the run ships


def test_safetensors_and_ddp_prefixes(model_of, tmp_path: Path) -> None:
    source, target = model_of(4), model_of(4)
    save_file({f"module.{k}": v.contiguous() for k, v in source.state_dict().items()},
              str(tmp_path / "w.safetensors"))
    assert init_from(target, tmp_path / "w.safetensors")["head"] == "loaded"
    assert _same(target.state_dict(), source.state_dict())


def test_a_backbone_that_does_not_fit_is_an_error(model_of, compose_cfg, tmp_path: Path) -> None:
    other = builder.build_model(compose_cfg(["data.crop_size=32"]), 4)  # the default resnet10
    torch.save(other.state_dict(), tmp_path / "resnet.pt")
    with pytest.raises(InitFromMismatch, match=r"its backbone does not fit .*missing keys: net\."):
        init_from(model_of(4), tmp_path / "resnet.pt")
    torch.save({"fc.weight": torch.zeros(2, 2)}, tmp_path / "image.pt")
    with pytest.raises(InitFromMismatch, match="no backbone.* weights.*model.pretrained_path"):
        init_from(model_of(4), tmp_path / "image.pt")
    with pytest.raises(FileNotFoundError, match="model.init_from: file not found"):
        init_from(model_of(4), tmp_path / "absent.ckpt")


def test_freeze_backbone_trains_the_head_only(compose_cfg) -> None:
    cfg = compose_cfg(["data.crop_size=32", "model.freeze_backbone=true"])  # resnet10: BatchNorm
    model = builder.build_model(cfg, 4)
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    opt = builder.optimizer_from_cfg(cfg, model)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.head.parameters()}
    model.train()
    assert not model.backbone.training and model.head.training
    loss = model(torch.randn(2, 3, 3, 32, 32)).sum()
    loss.backward()
    opt.step()
    assert all(p.grad is None for p in model.backbone.parameters())
    assert _same(model.backbone.state_dict(), before)  # BatchNorm statistics too
    model.head.requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to train"):
        builder.optimizer_from_cfg(cfg, model)


def test_a_4_class_run_fine_tunes_on_a_3_class_folder_dataset(run_overrides, tiny_root: Path,
                                                             tmp_path: Path, caplog) -> None:
    """The acceptance run: train on the 4 synthetic classes, then fine-tune on a folder dataset
    of 3 of them from the first run's checkpoint."""
    first = run.train(builder.compose_cfg(run_overrides(trainer__max_steps=2)), tmp_path / "k4")
    assert first["num_classes"] == 4
    three = tmp_path / "three"
    for split in ("train", "val"):
        classes = sorted(p.name for p in (tiny_root / split).iterdir() if p.is_dir())[:3]
        for name in classes:
            shutil.copytree(tiny_root / split / name, three / split / name)
    source = tmp_path / "k4" / "checkpoints" / "last.ckpt"
    overrides = [o for o in run_overrides(three, trainer__max_steps=2) if not o.startswith("data=")]
    with caplog.at_level(logging.INFO):
        results = run.train(builder.compose_cfg(["data=folder", *overrides, f"model.init_from={source}"]),
                            tmp_path / "k3")
    assert results["num_classes"] == 3 and results["steps"] == 2
    assert "the head was re-initialised" in caplog.text and str(source) in caplog.text
