"""Frame dropout: kept frames only, true positions, exact e2e at r=1, nothing computed for drops."""

from __future__ import annotations

import copy

import pytest
import torch

from videotrain.memory import FrameDropout, encode_all_frames
from videotrain.memory.frame_dropout import gather_frames
from videotrain.memory.sampling import keep_mask

BACKBONES = ["resnet", "vit", "timm_resnet", "timm_convnext", "timm_vit"]


def fd(**kw) -> FrameDropout:
    """The random sampler unless ``kw`` names one (the default is ``uniform``, as in the config)."""
    return FrameDropout(**{"keep_ratio": 0.5, "sampler": "random", "seed": 0, "rank": 0, **kw})


@pytest.mark.parametrize("backbone", BACKBONES)
def test_keep_ratio_one_reproduces_e2e_exactly(kit, backbone: str) -> None:
    ref, model = kit.model_pair(backbone, fd(keep_ratio=1.0))
    x = kit.video()
    assert torch.equal(kit.step(ref, x), kit.step(model, x))
    kit.assert_close_dicts(kit.grads(ref), kit.grads(model), rtol=0, atol=0)
    kit.assert_close_dicts(kit.bn_buffers(ref), kit.bn_buffers(model), rtol=0, atol=0)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("keep_ratio", [0.3, 0.75])
def test_kept_frames_only_with_true_positions(kit, backbone: str, keep_ratio: float) -> None:
    strategy = fd(keep_ratio=keep_ratio, sampler="uniform_jitter")
    bb = kit.BACKBONES[backbone]().train()
    plain = copy.deepcopy(bb)
    seen: list[int] = []
    bb.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    x = kit.video(requires_grad=True)
    out = strategy.encode(bb, x)
    n = round(keep_ratio * kit.T)
    assert seen == [kit.B * n], "one backbone pass over the kept frames, nothing else"
    assert out.features.shape == (kit.B, n, bb.feature_dim)
    assert torch.equal(out.positions, strategy.last_keep)
    # features are exactly the backbone on the kept frames alone (same BN batch)
    ref = plain(gather_frames(x.detach(), out.positions).flatten(0, 1)).view(kit.B, n, -1)
    assert torch.equal(out.features.detach(), ref)
    kit.assert_close_dicts(kit.bn_buffers(bb), kit.bn_buffers(plain), rtol=0, atol=0)

    (out.features * torch.randn(out.features.shape)).sum().backward()  # LayerNorm: not .sum()
    per_frame = x.grad.abs().flatten(2).sum(2)  # (B, T)
    mask = keep_mask(out.positions, kit.T)
    assert bool((per_frame[~mask] == 0).all()) and bool((per_frame[mask] > 0).all())


def test_training_step_through_video_classifier(kit) -> None:
    _, model = kit.model_pair("resnet", fd(), head="tconv")
    kit.step(model, kit.video())
    assert all(p.grad is not None for p in model.parameters())
    assert int(model.backbone.net.bn1.num_batches_tracked) == 1


def test_eval_and_no_grad_use_all_frames(kit) -> None:
    strategy = fd()
    bb = kit.tiny_resnet()
    x = kit.video()
    with torch.no_grad():
        out = strategy.encode(bb.train(), x)
        assert out.features.shape[1] == kit.T
        assert torch.equal(strategy.encode(bb.eval(), x).features, encode_all_frames(bb, x).features)
    assert strategy.sampler.draws == 0


def test_saved_activation_bytes_scale_with_keep_ratio(kit) -> None:
    x = kit.video()
    sizes = {}
    for r in (0.25, 0.5, 0.75, 1.0):
        bb = kit.tiny_resnet().train()
        sizes[r] = kit.saved_bytes(lambda bb=bb, r=r: fd(keep_ratio=r).encode(bb, x), exclude=bb)
    for r in (0.25, 0.5, 0.75):
        assert abs(sizes[r] / sizes[1.0] - r) <= 0.1 * r, sizes


def test_state_dict_round_trip_and_describe(kit) -> None:
    bb = kit.tiny_vit().train()
    a = fd(seed=3)
    a.encode(bb, kit.video(0))
    state = copy.deepcopy(a.state_dict())
    expected = a.encode(bb, kit.video(1)).positions
    b = fd(seed=99)
    b.load_state_dict(state)
    assert torch.equal(b.encode(bb, kit.video(1)).positions, expected)
    assert not torch.equal(fd(seed=3, rank=1).encode(bb, kit.video(0)).positions, fd(seed=3).encode(bb, kit.video(0)).positions)
    assert a.describe() == {"strategy": "frame_dropout", "keep_ratio": 0.5, "sampler": "random", "seed": 3}
