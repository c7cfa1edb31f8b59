"""``memory=recompute`` with TSM's temporal shift: the recompute in backward shifts with the clip
length of its forward, so gradients, logits and BN statistics equal e2e's for every policy."""

from __future__ import annotations

import pytest
import torch

from videotrain.memory.recompute import Recompute
from videotrain.memory.recompute.graph import trace
from videotrain.models.backbones import resnet
from videotrain.models.video import VideoClassifier


def step(model: VideoClassifier, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # (B, K)
    torch.nn.functional.cross_entropy(logits, torch.arange(x.shape[0]) % logits.shape[1]).backward()
    return logits.detach()


@pytest.mark.parametrize("policy", ["blocks", "sqrt", "optimal"])
def test_checkpoint_with_the_shift_equals_e2e(kit, policy: str) -> None:
    ref, model = kit.shifted_pair(Recompute(policy))
    # the second shape has the same number of frames (16) in clips of 4: a plan cached for
    # (16, C, H, W) must shift over 4 frames now, in its forward and in its recompute
    for shape in ((2, 8), (4, 4)):
        x = torch.randn(*shape, 3, kit.PX, kit.PX, generator=torch.Generator().manual_seed(sum(shape)))
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        torch.testing.assert_close(step(model, x), step(ref, x), rtol=1e-5, atol=1e-5)
        kit.assert_close_dicts(kit.grads(model), kit.grads(ref), rtol=1e-4, atol=1e-6)
        kit.assert_close_dicts(kit.bn_buffers(model), kit.bn_buffers(ref), rtol=1e-5, atol=1e-6)
    if policy != "blocks":
        assert model.strategy.last_report["segments"], "a plan was made"


def test_the_traced_graph_keeps_the_shift_as_one_node() -> None:
    """A leaf ``call_module`` reads the clip length when the graph runs (not a constant of the
    trace), and the planner sees the shifted tensor as an activation."""
    torch.manual_seed(0)
    bb = resnet(layers=[1, 1, 1, 1], temporal_shift=0.125).train()
    bb.set_clip_length(4)
    gm, g, index = trace(bb, torch.randn(8, 3, 32, 32))
    shifts = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("temporal_shift")]
    assert len(shifts) == len(bb.blocks()) and all(n.name in index for n in shifts)


def test_the_plan_viewer_plans_a_shifted_backbone() -> None:
    """``python -m videotrain.plan`` traces the backbone without a training forward first: it
    sets the clip length itself."""
    from videotrain.config.build import compose_cfg
    from videotrain.plan import make_report

    cfg = compose_cfg(["model.backbone.temporal_shift=0.125", "memory=recompute",
                       "memory.policy=sqrt", "data.batch_size=1", "data.num_frames=4",
                       "data.crop_size=32", "data.num_classes=4"])
    report = make_report(cfg)
    assert report["input_shape"] == [4, 3, 32, 32] and len(report["segments"]) > 1
