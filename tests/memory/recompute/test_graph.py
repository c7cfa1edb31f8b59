"""fx tracing into a tensor DAG: sizes, contraction of non-tensor nodes, out-of-place rewrite."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from videotrain.memory.recompute.costs import PROFILES
from videotrain.memory.recompute.graph import articulation_points, lower_sets, trace
from videotrain.models.backbones import resnet


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, 4)
        y = self.relu(self.bn(self.conv(x)))
        y = y.view(x.shape[0], 4, -1)  # x.shape is a non-tensor node: contracted
        return y.mean(-1)


def test_chain_trace_sizes_and_order() -> None:
    model = Chain().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm, g, index = trace(model, torch.randn(2, 3, 8, 8))
    assert g.names == ["conv", "bn", "relu", "view", "mean"]
    assert g.preds == [[], [0], [1], [2], [3]]
    out = 2 * 4 * 8 * 8 * 4  # conv output, float32 bytes
    assert g.mem[:3] == [out, out, out]
    # what autograd keeps: the conv output (BN's input), BN's batch statistics only (its output
    # feeds an out-of-place ReLU, which saves its result instead), the ReLU result
    assert g.saved[0] == out and g.keeps[0]
    assert 0 < g.saved[1] < out and not g.keeps[1]
    assert g.saved[2] == out and g.keeps[2]
    assert g.saved[3] == 0  # a view of the ReLU result: not counted twice
    assert g.grad_alias[3] and not g.grad_alias[0]  # a view's backward hands on a view
    assert len(lower_sets(g)) == g.n + 1
    assert articulation_points(g) == [0, 1, 2, 3]
    assert set(index) == set(g.names)
    for k, v in model.state_dict().items():  # shape propagation left BN stats alone
        assert torch.equal(v, before[k])


def test_out_of_place_rewrite_keeps_the_original_in_place() -> None:
    model = Chain()
    gm, _, _ = trace(model, torch.randn(2, 3, 8, 8))
    assert model.relu.inplace  # the backbone itself is untouched
    assert not any(isinstance(gm.get_submodule(str(n.target)), nn.ReLU) for n in gm.graph.nodes if n.op == "call_module")
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(gm(x), model(x))


def test_resnet18_lower_sets() -> None:
    _, g, _ = trace(resnet(18), torch.randn(2, 3, 32, 32))
    assert g.n == 69
    # 3 downsample blocks each give a parallel shortcut: more than a chain's n + 1
    assert len(lower_sets(g)) == 100
    assert len(articulation_points(g)) == 22


# ------------------------------------------------------------- exact bytes on small graphs
class Mlp(nn.Module):
    """Linear -> ReLU -> Dropout -> x scale -> Linear, plus a skip from the ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 8, bias=False)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (2, 3) -> (2, 8)
        r = torch.relu(self.fc(x))  # (2, 8): 64 bytes
        m = self.drop(r) * self.scale.reshape(1, -1)  # the reshape of a parameter is no vertex
        return self.fc2(m) + r


def test_saved_bytes_per_node_by_hand(kit) -> None:
    """Every (2, 8) fp32 tensor is 64 bytes. What autograd keeps, by hand: the first Linear's
    output feeds a ReLU, which saves its result, not its input (0); the ReLU result (64);
    dropout's output, saved by the multiply, plus its mask, on the CPU a float32 noise tensor
    of the same shape (64 + 64); the product, the second Linear's input (64); the second
    Linear's output feeds an add, which saves nothing (0)."""
    torch.manual_seed(0)
    model = Mlp().train()
    x = torch.randn(2, 3)
    _, g, _ = trace(model, x)
    assert g.names == ["fc", "relu", "drop", "mul", "fc2", "add"]
    assert g.preds == [[], [0], [1], [2], [3], [1, 4]]  # mul: the parameter reshape is contracted
    assert g.mem == [64.0] * 6
    assert g.saved == [0.0, 64.0, 128.0, 64.0, 0.0, 0.0]
    assert g.keeps == [False, True, True, True, False, False]
    assert g.saves == [True, True, True, True, True, False]  # an add saves nothing
    assert g.grad_alias[5] and not any(g.grad_alias[:5])  # add hands on its output gradient
    # the multiply's backward: the scale's gradient is the (2, 8) product reduced over the
    # broadcast row dimension, a 64-byte temporary freed inside the backward
    assert g.work_bwd[3] == 64.0
    # multiply-adds: 2 * out elements * in features; elementwise ops: their element count
    assert g.flops == [2 * 16 * 3, 16, 16, 16, 2 * 16 * 8, 16]
    # priced in seconds on the CPU profile: ops this small cost one launch each
    assert g.cost == [PROFILES["cpu"].op_s] * 6 and g.segment_cost == PROFILES["cpu"].segment_s
    # free in a recompute: ops that save neither their output nor internals (Linear, add)
    assert g.free == [True, False, False, True, True, True]
    # the whole graph against autograd's own saved tensors on a real forward (less the input x,
    # which the first Linear saves and which is no vertex)
    torch.manual_seed(0)
    assert sum(g.saved) == kit.saved_bytes(lambda: model(x), exclude=model) - x.numel() * 4


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, 4, H, W)
        return F.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv_bn_relu_bytes_follow_the_dtype(dtype: torch.dtype) -> None:
    """(2, 4, 8, 8) maps: 512 elements. The conv output is BN's saved input; BN keeps four
    per-channel tensors (batch mean and inverse std, and the running mean and variance its
    CPU backward is handed: 4 x 4 channels; module state, not activations, but charged, which
    errs high); its output feeds a ReLU that saves its result instead."""
    esize = torch.empty((), dtype=dtype).element_size()
    model = ConvBN().to(dtype).train()
    _, g, _ = trace(model, torch.randn(2, 3, 8, 8, dtype=dtype))
    fmap = 2 * 4 * 8 * 8 * esize
    assert g.mem == [fmap] * 3
    assert g.saved == [fmap, 4 * 4 * esize, fmap]
    assert g.keeps == [True, False, True]
    if dtype == torch.float32:
        assert g.flops[0] == 2 * 512 * 3 * 9  # multiply-adds: 2 x out elements x in channels x 3x3
    _, flops_only, _ = trace(model, torch.randn(2, 3, 8, 8, dtype=dtype), cost_model="flops")
    assert flops_only.cost == flops_only.flops and flops_only.segment_cost == 0


class InPlace(nn.Module):
    """Every in-place form ``make_out_of_place`` rewrites, then a split whose halves are saved."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (2, 4) -> (2, 2)
        h = self.act(self.fc(x))  # an in-place module
        h += x  # operator.iadd
        h = F.relu(h, inplace=True)  # an inplace=True keyword
        h = h.mul_(2.0)  # an in-place method
        a, b = h.split(2, dim=1)  # views of h
        return a * b


def test_in_place_forms_are_rewritten_and_views_counted_once() -> None:
    torch.manual_seed(0)
    model = InPlace().train()
    x = torch.randn(2, 4)
    expected = model(x.clone())
    gm, g, _ = trace(model, x)
    nodes = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    assert not [n for n in nodes if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.ReLU)]
    assert not [n for n in nodes if n.target is operator.iadd or n.kwargs.get("inplace")]
    assert not [n for n in nodes if n.op == "call_method" and str(n.target).endswith("_")]
    assert model.act.inplace  # the backbone keeps its in-place ReLU
    torch.testing.assert_close(gm(x), expected)
    assert g.names == ["fc", "act", "add", "relu", "mul_", "split", "getitem", "getitem_1", "mul"]
    assert g.mem == [32.0] * 6 + [16.0] * 3  # (2, 4) and (2, 2) fp32
    # the two ReLUs save their results; the x2 saves nothing, but the final product saves both
    # halves, views of its output, so that output is kept, once; the split and its halves: 0
    assert g.saved == [0.0, 32.0, 0.0, 32.0, 32.0, 0.0, 0.0, 0.0, 0.0]
    assert not g.saves[4] and g.keeps[4]
