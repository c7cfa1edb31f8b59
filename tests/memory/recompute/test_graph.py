"""fx tracing into a tensor DAG: sizes, contraction of non-tensor nodes, out-of-place rewrite."""

from __future__ import annotations

import torch
from torch import nn

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
