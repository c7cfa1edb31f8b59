"""The kept-rows autograd functions (``sbp/kept_rows.py``): an op run once over all rows, with the
kept rows' graph beside it, gives the gradient of the same op run on the kept rows alone with
autograd (the dropped rows held constant), and what it saves holds the kept rows only. Each test
has a CUDA twin in the gpu-marked run (``device``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from videotrain.memory.sbp.kept_rows import (
    BatchNormCoefficients,
    KeptRowsBatchNorm,
    add_relu_parts,
    conv_parts,
    fused_bn_backward,
    plain_conv,
    split_bn_backward,
)

N, n = 6, 2  # rows, of which the first n are kept


def _kept_input(full: torch.Tensor) -> torch.Tensor:
    return full[:n].clone().requires_grad_()


@pytest.mark.parametrize("kw", [
    {"kernel_size": 3, "padding": 1},
    {"kernel_size": 3, "stride": 2, "padding": 1, "bias": False},
    {"kernel_size": 3, "padding": 2, "dilation": 2, "groups": 2},
    {"kernel_size": 1},
])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_conv_parts_gives_the_kept_rows_gradient(kw: dict, fmt: torch.memory_format,
                                                 device: torch.device) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, **kw).to(device, memory_format=fmt)
    full = torch.randn(N, 4, 9, 9, device=device).contiguous(memory_format=fmt)
    x = _kept_input(full)
    kept, out = conv_parts(conv, x, full)
    torch.testing.assert_close(out, conv(full).detach())
    assert kept.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()  # its own rows
    assert kept.is_contiguous(memory_format=fmt)
    g = torch.randn_like(kept)
    kept.backward(g)
    got = (x.grad, *(p.grad for p in conv.parameters()))
    conv.zero_grad()
    x2 = _kept_input(full)
    conv(x2).backward(g)
    tol = 1e-5 if device.type == "cpu" else 1e-2  # TF32 convolutions on CUDA
    for a, b in zip(got, (x2.grad, *(p.grad for p in conv.parameters())), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_conv_parts_under_bf16_autocast_matches_autocast(device: torch.device) -> None:
    """The kept input is saved in the dtype the convolution ran in, the weight gradient comes
    back in the parameter's dtype, as with autocast's own convolution."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, padding=1).to(device)
    full = torch.randn(N, 3, 8, 8, device=device)
    # the all-rows call casts its weight uncached (backward casts it again): no copy held to the
    # end of the forward
    cache_seen: list[bool] = []
    conv.register_forward_hook(lambda *_: cache_seen.append(torch.is_autocast_cache_enabled()))
    grads = []
    for ours in (True, False):
        conv.zero_grad()
        x = _kept_input(full)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            kept = conv_parts(conv, x, full)[0] if ours else conv(x)
            assert torch.is_autocast_cache_enabled()
        assert kept.dtype == torch.bfloat16
        kept.float().square().sum().backward()
        grads.append([x.grad, conv.weight.grad, conv.bias.grad])
    for a, b in zip(*grads, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert cache_seen == [False, True]


def test_plain_conv_is_the_stock_zero_padded_conv() -> None:
    assert plain_conv(nn.Conv2d(3, 4, 3, padding=1))
    assert not plain_conv(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"))
    assert not plain_conv(nn.Conv2d(3, 4, 3, padding="same"))
    assert not plain_conv(nn.Conv1d(3, 4, 3))

    class Scaled(nn.Conv2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    assert not plain_conv(Scaled(3, 4, 3))


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("b_shape", [(N, 4, 5, 5), (1, 4, 1, 1)], ids=["residual", "broadcast"])
def test_add_relu_parts_gives_the_kept_rows_gradient(in_place: bool, b_shape: tuple,
                                                    device: torch.device) -> None:
    torch.manual_seed(0)
    full_a, full_b = torch.randn(N, 4, 5, 5, device=device), torch.randn(*b_shape, device=device)
    want_full = torch.relu(full_a + full_b)
    a = _kept_input(full_a)
    b = (full_b[:n] if b_shape[0] == N else full_b).clone().requires_grad_()
    kept, out = add_relu_parts(a, b, full_a, full_b, in_place)
    torch.testing.assert_close(out, want_full)
    assert (out is full_a) == in_place  # written into full_a only when asked
    torch.testing.assert_close(kept, want_full[:n])
    g = torch.randn_like(kept)
    kept.backward(g)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.relu(a2 + b2).backward(g)
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def _bn_case(device: torch.device, dtype: torch.dtype, affine: bool = True):
    """A full batch ``(N, 4, 5, 5)`` in ``dtype``, its fp32 (fp64 for fp64) statistics, and the
    kept-rows BN function's inputs."""
    torch.manual_seed(0)
    full = (torch.randn(N, 4, 5, 5, device=device) * 2 + 1).to(dtype)
    bn = nn.BatchNorm2d(4, affine=affine).to(device, torch.float64 if dtype == torch.float64 else torch.float32)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
    acc = torch.promote_types(dtype, torch.float32)
    var, mean = torch.var_mean(full.to(acc), dim=(0, 2, 3), correction=0)
    return full, bn, mean, torch.rsqrt(var + bn.eps)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_kept_rows_bn_gives_e2e_gradient_with_the_dropped_rows_constant(
        affine: bool, fmt: torch.memory_format, device: torch.device) -> None:
    """``KeptRowsBatchNorm`` (on CPU the BN backward kernel plus ``addcmul_``, on CUDA the fused
    SyncBatchNorm kernels, whose channels_last path is a kernel of its own) against autograd
    through BN over all rows, the dropped ones detached."""
    full, bn, mean, rstd = _bn_case(device, torch.float32, affine)
    full = full.contiguous(memory_format=fmt)
    x = _kept_input(full)
    kept = KeptRowsBatchNorm.apply(x, bn.weight, bn.bias, None, mean, rstd,
                                   BatchNormCoefficients(n, N), bn.eps)
    g = torch.randn_like(kept)
    kept.backward(g)
    got = (x.grad, *(p.grad for p in bn.parameters()))
    bn.zero_grad()
    x2 = _kept_input(full)
    ref = nn.functional.batch_norm(torch.cat((x2, full[n:])), None, None, bn.weight, bn.bias, True)
    torch.testing.assert_close(kept.detach(), ref[:n].detach(), rtol=1e-5, atol=1e-5)
    ref[:n].backward(g)
    for a, b in zip(got, (x2.grad, *(p.grad for p in bn.parameters())), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _reference_reduce(grad, x, mean, invstd, weight, input_g, weight_g, bias_g):
    """``torch.batch_norm_backward_reduce`` as ATen's CUDA kernel computes it (sums in the
    statistics' dtype; the weight gradient in the weight's)."""
    dims = [0, *range(2, x.dim())]
    shape = (1, -1) + (1,) * (x.dim() - 2)
    g, xmu = grad.to(mean.dtype), x.to(mean.dtype) - mean.view(shape)
    sum_dy, sum_dy_xmu = g.sum(dims), (g * xmu).sum(dims)
    gw = (sum_dy_xmu * invstd).to(weight.dtype) if weight_g else None
    gb = sum_dy.to(weight.dtype) if bias_g else None
    return (sum_dy if input_g else None), (sum_dy_xmu if input_g else None), gw, gb


def _reference_elemt(grad, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """``torch.batch_norm_backward_elemt``: normalised by the sum of ``count`` (int32)."""
    assert count.dtype == torch.int32
    shape = (1, -1) + (1,) * (x.dim() - 2)
    total = count.sum().item()
    scale = invstd if weight is None else invstd * weight
    dx = (grad.to(mean.dtype) - (sum_dy / total).view(shape)
          - (x.to(mean.dtype) - mean.view(shape)) * (invstd * invstd * sum_dy_xmu / total).view(shape))
    return (dx * scale.view(shape)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, True]])
def test_fused_bn_backward_equals_the_split_form(dtype: torch.dtype, affine: bool, mask: list[bool],
                                                 monkeypatch) -> None:
    """The CUDA form of the kept-rows BN backward (``fused_bn_backward``: the SyncBatchNorm
    kernels, with the full batch's count) against the CPU form (``split_bn_backward``), on CPU
    with the two kernels replaced by their ATen CUDA definitions: the same gradients, in each
    dtype and mask. The gpu-marked twin of the test above runs the kernels themselves."""
    monkeypatch.setattr(torch, "batch_norm_backward_reduce", _reference_reduce)
    monkeypatch.setattr(torch, "batch_norm_backward_elemt", _reference_elemt)
    full, bn, mean, rstd = _bn_case(torch.device("cpu"), dtype, affine)
    mask = [mask[0], mask[1] and affine, mask[2] and affine]
    x = full[:n].clone()
    grad = torch.randn_like(x)
    got = {}
    for form in (fused_bn_backward, split_bn_backward):
        coefs = BatchNormCoefficients(n, N)
        i = coefs.add(bn.weight if affine else None, rstd)
        got[form] = form(grad, x, mean, rstd, coefs, i, bn.eps, mask)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for a, b, wanted in zip(got[fused_bn_backward], got[split_bn_backward], mask, strict=True):
        assert (a is not None) == (b is not None) == wanted
        if wanted:
            torch.testing.assert_close(a, b, **tol)

