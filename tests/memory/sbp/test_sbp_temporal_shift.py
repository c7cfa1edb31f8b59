"""SBP with TSM's temporal shift, through the lockstep code: forward equal to e2e's, gradients
equal to e2e's with the dropped frames' activations detached at every shift input, BN input and
at the backbone's output. What cannot run there (record/apply: recomputation, an untraceable
backbone) is refused when the model is built."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from videotrain.memory import StochasticBackprop
from videotrain.memory.sampling import keep_mask
from videotrain.models.temporal_shift import TemporalShift


def sbp(**kw) -> StochasticBackprop:
    return StochasticBackprop(**{"keep_ratio": 0.5, "seed": 0, "rank": 0, **kw})


def test_the_lockstep_code_is_built_when_the_model_is(kit) -> None:
    """A backbone whose frames meet needs the lockstep code: ``prepare`` builds it, so a backbone
    that cannot have it fails at once (below), not at the first step."""
    shifted = sbp()
    kit.shifted_pair(shifted)
    assert isinstance(shifted._traced[1], fx.GraphModule) and "module_parts" in shifted._traced[1].code
    plain = sbp()
    kit.model_pair("resnet", plain)
    assert plain._traced is None  # a per-frame backbone: built at the first step


def test_an_untraceable_shifted_backbone_is_refused(kit, monkeypatch) -> None:
    from videotrain.memory.sbp import strategy as sbp_strategy

    monkeypatch.setattr(sbp_strategy, "lockstep_graph", lambda *_a, **_k: None)
    with pytest.raises(ValueError, match="needs the lockstep code.*temporal_shift=0"):
        kit.shifted_pair(sbp())


def test_recompute_with_the_shift_is_refused(kit) -> None:
    with pytest.raises(ValueError, match="memory.recompute .*temporal_shift"):
        kit.shifted_pair(sbp(recompute="blocks"))


def _detached_reference(kit, ref: nn.Module, keep: torch.Tensor, x: torch.Tensor,
                        policy: str) -> torch.Tensor:
    """e2e with the dropped frames' activations held constant at every layer: their rows
    detached at every shift input, every BN input (full-batch BN) and at the backbone's
    output, by plain autograd. Returns the logits after a backward of the loss."""
    rows = keep_mask(keep, kit.T).flatten()  # (N,)

    def pre(_m: nn.Module, args: tuple) -> tuple:
        return (kit.row_detach(args[0], rows),)

    hooks = [m.register_forward_pre_hook(pre) for m in ref.backbone.modules()
             if isinstance(m, TemporalShift)
             or (policy == "full_batch" and isinstance(m, nn.modules.batchnorm._BatchNorm))]
    hooks.append(ref.backbone.register_forward_hook(lambda _m, _a, out: kit.row_detach(out, rows)))
    if policy == "frozen":
        for m in ref.backbone.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    logits = kit.step(ref, x)
    for h in hooks:
        h.remove()
    return logits


@pytest.mark.parametrize("policy", ["full_batch", "frozen"])
@pytest.mark.parametrize("keep_ratio", [0.375, 0.75])
def test_frame_sbp_gradients_are_e2e_with_dropped_frames_constant(kit, policy: str,
                                                                  keep_ratio: float) -> None:
    """The stated gradient, against a reference computed with plain autograd; the dropped
    frames' input gradient is exactly zero; the gradient differs from plain e2e's (the spec has
    teeth: the shift carries gradient through dropped neighbours in e2e)."""
    strategy = sbp(keep_ratio=keep_ratio, bn_policy=policy)
    ref, model = kit.shifted_pair(strategy)
    plain = kit.shifted_pair(sbp())[0]
    x = kit.video(requires_grad=True)
    logits = kit.step(model, x)
    keep = strategy.last_keep  # (B, n)
    ref_logits = _detached_reference(kit, ref, keep, x.detach(), policy)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    kit.assert_close_dicts(kit.grads(model), kit.grads(ref), rtol=1e-4, atol=1e-6)
    per_frame = x.grad.abs().flatten(2).sum(2)  # (B, T)
    mask = keep_mask(keep, kit.T)
    assert bool((per_frame[~mask] == 0).all()) and bool((per_frame[mask] > 0).all())
    if policy == "full_batch":
        # e2e: the same forward, another backbone gradient
        torch.testing.assert_close(logits, kit.step(plain, x.detach()), rtol=1e-5, atol=1e-5)
        ours, e2e = kit.grads(model.backbone), kit.grads(plain.backbone)
        assert any(not torch.allclose(ours[n], g, atol=1e-5) for n, g in e2e.items())


def test_frame_sbp_forward_and_running_stats_equal_e2e_with_the_shift(kit) -> None:
    ref, model = kit.shifted_pair(sbp(keep_ratio=0.25))
    x = kit.video()
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    ours, theirs = kit.bn_buffers(model.backbone), kit.bn_buffers(ref.backbone)
    kit.assert_close_dicts(ours, theirs, rtol=1e-5, atol=1e-6)
    assert all(int(v) == 1 for k, v in ours.items() if k.endswith("num_batches_tracked"))


def test_frame_sbp_at_keep_one_equals_e2e_with_the_shift(kit) -> None:
    ref, model = kit.shifted_pair(sbp(keep_ratio=1.0))
    x = kit.video()
    torch.testing.assert_close(kit.step(model, x), kit.step(ref, x), rtol=0, atol=0)
    kit.assert_close_dicts(kit.grads(model), kit.grads(ref), rtol=0, atol=0)


@pytest.mark.parametrize("bn_policy", ["full_batch", "frozen"])
def test_the_default_model_stores_about_keep_ratio_of_e2e(compose_cfg, bn_policy: str) -> None:
    """SBP's memory target on the model a user gets (the shipped config: ResNet-10 with TSM's
    shift): SBP stores at most 0.55 of e2e's activations at keep 0.5 and 0.30 at 0.25."""
    from videotrain.config.build import build_model
    from videotrain.memory.base import mixes_frames
    from videotrain.metrics.saved import saved_activation_bytes

    video = torch.randn(2, 8, 3, 64, 64, generator=torch.Generator().manual_seed(0))  # (B, T, C, H, W)

    def model(*overrides: str) -> nn.Module:
        torch.manual_seed(0)
        built = build_model(compose_cfg(list(overrides)), num_classes=5).train()
        assert mixes_frames(built.backbone)  # the default model shifts
        return built

    e2e = saved_activation_bytes(model("memory=e2e"), video)
    for keep, at_most in ((0.5, 0.55), (0.25, 0.30)):
        sbp_model = model("memory=sbp", f"memory.keep_ratio={keep}", f"memory.bn_policy={bn_policy}")
        ratio = saved_activation_bytes(sbp_model, video) / e2e
        assert ratio <= at_most, f"keep {keep}: SBP stores {ratio:.2f} of e2e's activations"
