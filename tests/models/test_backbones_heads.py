"""Backbones x heads: forward shapes, gradients to every parameter, positions, bf16 autocast."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from videotrain.engine.precision import Precision
from videotrain.memory.base import FrameFeatures, MemoryStrategy, encode_all_frames
from videotrain.memory.e2e import EndToEnd
from videotrain.models.backbones import FrameBackbone, resnet, vit
from videotrain.models.heads import LSTMHead, MeanHead, TConvHead, TransformerHead
from videotrain.models.video import VideoClassifier

K = 4  # classes
CPU = torch.device("cpu")

BACKBONES: dict[str, Callable[[], FrameBackbone]] = {
    "resnet10": lambda: resnet(layers=[1, 1, 1, 1]),
    "resnet10_grid2": lambda: resnet(layers=[1, 1, 1, 1], grid=2),
    "resnet18": lambda: resnet(depth=18),
    "resnet50": lambda: resnet(depth=50),
    "vit_tiny": lambda: vit(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                            mlp_dim=64),
}
FEATURE_DIMS = {"resnet10": 512, "resnet10_grid2": 2048, "resnet18": 512, "resnet50": 2048,
                "vit_tiny": 32}
NUM_BLOCKS = {"resnet10": 4, "resnet10_grid2": 4, "resnet18": 8, "resnet50": 16, "vit_tiny": 2}

HEADS: dict[str, Callable[[int], nn.Module]] = {
    "mean": lambda d: MeanHead(d, K),
    "tconv": lambda d: TConvHead(d, K, hidden_dim=16),
    "transformer": lambda d: TransformerHead(d, K, d_model=16, num_layers=1, num_heads=2, max_frames=8),
    "lstm": lambda d: LSTMHead(d, K, hidden_dim=8),
}
# the big torchvision backbones get the smallest clip that still trains BatchNorm
CLIP_SHAPE = {"resnet18": (1, 2), "resnet50": (1, 2)}  # (B, T); default (2, 3)


@pytest.fixture(scope="module")
def backbone_cache() -> dict[str, FrameBackbone]:
    """One instance per backbone for the module (gradients are cleared per test)."""
    return {}


def _backbone(cache: dict[str, FrameBackbone], name: str) -> FrameBackbone:
    if name not in cache:
        torch.manual_seed(0)
        cache[name] = BACKBONES[name]()
    bb = cache[name]
    bb.zero_grad(set_to_none=True)
    bb.train()
    return bb


@pytest.mark.parametrize("head_name", list(HEADS))
@pytest.mark.parametrize("backbone_name", ["resnet10", "resnet18", "resnet50", "vit_tiny"])
def test_forward_backward_every_pair(backbone_cache, backbone_name: str, head_name: str) -> None:
    bb = _backbone(backbone_cache, backbone_name)
    torch.manual_seed(1)
    model = VideoClassifier(bb, HEADS[head_name](bb.feature_dim))
    b, t = CLIP_SHAPE.get(backbone_name, (2, 3))
    video = torch.randn(b, t, 3, 32, 32)
    logits = model(video)
    assert logits.shape == (b, K)
    F.cross_entropy(logits, torch.arange(b) % K).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    nonfinite = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    assert not missing, f"no gradient reached {missing[:5]}"
    assert not nonfinite, f"non-finite gradients in {nonfinite[:5]}"
    # the backbone really learns through this head (not all-zero gradients)
    assert sum(float(p.grad.abs().sum()) for p in bb.parameters()) > 0


@pytest.mark.parametrize("name", list(BACKBONES))
def test_backbone_contract(backbone_cache, name: str) -> None:
    bb = _backbone(backbone_cache, name)
    assert bb.feature_dim == FEATURE_DIMS[name]
    assert len(bb.blocks()) == NUM_BLOCKS[name]
    assert all(isinstance(block, nn.Module) for block in bb.blocks())
    bb.eval()
    with torch.no_grad():
        assert bb(torch.randn(2, 3, 32, 32)).shape == (2, FEATURE_DIMS[name])


def test_backbone_argument_errors() -> None:
    # (model.pretrained errors are covered in test_pretrained.py)
    with pytest.raises(ValueError, match="model.backbone.layers"):
        resnet(layers=[1, 1, 1])
    with pytest.raises(ValueError, match="model.backbone.depth"):
        resnet(depth=20)


# ------------------------------------------------------------------- heads and positions


@pytest.mark.parametrize("head_name", list(HEADS))
def test_heads_accept_a_subset_of_positions(head_name: str) -> None:
    torch.manual_seed(0)
    head = HEADS[head_name](12).eval()
    feats = torch.randn(2, 3, 12)
    positions = torch.tensor([[0, 3, 5], [1, 2, 7]])  # T' = 3 frames of a T = 8 clip
    out = head(feats, positions)
    assert out.shape == (2, K) and out.isfinite().all()


def test_transformer_uses_positions_and_checks_range() -> None:
    torch.manual_seed(0)
    head = HEADS["transformer"](12).eval()
    feats = torch.randn(1, 3, 12)
    a = head(feats, torch.tensor([[0, 3, 5]]))
    b = head(feats, torch.tensor([[0, 1, 2]]))
    assert not torch.allclose(a, b)  # the same features at other times mean something else
    model = VideoClassifier(BACKBONES["vit_tiny"](), HEADS["transformer"](FEATURE_DIMS["vit_tiny"]))
    # the clip length bounds every position the strategies hand the head
    with pytest.raises(ValueError, match=r"clip of 9 frames has frame positions up to 8, but "
                                         r"model.head.max_frames=8"):
        model(torch.randn(1, 9, 3, 32, 32))


def test_lstm_orders_frames_by_position() -> None:
    torch.manual_seed(0)
    head = HEADS["lstm"](12).eval()
    feats = torch.randn(1, 3, 12)
    pos = torch.tensor([[0, 3, 5]])
    perm = torch.tensor([2, 0, 1])
    shuffled = head(feats[:, perm], pos[:, perm])
    torch.testing.assert_close(shuffled, head(feats, pos))
    assert not torch.allclose(head(feats[:, perm], pos), head(feats, pos))  # order matters


def test_mean_head_is_order_blind() -> None:
    torch.manual_seed(0)
    head = HEADS["mean"](12).eval()
    feats = torch.randn(1, 3, 12)
    pos = torch.tensor([[0, 1, 2]])
    torch.testing.assert_close(head(feats.flip(1), pos), head(feats, pos))


# ------------------------------------------------------------------- classifier and strategy


class _HalfFrames(EndToEnd):
    """A strategy that hands the head every other frame, like frame dropout would."""

    name = "half"

    def encode(self, backbone, video):
        out = encode_all_frames(backbone, video[:, ::2])
        return FrameFeatures(out.features, out.positions * 2)


def test_classifier_uses_strategy_only_in_training() -> None:
    torch.manual_seed(0)
    bb = BACKBONES["vit_tiny"]()
    seen = []
    head = MeanHead(bb.feature_dim, K)
    head.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
    model = VideoClassifier(bb, head, _HalfFrames())
    assert isinstance(model.strategy, MemoryStrategy)
    video = torch.randn(2, 6, 3, 32, 32)
    model.train()
    model(video)
    assert seen[-1].tolist() == [[0, 2, 4]] * 2
    with torch.no_grad():  # no autograd: every frame, whatever the strategy
        model(video)
    assert seen[-1].tolist() == [list(range(6))] * 2
    model.eval()
    model(video)
    assert seen[-1].tolist() == [list(range(6))] * 2


def test_classifier_default_strategy_and_input_check() -> None:
    model = VideoClassifier(BACKBONES["vit_tiny"](), MeanHead(32, K))
    assert model.strategy.name == "e2e" and model.strategy.describe() == {"strategy": "e2e"}
    assert model.strategy.state_dict() == {}
    with pytest.raises(ValueError, match=r"expected video \(B, T, C, H, W\)"):
        model(torch.randn(2, 3, 32, 32))
    with pytest.raises(TypeError, match=r"got torch.uint8: .*\.clips_to_device first"):
        model(torch.zeros(2, 4, 3, 32, 32, dtype=torch.uint8))  # a loader's batch, not normalized


# ------------------------------------------------------------------- precision


def test_bf16_autocast_train_step_on_cpu() -> None:
    torch.manual_seed(0)
    bb = resnet(layers=[1, 1, 1, 1])
    model = VideoClassifier(bb, TConvHead(bb.feature_dim, K, hidden_dim=16)).train()
    reference = copy.deepcopy(model)
    video, labels = torch.randn(2, 3, 3, 32, 32), torch.tensor([1, 3])
    with torch.no_grad():  # fp32 reference on identical weights (train-mode BatchNorm both times)
        ref_logits = reference(video)
    precision = Precision("bf16", CPU)
    assert not precision.scaler.is_enabled()  # bf16 needs no loss scaling
    with precision.autocast():
        logits = model(video)
    assert logits.dtype == torch.bfloat16  # autocast really ran the layers in bf16
    loss = F.cross_entropy(logits.float(), labels)
    assert loss.isfinite()
    precision.scaler.scale(loss).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all(), name
        assert p.grad.dtype == torch.float32, name  # master weights and grads stay fp32
    scale = ref_logits.abs().max()
    torch.testing.assert_close(logits.float(), ref_logits, rtol=0.1, atol=0.05 * float(scale))


def test_precision_choices() -> None:
    assert Precision("32", CPU).autocast().__class__.__name__ == "nullcontext"
    assert Precision(32, CPU).key == "32"  # Hydra passes `trainer.precision=32` as an int
    with pytest.raises(ValueError, match="trainer.precision=16 needs CUDA"):
        Precision("16", CPU)
    with pytest.raises(ValueError, match="trainer.precision must be one of"):
        Precision("64", CPU)


def test_transformer_head_layers_start_as_torchs_clones() -> None:
    """``TransformerHead`` builds its encoder layers instead of letting ``nn.TransformerEncoder``
    deep-copy one (a deep copy reads a fake tensor's data pointer): the same parameter names and
    initial values as the clones, and the same draws from the random generator after it."""
    torch.manual_seed(3)
    head = TransformerHead(32, K, d_model=16, num_layers=3, num_heads=2, dropout=0.1, max_frames=8)
    after = torch.rand(4)
    torch.manual_seed(3)  # the same construction with torch's clones
    proj = nn.Sequential(nn.Linear(32, 16), nn.LayerNorm(16))
    pos = nn.Embedding(8, 16)
    nn.init.normal_(pos.weight, std=0.2)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True, norm_first=True)
    encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    norm, fc = nn.LayerNorm(16), nn.Linear(16, K)
    ours = head.state_dict()
    clones = {**{f"proj.{k}": v for k, v in proj.state_dict().items()}, "cls": torch.zeros(1, 1, 16),
              "pos.weight": pos.weight, **{f"encoder.{k}": v for k, v in encoder.state_dict().items()},
              **{f"norm.{k}": v for k, v in norm.state_dict().items()},
              **{f"fc.{k}": v for k, v in fc.state_dict().items()}}
    assert sorted(ours) == sorted(clones)
    for name, value in clones.items():
        assert torch.equal(ours[name], value), name
    assert torch.equal(after, torch.rand(4))
    assert head.encoder.num_layers == len(head.encoder.layers) == 3
    x, positions = torch.randn(2, 5, 32), torch.arange(5).expand(2, 5)  # (B, T', D), (B, T')
    assert head.eval()(x, positions).shape == (2, K)
