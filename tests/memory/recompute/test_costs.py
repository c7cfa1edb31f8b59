"""The planner's prices: a roofline in seconds on the device's profile prices BN, ReLU
and add like a GPU pays them; a per-segment host cost makes plans of fewer, larger segments;
measured costs come from the shape pass; one cost function for checkpoint, auto and SBP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from videotrain.memory.recompute.costs import PROFILES, profile_for
from videotrain.memory.recompute.graph import Graph, trace
from videotrain.memory.recompute.planner import chain_cost, plan
from videotrain.memory.recompute.strategy import Recompute


class ConvBNReLUAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(64, 64, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 64, H, W) -> same
        return F.relu(self.bn(self.conv(x))) + x


def test_roofline_prices_bn_relu_and_add_like_bandwidth() -> None:
    """A ResNet layer1-sized block (32 maps of 64 x 56 x 56) on the H200 profile: the conv is
    compute-bound, BN (reads its input twice), ReLU and add are bandwidth-bound and cost a good
    fraction of it; the FLOP proxy called them 1/576 to 1/1152 of the conv."""
    torch.manual_seed(0)
    x = torch.randn(32, 64, 56, 56)
    _, g, _ = trace(ConvBNReLUAdd().train(), x, profile=PROFILES["h200"])
    assert g.names == ["conv", "bn", "relu", "add"]
    conv, bn, relu, add = g.cost
    fmap = x.numel() * 4
    assert conv == pytest.approx(2 * fmap / 4 * 64 * 9 / PROFILES["h200"].flops_fp32)
    assert bn == pytest.approx(3 * fmap / PROFILES["h200"].bandwidth, rel=1e-3)  # in x2, out; + params
    assert relu == pytest.approx(2 * fmap / PROFILES["h200"].bandwidth)
    assert add == pytest.approx(3 * fmap / PROFILES["h200"].bandwidth)
    assert bn > 0.5 * conv and relu > 0.3 * conv
    assert g.flops[1] * 500 < g.flops[0]  # the FLOP proxy: BN next to free
    assert g.segment_cost == PROFILES["h200"].segment_s


def test_measured_costs_come_from_the_shape_pass() -> None:
    torch.manual_seed(0)
    _, g, _ = trace(ConvBNReLUAdd().train(), torch.randn(2, 64, 16, 16), cost_model="measured")
    assert all(c >= PROFILES["cpu"].op_s for c in g.cost) and len(g.cost) == 4
    with pytest.raises(ValueError, match="cost_model"):
        trace(ConvBNReLUAdd(), torch.randn(1, 64, 4, 4), cost_model="guess")


def test_profiles_by_device_and_name() -> None:
    assert profile_for("cpu") is PROFILES["cpu"]
    assert profile_for("cpu", "h100") is PROFILES["h100"]
    with pytest.raises(ValueError, match="device_profile"):
        profile_for("cpu", "tpu")
    with pytest.raises(ValueError, match="device_profile"):
        Recompute("optimal", device_profile="tpu")
    with pytest.raises(ValueError, match="segment_cost_us"):
        Recompute("optimal", segment_cost_us=-1)


def test_segment_cost_prefers_fewer_larger_segments() -> None:
    """A 16-vertex chain alternating cheap (1) and costly (10) ops: without a segment cost the
    plan keeps costly outputs in 7 segments; with a segment cost of 5 it takes 3 segments within
    the same budget, and its total (recompute + segments) is lower than the 7-segment plan's."""
    n = 16
    names, preds = [f"v{i}" for i in range(n)], [[]] + [[i] for i in range(n - 1)]
    mem, cost = [1e5] * n, [10.0 if i % 2 else 1.0 for i in range(n)]
    free_g = Graph(names, preds, mem, cost)
    _, smallest, _ = plan(free_g, None)
    budget = smallest + 0.2 * (chain_cost(free_g, [free_g.full])[0] - smallest)
    many, _, _ = plan(free_g, budget)
    paid = Graph(names, preds, mem, cost, segment_cost=5.0)
    few, _, _ = plan(paid, budget)
    assert few.peak <= budget and many.peak <= budget
    assert (len(many.chain), len(few.chain)) == (7, 3)
    assert chain_cost(paid, few.chain)[1] == few.overhead < chain_cost(paid, many.chain)[1]


def test_auto_and_sbp_plan_with_the_same_prices() -> None:
    """memory=auto's candidates and SBP's kept path build ``Recompute`` with its defaults, so
    the roofline on the training device prices all of them."""
    from videotrain.memory.sbp.strategy import StochasticBackprop

    sbp = StochasticBackprop(keep_ratio=0.5, recompute="optimal")
    assert sbp.recompute.cost_model == "roofline" and sbp.recompute.device_profile == "auto"
    mine = Recompute("optimal")
    torch.manual_seed(0)
    backbone = ConvBNReLUAdd().train()
    x = torch.randn(2, 64, 8, 8)
    with torch.no_grad():
        a = mine.make_plan(backbone, x)[3]
        b = sbp.recompute.make_plan(backbone, x)[3]
    assert a["forward_cost"] == pytest.approx(b["forward_cost"]) and a["cost_model"] == "roofline"
