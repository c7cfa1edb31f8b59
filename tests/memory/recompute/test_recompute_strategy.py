"""memory=recompute: every policy reproduces e2e (loss, gradients, BN running stats, dropout)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from videotrain.memory.recompute.execute import RecomputedForward, recompute_call
from videotrain.memory.recompute.planner import InfeasibleBudget
from videotrain.memory.recompute.strategy import Recompute
from videotrain.models.backbones import FrameBackbone, resnet
from videotrain.models.heads import MeanHead
from videotrain.models.video import VideoClassifier

POLICIES = [("blocks", {}), ("sqrt", {}), ("optimal", {}), ("optimal", {"budget_frac": 0.85})]


class SkipNet(FrameBackbone):
    """A tiny U-Net-like backbone with long skips, BN, in-place ReLU and dropout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)

        def conv(i: int, o: int, stride: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1), nn.BatchNorm2d(o), nn.ReLU(inplace=True))

        self.down1, self.down2, self.mid = conv(3, 8), conv(8, 16, 2), conv(16, 16)
        self.up = nn.Upsample(scale_factor=2)
        self.fuse1 = conv(16 + 8, 8)
        self.fuse2 = conv(8 + 8 + 3, 8)
        self.drop = nn.Dropout(0.2)
        self.feature_dim = 8

    def blocks(self) -> list[nn.Module]:
        return [self.down1, self.down2, self.mid, self.fuse1, self.fuse2]

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, 8)
        d1 = self.down1(frames)  # (N, 8, H, W)
        d2 = self.down2(d1)  # (N, 16, H/2, W/2)
        m = self.mid(d2) + d2
        f1 = self.fuse1(torch.cat([self.up(m), d1], 1))  # (N, 8, H, W)
        f2 = self.fuse2(torch.cat([f1, d1, frames], 1))
        return self.drop(f2).mean((2, 3))


def run_pair(kit, backbone: str, strategy: Recompute) -> tuple[VideoClassifier, VideoClassifier, list]:
    """(e2e, checkpointed) after one step each with the same RNG seed, and both losses."""
    if backbone == "skip":
        bb = SkipNet()
        hd = kit.make_head(bb.feature_dim)
        ref, model = VideoClassifier(copy.deepcopy(bb), copy.deepcopy(hd)).train(), VideoClassifier(bb, hd, strategy)
    else:
        ref, model = kit.model_pair(backbone, strategy)
    x = kit.video(3)
    losses = []
    for m in (ref, model.train()):
        torch.manual_seed(7)
        loss = nn.functional.cross_entropy(m(x), kit.labels())
        loss.backward()
        losses.append(loss.detach())
    return ref, model, losses


def assert_like_e2e(kit, ref: nn.Module, model: nn.Module, losses: list) -> None:
    torch.testing.assert_close(losses[0], losses[1])
    kit.assert_close_dicts(kit.grads(ref), kit.grads(model), rtol=1e-4, atol=1e-5)
    kit.assert_close_dicts(kit.bn_buffers(ref), kit.bn_buffers(model), rtol=0, atol=0)


@pytest.mark.parametrize("backbone", ["resnet", "vit", "skip", "timm_resnet", "timm_convnext", "timm_vit"])
@pytest.mark.parametrize(("policy", "options"), POLICIES)
def test_every_policy_matches_e2e(kit, backbone: str, policy: str, options: dict) -> None:
    ref, model, losses = run_pair(kit, backbone, Recompute(policy, **options))
    assert_like_e2e(kit, ref, model, losses)
    if policy == "optimal":  # (sqrt may cost more than e2e on models this small, and does here)
        report = model.strategy.last_report
        assert report["estimated_peak_bytes"] <= options.get("budget_frac", 1.0) * report["e2e_peak_bytes"]


def test_bn_stats_once_and_plain_checkpoint_would_update_twice() -> None:
    """The guard matters: plain torch.utils.checkpoint recompute moves running stats again."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(4, 3, 8, 8)
    checkpoint(block, x.requires_grad_(), use_reentrant=False).sum().backward()
    assert int(block[1].num_batches_tracked) == 2
    block[1].reset_running_stats()
    recompute_call(block, [block[1]], x).sum().backward()
    assert int(block[1].num_batches_tracked) == 1


@pytest.mark.parametrize("depth", [18, 50])
def test_resnet_policies_match_e2e(depth: int) -> None:
    torch.manual_seed(0)
    bb = resnet(depth)
    x, y = torch.randn(1, 2, 3, 32, 32), torch.tensor([1])  # 2 frames of 32 px
    ref = VideoClassifier(copy.deepcopy(bb), MeanHead(bb.feature_dim, 3)).train()
    for policy, options in POLICIES:
        model = VideoClassifier(copy.deepcopy(bb), copy.deepcopy(ref.head), Recompute(policy, **options)).train()
        ref.zero_grad()
        for m in (ref, model):
            nn.functional.cross_entropy(m(x), y).backward()
        for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda s, n=name: f"{n}: {s}")
        ref.load_state_dict(model.state_dict())  # both moved running stats once; compare next time too
        if policy != "blocks":  # few enough lower sets for the exact DP (parallel shortcuts only)
            assert model.strategy.last_report["exact_family"]


def test_blocks_policy_leaves_eval_and_no_grad_alone(kit) -> None:
    ref, model = kit.model_pair("resnet", Recompute("blocks"))
    assert all(isinstance(b.__dict__.get("forward"), RecomputedForward) for b in model.backbone.blocks())
    model.strategy.prepare(model.backbone)  # idempotent
    x = kit.video(1)
    with torch.no_grad():
        torch.testing.assert_close(ref.eval()(x), model.eval()(x))
    assert kit.saved_bytes(lambda: model.train()(x), model) < kit.saved_bytes(lambda: ref(x), ref)


def test_infeasible_budget_and_bad_options(kit) -> None:
    _, model = kit.model_pair("vit", Recompute("optimal", budget_mb=1e-4))
    with pytest.raises(InfeasibleBudget, match="smallest feasible budget"):
        model(kit.video())
    for bad in ({"policy": "nope"}, {"objective": "nope"}, {"budget_mb": 1, "budget_frac": 0.5}):
        with pytest.raises(ValueError):
            Recompute(**bad)


def test_memory_objective_reaches_smallest_budget(kit) -> None:
    _, model = kit.model_pair("vit", Recompute("optimal", objective="memory"))
    model(kit.video())
    report = model.strategy.last_report
    assert report["estimated_peak_bytes"] == pytest.approx(report["smallest_feasible_bytes"])


@pytest.mark.parametrize("policy", ["blocks", "optimal"])
def test_bf16_autocast_replays_exactly(kit, policy: str, device: torch.device,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Recompute replays the autocast state (and dropout RNG): gradients are bit-identical.
    On CUDA with deterministic kernels (cuDNN's, and the math attention: flash attention's
    backward accumulates with atomics), so that a difference can only come from the replay."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    ref, model = (m.to(device) for m in kit.model_pair("vit", Recompute(policy)))
    x, labels = kit.video(2).to(device), kit.labels().to(device)
    for m in (ref, model):
        torch.manual_seed(3)
        with sdpa_kernel(SDPBackend.MATH):  # the backward's recompute included
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(m(x).float(), labels)
            loss.backward()
    kit.assert_close_dicts(kit.grads(ref), kit.grads(model), rtol=0, atol=0)


def test_approximate_family_still_matches_e2e(kit) -> None:
    ref, model, losses = run_pair(kit, "skip", Recompute("optimal", lower_set_cap=3))
    assert not model.strategy.last_report["exact_family"]
    assert_like_e2e(kit, ref, model, losses)
