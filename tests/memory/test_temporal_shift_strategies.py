"""Frame dropout, ``memory=auto`` and the fake-tensor step simulation with TSM's temporal shift.
(SBP: tests/memory/sbp/test_sbp_temporal_shift.py; recompute: tests/memory/recompute/.)"""

from __future__ import annotations

import copy

import torch
from hydra.utils import instantiate

from videotrain.memory.auto.strategy import AutoStrategy, memory_node
from videotrain.memory.base import encode_all_frames
from videotrain.memory.estimate import StepMemory, simulate_step
from videotrain.memory.frame_dropout import FrameDropout, gather_frames
from videotrain.models.backbones import resnet
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier

CPU = torch.device("cpu")


def _model(strategy=None) -> VideoClassifier:
    torch.manual_seed(0)
    bb = resnet(layers=[1, 1, 1, 1], temporal_shift=0.25)
    return VideoClassifier(bb, TConvHead(bb.feature_dim, 4, hidden_dim=16), strategy)


def test_frame_dropout_shifts_over_the_kept_frames_in_time_order(kit) -> None:
    strategy = FrameDropout(keep_ratio=0.5, seed=0, rank=0)
    model = _model(strategy).train()
    plain = copy.deepcopy(model.backbone)
    x = kit.video()
    feats = strategy.encode(model.backbone, x)
    idx = strategy.last_keep  # (B, 4), sorted
    assert torch.equal(feats.positions, idx) and bool((idx.diff(dim=1) > 0).all())
    # the same as the backbone over the kept frames taken as a clip of their own
    want = encode_all_frames(plain, gather_frames(x, idx)).features
    torch.testing.assert_close(feats.features, want, rtol=1e-5, atol=1e-5)
    kit.step(model, x)
    assert all(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in model.parameters())


def test_auto_plans_frame_sbp_without_recompute_and_trains(kit) -> None:
    """On a shift backbone memory=auto considers frame SBP (the lockstep code), estimated below
    e2e and falling with the keep ratio, but not SBP + recompute (record/apply cannot mix
    frames). Estimated on fake tensors in this process, for a budget e2e does not fit."""
    shape = (2, 4, 3, 96, 96)  # (B, T, C, H, W): activations, not the optimizer step, set the peak

    def estimate(node: dict) -> StepMemory:
        return simulate_step(lambda: _model(instantiate(node)), lambda m: torch.optim.AdamW(m.parameters()),
                             shape, 4, grad_clip=1.0)

    strategy = AutoStrategy(budget_frac=0.7, seed=0, rank=0)
    model = _model(strategy).train()
    report = strategy.plan(estimate, shape[1], CPU)
    recomputed = [c for c in strategy.candidates if c.kind == "sbp_recompute"]
    assert recomputed and all("temporal shift" in c.skip for c in recomputed)
    sbp = sorted((c for c in strategy.candidates if c.kind == "sbp" and c.params["bn_policy"] == "full_batch"),
                 key=lambda c: c.keep_ratio)
    assert sbp and not any(c.skip for c in sbp)
    peaks = [estimate(memory_node(c)).train_peak for c in sbp]  # all of them (the walk bisects)
    assert peaks == sorted(peaks) and peaks[-1] < estimate(memory_node(strategy.candidates[0])).train_peak
    assert report["chosen"] != "e2e" and report["need_mb"] <= report["budget_mb"]
    kit.step(model, kit.video())


def test_fake_step_simulation_with_the_shift_and_auto_eval_chunks() -> None:
    mem = simulate_step(lambda: _model(FrameDropout(0.5)), lambda m: torch.optim.AdamW(m.parameters()),
                        (2, 6, 3, 32, 32), 4, grad_clip=1.0, eval_video_shape=(4, 6, 3, 32, 32),
                        eval_frame_chunk="auto")
    assert mem.fwd_bwd_peak > mem.held and mem.eval_peak is not None
