"""The aten op counter: forward and backward ops counted, views left out unless asked."""

import torch
from torch import nn

from videotrain.metrics.dispatch import aten_ops


def test_counts_forward_and_backward_ops_and_leaves_views_out():
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with aten_ops() as ops:
        lin(x).relu().sum().backward()
    assert ops["aten.addmm"] == 1  # the forward
    assert ops["aten.mm"] >= 1  # the backward's weight gradient
    assert ops["aten.relu"] == 1 and ops["aten.threshold_backward"] == 1
    assert "aten.t" not in ops and "aten.view" not in ops
    with aten_ops(views=True) as all_ops:
        lin(x).relu().sum().backward()
    assert all_ops["aten.t"] >= 1
    assert sum(all_ops.values()) > sum(ops.values())


def test_nothing_is_counted_outside_the_body():
    with aten_ops() as ops:
        pass
    torch.ones(3).add_(1)
    assert not ops


def test_bare_allocations_are_not_counted_as_launches():
    with aten_ops() as ops:
        torch.empty(3)
        torch.empty_strided((2, 2), (2, 1))
        torch.zeros(3)
    assert "aten.empty" not in ops and "aten.empty_strided" not in ops
    assert ops["aten.zero_"] == 1 or ops["aten.zeros"] == 1 or ops["aten.fill_"] == 1
