"""SBP composed with recomputation (``memory=sbp memory.recompute=POLICY``): the kept-frame
path is recomputed in backward, and nothing else changes: same logits, loss, gradients and BN buffers as
plain SBP with the same mask seed, under both BN policies; fewer saved activations.

Composed SBP computes full-batch BN by record/apply (the lockstep pass does not checkpoint), so
the plain twin runs record/apply too (``kit.RecordApply``) for a bit-exact comparison; lockstep
and record/apply agree to float rounding (``tests/memory/sbp/test_sbp_lockstep.py``)."""

from __future__ import annotations

import copy

import pytest
import torch

from videotrain.memory.sbp.strategy import StochasticBackprop
from videotrain.models.video import VideoClassifier

POLICIES = ["blocks", "sqrt", "optimal"]


def pair(kit, backbone: str, policy: str, bn_policy: str = "full_batch", keep_ratio: float = 0.5):
    bb = kit.BACKBONES[backbone]()
    head = kit.make_head(bb.feature_dim)
    plain = VideoClassifier(copy.deepcopy(bb), copy.deepcopy(head),
                            kit.RecordApply(keep_ratio, bn_policy=bn_policy, seed=3))
    composed = VideoClassifier(bb, head, StochasticBackprop(keep_ratio, bn_policy=bn_policy, seed=3,
                                                            recompute=policy))
    return plain.train(), composed.train()


@pytest.mark.parametrize("backbone", ["resnet", "vit", "timm_resnet", "timm_convnext", "timm_vit"])
@pytest.mark.parametrize("policy", POLICIES)
def test_composed_equals_plain_sbp(kit, backbone: str, policy: str) -> None:
    plain, composed = pair(kit, backbone, policy)
    x = kit.video()
    for _ in range(2):  # two steps: the masks advance identically, BN stats move once per step
        torch.manual_seed(5)
        a = kit.step(plain, x)
        torch.manual_seed(5)
        b = kit.step(composed, x)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(plain.strategy.last_keep, composed.strategy.last_keep)
        kit.assert_close_dicts(kit.grads(plain), kit.grads(composed), rtol=1e-4, atol=1e-5)
        kit.assert_close_dicts(kit.bn_buffers(plain), kit.bn_buffers(composed), rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["blocks", "sqrt"])
def test_frozen_bn_policy_is_replayed_on_recompute(kit, policy: str) -> None:
    plain, composed = pair(kit, "resnet", policy, bn_policy="frozen")
    x = kit.video()
    torch.testing.assert_close(kit.step(plain, x), kit.step(composed, x))
    kit.assert_close_dicts(kit.grads(plain), kit.grads(composed), rtol=1e-4, atol=1e-5)
    kit.assert_close_dicts(kit.bn_buffers(plain), kit.bn_buffers(composed), rtol=0, atol=0)


def test_keep_ratio_one_is_checkpointed_e2e(kit) -> None:
    plain, composed = pair(kit, "resnet", "sqrt", keep_ratio=1.0)
    x = kit.video()
    torch.testing.assert_close(kit.step(plain, x), kit.step(composed, x))
    kit.assert_close_dicts(kit.grads(plain), kit.grads(composed), rtol=1e-4, atol=1e-5)
    assert composed.strategy.recompute.last_report["input_shape"][0] == kit.B * kit.T


@pytest.mark.parametrize("policy", POLICIES)
def test_composed_saves_less_than_plain_sbp(kit, policy: str) -> None:
    plain, composed = pair(kit, "resnet", policy)
    x = kit.video()
    composed(x)  # plan on a first step (the kept path's shape)
    got = [kit.saved_bytes(lambda m=m: m(x), m) for m in (plain, composed)]
    assert got[1] < got[0]


def test_validation_and_describe() -> None:
    with pytest.raises(ValueError, match="memory.policy"):
        StochasticBackprop(0.5, recompute="nope")
    with pytest.raises(ValueError, match="recompute=optimal"):
        StochasticBackprop(0.5, recompute="sqrt", recompute_budget_frac=0.5)
    assert StochasticBackprop(0.5, recompute="sqrt").describe()["recompute"] == "sqrt"
    assert StochasticBackprop(0.5).describe()["recompute"] is None
