"""``sbp_split._train_bn_with_stats``: the record pass's BN forward must be the layer's own
training forward, bit for bit (output, running statistics, ``num_batches_tracked``), and the
statistics it returns must be the batch's, for every BN configuration it takes the fast path for
and for subclasses that it must not."""

from __future__ import annotations

import copy
from types import MethodType

import pytest
import torch
from torch import nn

from videotrain.memory.sbp.split import _train_bn_with_stats


class OwnForwardBN(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a subclass with its own forward
        return super().forward(x) * 2.0


CASES = {
    "bn2d": (lambda: nn.BatchNorm2d(6), (5, 6, 4, 3)),
    "bn2d_cumulative": (lambda: nn.BatchNorm2d(6, momentum=None), (5, 6, 4, 3)),
    "bn2d_no_running_stats": (lambda: nn.BatchNorm2d(6, track_running_stats=False), (5, 6, 4, 3)),
    "bn2d_no_affine": (lambda: nn.BatchNorm2d(6, affine=False), (5, 6, 4, 3)),
    "bn1d": (lambda: nn.BatchNorm1d(6), (7, 6)),
    "bn3d": (lambda: nn.BatchNorm3d(6), (2, 6, 3, 4, 2)),
    "own_forward": (lambda: OwnForwardBN(6), (5, 6, 4, 3)),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("case", CASES)
def test_record_forward_is_the_layers_own_and_returns_the_batch_statistics(case: str,
                                                                           autocast: bool) -> None:
    make, shape = CASES[case]
    torch.manual_seed(0)
    ours = make().train()
    if ours.affine:
        with torch.no_grad():
            ours.weight.uniform_(0.5, 1.5)
            ours.bias.uniform_(-0.5, 0.5)
    ref = copy.deepcopy(ours)
    dtype = torch.bfloat16 if autocast else torch.float32
    for step in range(3):  # several steps: momentum=None depends on num_batches_tracked
        x = (torch.randn(*shape) * (step + 1) + 2.0).to(dtype)  # (N, C, *)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            expected = ref(x)
            out, mean, rstd = _train_bn_with_stats(ours, MethodType(type(ours).forward, ours), x)
        assert out.dtype == expected.dtype and torch.equal(out, expected)
        for name, buf in ref.named_buffers():
            assert torch.equal(dict(ours.named_buffers())[name], buf), name
        dims = [0, *range(2, x.dim())]
        ref_var, ref_mean = torch.var_mean(x.double(), dim=dims, correction=0)
        assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (shape[1],)
        torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rstd.double(), torch.rsqrt(ref_var + ours.eps), rtol=1e-4, atol=1e-5)
