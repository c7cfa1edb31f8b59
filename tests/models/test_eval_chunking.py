"""Evaluation in frame chunks (``eval.frame_chunk``): the same logits as one forward, and with
``auto`` a forward that stays within the training step's peak, for every strategy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from videotrain.memory.base import encode_all_frames
from videotrain.memory.e2e import EndToEnd
from videotrain.memory.estimate import no_grad_peak
from videotrain.memory.frame_dropout import FrameDropout
from videotrain.memory.recompute import Recompute
from videotrain.memory.sbp import StochasticBackprop
from videotrain.metrics.live_bytes import LiveStorageBytes
from videotrain.models.backbones import resnet, vit
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier

BACKBONES = {
    "resnet": lambda: resnet(layers=[1, 1, 1, 1]),
    "vit": lambda: vit(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                       mlp_dim=64),
}


@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("name", list(BACKBONES))
def test_chunked_features_equal_one_forward(name: str, chunk: int) -> None:
    torch.manual_seed(0)
    backbone = BACKBONES[name]().eval()
    video = torch.randn(2, 5, 3, 32, 32)  # (B, T, C, H, W): 10 frames, chunks need not divide
    with torch.no_grad():
        whole = encode_all_frames(backbone, video)
        parts = encode_all_frames(backbone, video, chunk)
    torch.testing.assert_close(parts.features, whole.features, rtol=1e-5, atol=1e-5)
    assert torch.equal(parts.positions, whole.positions)


def test_chunk_is_ignored_with_autograd_on() -> None:
    """Training (and any forward with grad) runs the frames as one batch: chunking would not
    save stored activations, only serialise the forward."""
    backbone = BACKBONES["resnet"]()
    calls = []
    backbone.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    encode_all_frames(backbone, torch.randn(2, 3, 3, 32, 32), chunk=2)
    assert calls == [6]


def _model(strategy) -> VideoClassifier:
    torch.manual_seed(0)
    backbone = resnet(layers=[1, 1, 1, 1])
    return VideoClassifier(backbone, TConvHead(backbone.feature_dim, 4, hidden_dim=16), strategy)


def _fake_peak(backbone, frames: int) -> int:
    with FakeTensorMode(allow_non_fake_inputs=True):
        return no_grad_peak(backbone, frames, (3, 32, 32))


def test_auto_chunk_logits_equal_and_size_follows_the_budget() -> None:
    model = _model(EndToEnd()).eval()
    video = torch.randn(3, 8, 3, 32, 32)
    with torch.no_grad():
        whole = model(video)
        model.eval_frame_chunk = "auto"
        assert model.frame_chunk(video) is None  # no budget yet: one forward
        five, six = _fake_peak(model.backbone, 5), _fake_peak(model.backbone, 6)
        assert five < six
        with FakeTensorMode(allow_non_fake_inputs=True), LiveStorageBytes() as live:
            feats = torch.randn(3, 8, model.backbone.feature_dim)  # what all frames share
            model.head(feats, torch.arange(8).expand(3, 8))
            shared = live.peak
        model.eval_memory_budget = shared + (five + six) / 2
        assert model.frame_chunk(video) == 5
        torch.testing.assert_close(model(video), whole, rtol=1e-5, atol=1e-5)
        model.eval_memory_budget = 10 * six  # everything fits: one forward of all 24 frames
        assert model.frame_chunk(video) == 24
        model.eval_memory_budget = 0  # nothing fits: a frame at a time, never fewer
        assert model.frame_chunk(video) == 1
        model.eval_frame_chunk = 4  # a fixed size wins over the budget
        assert model.frame_chunk(video) == 4


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_grad_peak_counted_on_fake_tensors_is_the_real_one(dtype) -> None:
    backbone = BACKBONES["resnet"]().eval()
    for n in (1, 8, 16):
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = no_grad_peak(backbone, n, (3, 32, 32), dtype)
        real = no_grad_peak(backbone, n, (3, 32, 32), dtype)  # the same count on real tensors
        assert fake == real, (n, fake, real)


@pytest.mark.parametrize("name", list(BACKBONES))
def test_auto_chunk_inside_autocast_evaluates_on_the_real_weights(name: str,
                                                                  device: torch.device) -> None:
    """Validation in bf16 searches ``frame_chunk="auto"`` on fake tensors inside the real
    autocast region; the fake bf16 weight copies autocast cached there were then used by the
    real forward (a FakeTensor out, and every bf16 run failed at its first validation). The
    logits of the chunked bf16 forward are real and equal a plain bf16 forward's."""
    torch.manual_seed(0)
    backbone = BACKBONES[name]()
    model = VideoClassifier(backbone, TConvHead(backbone.feature_dim, 3, hidden_dim=8))
    model.to(device).eval()
    video = torch.randn(2, 6, 3, 32, 32, device=device)  # (B, T, C, H, W)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        whole = model(video)
    model.eval_frame_chunk, model.eval_memory_budget = "auto", float(2**40)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        chunked = model(video)  # the search first, then the real forward, in one region
        again = model(video)  # the search's result is reused: a plain forward
    for out in (chunked, again):
        assert type(out) is torch.Tensor and out.device.type == device.type
        torch.testing.assert_close(out, whole)


STRATEGIES = {"e2e": EndToEnd, "sbp_0.25": lambda: StochasticBackprop(0.25),
              "frame_dropout_0.25": lambda: FrameDropout(0.25),
              "checkpoint_optimal": lambda: Recompute("optimal")}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_auto_evaluation_peak_stays_within_the_training_step(name: str) -> None:
    """Counted exactly (live storages on real tensors): a training step's peak over what it
    holds, then a validation forward of a larger batch with eval.frame_chunk=auto and the
    step's peak as budget. Without chunks the validation forward is the larger one."""
    model = _model(STRATEGIES[name]())
    train_video, labels = torch.randn(2, 8, 3, 32, 32), torch.tensor([0, 1])
    val_video = torch.randn(24, 8, 3, 32, 32)  # e.g. 8 videos x 3 clips: 192 frames at once
    with LiveStorageBytes() as live:
        live.track(*model.parameters(), *model.buffers(), train_video, val_video)
        F.cross_entropy(model(train_video), labels).backward()  # plans, traces, grads
        model.zero_grad(set_to_none=False)
        live.reset_peak()
        base = live.now()
        F.cross_entropy(model(train_video), labels).backward()
        train_peak = live.peak - base
        model.eval()

        def eval_peak() -> int:
            live.reset_peak()
            start = live.now()
            with torch.no_grad():
                model(val_video)
            return live.peak - start

        unchunked = eval_peak()
        model.eval_frame_chunk, model.eval_memory_budget = "auto", float(train_peak)
        with live.paused(), torch.no_grad():  # the search allocates only fake tensors, which
            chunk = model.frame_chunk(val_video)  # counted here would read high (cached after)
        chunked = eval_peak()
    assert chunk < val_video.shape[0] * val_video.shape[1]
    assert unchunked > train_peak  # the case the chunking is for
    assert chunked <= train_peak
