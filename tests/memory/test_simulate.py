"""The step simulation on fake tensors (``videotrain.memory.estimate``): it counts what the
same steps count on real tensors, for every strategy, and its extrapolation is the stated one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from videotrain.memory.e2e import EndToEnd
from videotrain.memory.estimate import StepMemory, _no_weight_init, simulate_step
from videotrain.memory.frame_dropout import FrameDropout
from videotrain.memory.recompute import Recompute
from videotrain.memory.sbp import StochasticBackprop
from videotrain.models.backbones import resnet
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier

SHAPE = (2, 6, 3, 32, 32)  # (B, T, C, H, W)
K = 5
STRATEGIES = {
    "e2e": EndToEnd,
    "sbp": lambda: StochasticBackprop(0.5, sampler="uniform"),
    "sbp_frozen": lambda: StochasticBackprop(0.5, bn_policy="frozen"),
    "frame_dropout": lambda: FrameDropout(0.5),
    "recompute_sqrt": lambda: Recompute("sqrt"),
    "recompute_optimal": lambda: Recompute("optimal"),
    "sbp_recompute": lambda: StochasticBackprop(0.5, recompute="blocks"),
}


def _simulate(strategy: str, fake: bool, dtype: torch.dtype | None = None) -> StepMemory:
    def make_model() -> VideoClassifier:
        torch.manual_seed(0)
        backbone = resnet(layers=[1, 1, 1, 1])
        return VideoClassifier(backbone, TConvHead(backbone.feature_dim, K, hidden_dim=16),
                               STRATEGIES[strategy]())

    return simulate_step(make_model, lambda m: torch.optim.AdamW(m.parameters()), SHAPE, K,
                         autocast_dtype=dtype, grad_clip=1.0, eval_video_shape=(4, 6, 3, 32, 32),
                         fake=fake)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fake_step_counts_what_the_real_step_counts(strategy: str, dtype) -> None:
    """Every storage the step creates, on fake tensors and on real ones: the same bytes (the
    fake step runs the same ops; only the values differ, and SBP's random masks, which keep the
    same number of frames)."""
    fake, real = _simulate(strategy, True, dtype), _simulate(strategy, False, dtype)
    assert fake.held == real.held
    assert fake.fwd_bwd_peak == pytest.approx(real.fwd_bwd_peak, rel=0.01)
    assert fake.opt_peak == pytest.approx(real.opt_peak, rel=0.01)
    assert fake.eval_peak == pytest.approx(real.eval_peak, rel=0.01)


def test_held_is_parameters_gradients_adamw_state_and_batch() -> None:
    mem = _simulate("e2e", True)
    torch.manual_seed(0)
    backbone = resnet(layers=[1, 1, 1, 1])
    model = VideoClassifier(backbone, TConvHead(backbone.feature_dim, K, hidden_dim=16))
    params = [p for p in model.parameters()]
    p_bytes = sum(p.numel() * 4 for p in params)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    steps = 4 * len(params)  # AdamW's per-parameter step counter (a float32 scalar)
    batch = 4 * torch.Size(SHAPE).numel()
    labels = 8 * SHAPE[0]
    assert mem.batch == batch
    assert mem.held == 4 * p_bytes + buffers + steps + batch + labels  # weights, grads, 2 moments


@pytest.mark.parametrize("strategy", ["sbp", "frame_dropout", "recompute_sqrt", "sbp_recompute"])
def test_strategies_keep_less_than_e2e(strategy: str) -> None:
    """What a strategy controls: the forward and backward (at this tiny scale the optimizer's
    step, with its parameter-sized temporaries, sets the whole step's peak)."""
    assert _simulate(strategy, True).fwd_bwd_peak < _simulate("e2e", True).fwd_bwd_peak


def test_scaled_extrapolates_what_grows_with_frames() -> None:
    mem = StepMemory(held=100, batch=10, fwd_bwd_peak=160, opt_peak=130, eval_peak=140,
                     eval_batch=8)
    clips = mem.scaled(2.0)  # twice the clips per batch
    assert (clips.held, clips.batch, clips.fwd_bwd_peak, clips.opt_peak) == (110, 20, 230, 140)
    assert clips.eval_peak == 140 and clips.eval_batch == 8  # the validation batch is its own
    frames = mem.scaled(2.0, frames=True)  # twice the frames per clip
    assert frames.fwd_bwd_peak == 230 and frames.eval_peak == 110 + 80 and frames.eval_batch == 16
    assert mem.scaled(1.0) == mem


def test_scaled_matches_a_simulation_at_twice_the_batch() -> None:
    """The linear extrapolation against a second simulation: never below it, and within 10%.
    It errs high where backward's parameter-sized temporaries (which do not grow with the
    batch) are a large part of the step, as in this tiny model; at full scale they are not."""
    def make_model() -> VideoClassifier:
        backbone = resnet(layers=[1, 1, 1, 1])
        return VideoClassifier(backbone, TConvHead(backbone.feature_dim, K, hidden_dim=16))

    one = simulate_step(make_model, lambda m: torch.optim.AdamW(m.parameters()), SHAPE, K)
    two = simulate_step(make_model, lambda m: torch.optim.AdamW(m.parameters()),
                        (4, *SHAPE[1:]), K)
    guess = one.scaled(2.0)
    assert two.train_peak <= guess.train_peak <= 1.1 * two.train_peak


def test_weight_init_is_skipped_inside_and_restored_after() -> None:
    t = torch.zeros(3)
    original = nn.init.normal_
    with _no_weight_init():
        assert nn.init.normal_(t) is t and torch.equal(t, torch.zeros(3))
    assert nn.init.normal_ is original
