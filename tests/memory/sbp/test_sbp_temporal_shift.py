"""SBP with TSM's temporal shift: block granularity shifts every frame before splitting each
branch (so it equals e2e at keep 1, its forward equals e2e's at any keep, and its gradients are
e2e's with the dropped branches detached); frame granularity is refused."""

from __future__ import annotations

import pytest
import torch

from videotrain.memory import StochasticBackprop
from videotrain.memory.sampling import keep_mask
from videotrain.memory.sbp.blocks import branch_norms
from videotrain.memory.sbp.split import ScaleGrad


def sbp(**kw) -> StochasticBackprop:
    return StochasticBackprop(**{"keep_ratio": 0.5, "granularity": "block", "seed": 0, "rank": 0, **kw})


@pytest.mark.parametrize("kw", [{}, {"checkpoint": "blocks"}], ids=["frame", "frame+checkpoint"])
def test_frame_granularity_is_refused_naming_the_key(kit, kw) -> None:
    with pytest.raises(ValueError, match="memory.granularity=frame .*memory.granularity=block"):
        kit.shifted_pair(sbp(granularity="frame", **kw))


def test_auto_granularity_is_block_with_the_shift_and_frame_without(kit) -> None:
    """``granularity=auto`` (the config default) follows the backbone: the default resnet10 has
    the shift, so ``memory=sbp`` alone must not be refused there, nor change a per-frame one."""
    shifted = sbp(granularity="auto")
    kit.shifted_pair(shifted)
    assert shifted.granularity == "block" and shifted.describe()["granularity"] == "block"
    plain = sbp(granularity="auto")
    kit.model_pair("resnet", plain)
    assert plain.granularity == "frame"


def test_auto_granularity_with_checkpoint_is_refused_with_the_shift(kit) -> None:
    with pytest.raises(ValueError, match="memory.checkpoint .*temporal_shift"):
        kit.shifted_pair(sbp(granularity="auto", checkpoint="blocks"))


def test_block_sbp_at_keep_one_equals_e2e_with_the_shift(kit) -> None:
    ref, model = kit.shifted_pair(sbp(keep_ratio=1.0, blocks=1.0))
    x = kit.video()
    torch.testing.assert_close(kit.step(model, x), kit.step(ref, x), rtol=0, atol=0)
    kit.assert_close_dicts(kit.grads(model), kit.grads(ref), rtol=0, atol=0)


def test_block_sbp_forward_equals_e2e_and_every_parameter_gets_a_gradient(kit) -> None:
    """The forward covers every frame (shifted from all of them), so it is e2e's at any keep."""
    ref, model = kit.shifted_pair(sbp(keep_ratio=0.5, blocks=1.0))
    x = kit.video()
    torch.testing.assert_close(kit.step(model, x), kit.step(ref, x), rtol=1e-5, atol=1e-5)
    got = kit.grads(model)
    assert got.keys() == {n for n, _ in model.named_parameters()}
    assert all(torch.count_nonzero(g) > 0 for g in got.values())


@pytest.mark.parametrize("grad_scale", ["none", "auto"])
def test_block_sbp_gradients_are_e2e_with_dropped_branches_detached(kit, grad_scale: str) -> None:
    """The reference: e2e with the shift, where in every block the dropped frames' branch output
    (and their rows at the branch's BN inputs) are constants. The kept frames' branch gradient
    flows through the shift into their neighbours' block inputs, as in e2e. The default
    ``grad_scale=auto`` (block granularity: ``inverse_keep``) multiplies it by T/n = 8/3."""
    strategy = sbp(keep_ratio=0.375, blocks=1.0, grad_scale=grad_scale)
    ref, model = kit.shifted_pair(strategy)
    scale = 8 / 3 if grad_scale == "auto" else 1.0

    def branch_out(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return ScaleGrad.apply(kit.row_detach(out, rows), scale).clone()  # (in-place adds follow)

    x = kit.video()
    logits = kit.step(model, x)
    hooks = []
    for i, keep in strategy.last_block_keep.items():
        rows = keep_mask(keep, kit.T).flatten()  # (N,)
        blk = ref.backbone.blocks()[i]
        hooks.append(blk.bn2.register_forward_hook(lambda _m, _a, out, rows=rows: branch_out(out, rows)))
        hooks += [bn.register_forward_pre_hook(lambda _m, a, rows=rows: (kit.row_detach(a[0], rows),))
                  for bn in branch_norms(blk)]
    ref_logits = kit.step(ref, x)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    kit.assert_close_dicts(kit.grads(model), kit.grads(ref), rtol=1e-4, atol=1e-6 if scale == 1.0 else 1e-5)

