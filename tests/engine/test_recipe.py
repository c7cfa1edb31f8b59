"""The recipe: MixUp / CutMix with soft targets, RandAugment and random erasing consistent across
a clip's frames, an EMA of the weights (validated, checkpointed, resumed, shipped)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import videotrain.config.build as builder
import videotrain.run as run
from videotrain.data.transforms import MEAN_PIXEL, clips_to_device, train_transform
from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.recipe import BatchMix, RecipeSettings, WeightEMA, soft_target_loss
from videotrain.engine.trainer import Trainer


def _batch(b: int = 6, t: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    frames = torch.rand(b, 1, 3, 16, 16).expand(b, t, 3, 16, 16).contiguous()  # static clips
    return frames, torch.arange(b) % 3


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_batch_mix_gives_soft_targets_and_mixes_every_frame_alike(kind: str) -> None:
    torch.manual_seed(0)
    settings = RecipeSettings(**{f"{kind}_alpha": 1.0})
    video, labels = _batch()
    mixed, targets = BatchMix(settings, 3)(video, labels)
    assert mixed.shape == video.shape and type(mixed) is torch.Tensor
    assert targets.shape == (6, 3) and torch.allclose(targets.sum(1), torch.ones(6))
    assert not torch.equal(mixed, video)  # mixed with the rolled batch
    assert torch.equal(mixed, mixed[:, :1].expand_as(mixed))  # static clips stay static: one mix per clip
    # the target weights are the pixel shares: clip i mixes with clip i-1 (v2's roll)
    lam = targets[torch.arange(6), labels]
    own = (mixed == video).flatten(1).float().mean(1) if kind == "cutmix" else None
    if own is not None:
        assert torch.allclose(lam, own, atol=0.02)


def test_unmixed_batches_get_one_hot_targets_and_the_loss_takes_both() -> None:
    video, labels = _batch()
    same, targets = BatchMix(RecipeSettings(mixup_alpha=1.0, mix_prob=0.0), 3)(video, labels)
    assert torch.equal(same, video) and torch.equal(targets, nn.functional.one_hot(labels, 3).float())
    logits = torch.randn(6, 3)
    assert soft_target_loss(logits, targets) == pytest.approx(float(soft_target_loss(logits, labels)))


def test_settings_are_checked_by_key() -> None:
    with pytest.raises(ValueError, match=r"recipe.mix_prob must be in \[0, 1\], got 2.0; recipe.ema_decay"):
        RecipeSettings(mix_prob=2.0, ema_decay=1.0)
    assert not RecipeSettings().mixes and RecipeSettings(cutmix_alpha=1.0).mixes


def test_randaugment_and_erasing_are_the_same_on_every_frame() -> None:
    t = train_transform(32, 32, (0.5, 1.0), hflip=False, randaugment=(3, 15), random_erasing=1.0)
    clip = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8).expand(6, 3, 32, 32)
    outs = [t(clip) for _ in range(4)]
    for out in outs:
        assert out.shape == (6, 3, 32, 32)
        assert torch.equal(out, out[:1].expand_as(out))  # one draw per clip
        assert out.dtype == torch.uint8
        erased = (out == torch.tensor(MEAN_PIXEL, dtype=torch.uint8).view(1, 3, 1, 1)).all(0).all(0)
        assert erased.any()  # an erased box (the mean pixel) in every frame
        assert clips_to_device(out, torch.device("cpu"))[:, :, erased].abs().max() < 0.01  # ~0 once normalized
    assert not torch.equal(outs[0], outs[1])  # but a new draw per clip


def test_ema_warms_up_then_follows_decay() -> None:
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    ema = WeightEMA(model, decay=0.5)
    expected = 0.0
    for n in range(4):  # AveragedModel copies on its first update, then averages
        with torch.no_grad():
            model.weight.fill_(float(n + 1))
        ema.update(model)
        d = min(0.5, (1 + n) / (10 + n)) if n else 0.0  # after n updates
        expected = expected * d + (n + 1) * (1 - d)
        assert float(ema.module.weight[0, 0]) == pytest.approx(expected)
    assert ema.num_updates == 4 and set(ema.state_dict()) == {"weight"}


RECIPE = dict(recipe="modern", trainer__max_epochs=2, trainer__checkpoint_every_n_steps=2,
              recipe__ema_decay=0.9)


@pytest.fixture(scope="module")
def recipe_run(run_overrides, compose_cfg, tmp_path_factory) -> tuple[list[str], Path, dict]:
    overrides = run_overrides(**RECIPE)
    out = tmp_path_factory.mktemp("recipe")
    return overrides, out, run.train(compose_cfg(overrides), out)


def test_recipe_run_validates_and_ships_the_ema(recipe_run, metrics_rows) -> None:
    _, out, results = recipe_run
    assert results["steps"] == 8
    assert {"val_top1", "val_ema_top1", "val_ema_loss"} <= set(results)
    val_rows = [r for r in metrics_rows(out) if "val_ema_top1" in r]
    assert [r["step"] for r in val_rows] == [4, 8]
    assert results["best_val_top1"] == max(r["val_ema_top1"] for r in val_rows)  # best.ckpt: the EMA's
    blob = ckpt.load(out / "checkpoints" / "last.ckpt")
    assert blob["ema_updates"] == 8 and blob["ema_model"].keys() == blob["model"].keys()
    assert any(not torch.equal(blob["ema_model"][k], blob["model"][k]) for k in blob["model"])


def test_recipe_run_resumes_exactly(recipe_run, compose_cfg, metrics_rows, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """MixUp/CutMix draw from the global RNG and the EMA is state: both must resume exactly."""
    overrides, out_a, results_a = recipe_run
    real_step = Trainer._optimizer_step

    def crash(self):
        if self.state.step == 5:
            raise RuntimeError("simulated crash")
        return real_step(self)

    monkeypatch.setattr(Trainer, "_optimizer_step", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run.train(compose_cfg(overrides), tmp_path)
    monkeypatch.setattr(Trainer, "_optimizer_step", real_step)
    with caplog.at_level(logging.INFO, logger="videotrain.engine.checkpoints.run"):  # resume
        results_b = run.train(compose_cfg(overrides), tmp_path)
    assert "at step 4" in caplog.text
    a, b = (ckpt.load(d / "checkpoints" / "last.ckpt") for d in (out_a, tmp_path))
    for key in a["ema_model"]:
        assert torch.allclose(a["ema_model"][key].float(), b["ema_model"][key].float(), atol=1e-6), key
    assert results_b["val_ema_top1"] == results_a["val_ema_top1"]


DROP_PATH = ["model/backbone=timm", "model.backbone.name=vit_tiny_patch16_224", "data.crop_size=32",
             "model.backbone.drop_path_rate=0.5", "+model.backbone.kwargs={depth:2,embed_dim:32,num_heads:2}"]


def _step(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = builder.build_model(cfg, 4).train()
    torch.manual_seed(1)
    out = model(torch.randn(2, 3, 3, 32, 32))
    out.sum().backward()
    return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_drop_path_replays_its_masks_under_block_checkpointing(compose_cfg) -> None:
    out_e2e, grad_e2e = _step(compose_cfg(DROP_PATH))
    out_ckpt, grad_ckpt = _step(compose_cfg([*DROP_PATH, "memory=recompute"]))
    assert not torch.equal(out_e2e, _step(compose_cfg([*DROP_PATH, "model.backbone.drop_path_rate=0"]))[0])
    assert torch.equal(out_ckpt, out_e2e) and torch.allclose(grad_ckpt, grad_e2e, atol=1e-6)
    with pytest.raises(ValueError, match="memory.policy=optimal does not support drop-path yet"):
        builder.build_model(compose_cfg([*DROP_PATH, "memory=recompute", "memory.policy=optimal"]), 4)
