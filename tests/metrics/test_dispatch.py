"""The aten op counter: forward and backward ops counted, views left out unless asked."""

import torch
from torch import nn

from videotrain.metrics.dispatch import aten_ops, bytes_moved


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


def test_bytes_moved_counts_inputs_and_outputs_of_computing_ops_only():
    x = torch.randn(4, 8)  # 128 bytes
    w = torch.randn(8)  # broadcast over the rows: counted once, 32 bytes
    with bytes_moved() as moved:
        y = x * w  # reads 128 + 32, writes 128
        y.t().contiguous()  # the transpose is a view (nothing); the copy reads 128, writes 128
        y.add_(1.0)  # an in-place op reads and writes y: 128 + 128
    assert moved["aten.mul"] == 128 + 32 + 128
    assert moved["aten.clone"] == 128 + 128
    assert moved["aten.add_"] == 256
    assert "aten.t" not in moved and "aten.transpose" not in moved
    assert sum(moved.values()) == 288 + 256 + 256


def test_bytes_moved_works_on_fake_tensors_at_any_size():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), bytes_moved() as moved:
        torch.empty(1024, 1024, 256).relu()  # 1 GiB of fp32, never allocated
    assert moved["aten.relu"] == 2 * 1024 * 1024 * 256 * 4
    assert "aten.empty" not in moved


def test_bytes_moved_leaves_metadata_reads_out():
    x = torch.randn(64, 64)
    with bytes_moved() as moved:
        torch.ops.prim.device(x)
        torch.ops.aten.sym_size(x, 0)
        torch._foreach_add_([x], 1.0)  # in place on a list, returns nothing: still moves x twice
    assert dict(moved) == {"aten._foreach_add_": 2 * 64 * 64 * 4}
