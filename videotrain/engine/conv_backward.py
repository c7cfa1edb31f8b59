"""Which CPU kernel computes a convolution's backward (``trainer.cpu_conv_backward``).

Why this exists: on the CPU, PyTorch runs fp32 convolutions through oneDNN. oneDNN's backward
computes the weight gradient into a buffer in its own blocked layout and then reorders it into
the plain tensor that autograd adds into ``.grad``, so two weight-sized buffers are alive at
once. ATen's native kernel (what PyTorch runs with oneDNN switched off) writes the weight
gradient once. For most convolutions the difference is noise, but not where the weight is
larger than the input: a ResNet's last stage (512x512x3x3, 9.0 MiB of weight against a 1 MB
input for 32 frames of 112 px) is the first thing backward reaches, while every stored activation
is still alive, so oneDNN's extra copy lands on top of the step's peak, in every memory strategy
alike (about 19 MB of e2e's 187 MB at the bench setting, and of SBP's 105 MB at r=0.5).

Policies:

``onednn`` (default): PyTorch's own choice for every convolution.

``lean``: a convolution whose weight has at least ``WEIGHT_TO_INPUT`` (4) times as many
elements as its input computes its backward in two calls: the input gradient with oneDNN (its
fastest kernel; its transient, a weight reorder, is freed before the next call), then the weight
and bias gradients with the native kernel (one buffer). Every other convolution keeps oneDNN.
Those are the layers where the copy matters: backward reaches them first, with every activation
alive. Measured on the project's CPU: one 512x512 layer's backward at 32 frames peaks at 10.9 MB
against oneDNN's 18.9 MB, in 38 against 41 ms in isolation; inside resnet18 at the bench
setting the step peak drops by 8 MB for e2e, SBP and frame dropout alike. The step costs more
than those kernel times suggest: e2e +2% pooled over three bench rounds, +1% to +13% alternating
both policies in one process. Most of it is not the kernel's arithmetic: with oneDNN off,
PyTorch selects its NNPACK backend for these layers (``torch._C._select_conv_backend``), which
is faster than oneDNN in isolation but costs the model's backward 30-50 ms; splitting the
backward with oneDNN on for both calls costs nothing but saves nothing, and ATen's plain kernel
(NNPACK off too) materialises its columns (17.8 MB at 32 frames, as much as oneDNN). That is
why it is not the default: it is for CPU runs where memory, not time, runs out. Applies to fp32
on the CPU only: CUDA convolutions use cuDNN and are never touched, and bf16 keeps oneDNN, since
the native bf16 kernel is far slower (about 80x on that 512x512 layer). The gradients are the
same up to float rounding.

How: ``LeanConv``, a torch function mode, is active during the training forward
(``Precision.autocast``) and records each routed ``conv2d`` as ``_LeanConv2d``, whose backward
makes the two calls. (An earlier version intercepted every operation of the backward with a
dispatch mode and ran the whole backward natively: e2e's step +27%.) Calls under
``no_grad``, autocast, ``torch.compile``'s tracing, fx proxies and tensor subclasses, and
string paddings are left to PyTorch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

POLICIES = ("onednn", "lean")
WEIGHT_TO_INPUT = 4  # lean routes a convolution whose weight has this many times its input's elements
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default


def routes_to_native(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """``lean``'s rule: an fp32 CPU convolution whose weight has at least ``WEIGHT_TO_INPUT``
    times its input's elements, where oneDNN's extra weight-gradient copy dwarfs the activation
    the layer reads."""
    return (input.device.type == "cpu" and input.dtype == torch.float32
            and weight.dtype == torch.float32
            and weight.numel() >= WEIGHT_TO_INPUT * input.numel())


@contextlib.contextmanager
def onednn_disabled() -> Iterator[None]:
    """oneDNN off for the body (the flag ``torch.backends.mkldnn.flags`` sets, without also
    resetting its TF32 and determinism flags), restored even if the body raises."""
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)


class _LeanConv2d(torch.autograd.Function):
    """``F.conv2d`` whose backward is ``_split_backward``: what ``lean`` records in place of
    autograd's own convolution node. It saves what that node saves (input and weight)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.conf = (stride, padding, dilation, groups)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)  # (N, C_out, H', W')

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conf
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                ctx.bias_sizes is not None and ctx.needs_input_grad[2]]
        gi, gw, gb = _split_backward(
            grad.contiguous(), x, weight, ctx.bias_sizes, stride, padding, dilation, groups, mask)
        return gi, gw, gb, None, None, None, None


def _split_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias_sizes: list[int] | None, stride: list[int], padding: list[int],
                    dilation: list[int], groups: int, mask: list[bool]) -> tuple:
    """One convolution backward as two calls: the input gradient through oneDNN (its fastest
    kernel; its transient, a weight reorder, is freed before the next call), then the weight and
    bias gradients through the native kernel, which writes the weight gradient once."""
    def backward(output_mask: list[bool]) -> tuple:
        return _CONV_BACKWARD(grad, x, weight, bias_sizes, stride, padding, dilation, False,
                              [0] * len(stride), groups, output_mask)

    grad_input = backward([True, False, False])[0] if mask[0] else None
    grad_weight = grad_bias = None
    if mask[1] or mask[2]:
        with onednn_disabled():
            _, grad_weight, grad_bias = backward([False, mask[1], mask[2]])
    return grad_input, grad_weight, grad_bias


def _pair(v: int | tuple[int, ...] | list[int]) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(i) for i in v]


class LeanConv(TorchFunctionMode):
    """Records weight-heavy fp32 CPU 2-d convolutions with ``_LeanConv2d`` (``lean``).

    A function mode active during the *forward* (``Precision.autocast``): every torch call of
    the forward passes through it, and only routed ``conv2d`` calls (three in resnet18) do more
    than one identity check, where a dispatch mode around backward would intercept every
    operation of the backward. A checkpointed segment's recompute, which runs in backward, uses
    PyTorch's kernels. ``routed`` counts the convolutions it recorded, so tests and users can
    see that it acted."""

    def __init__(self) -> None:
        super().__init__()
        self.routed = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # torch.compile traces the forward itself: its graph keeps PyTorch's kernels
        if func is F.conv2d and not torch.compiler.is_compiling():
            x, weight, bias, stride, padding, dilation, groups = _conv2d_args(*args, **kwargs)
            if _routed_call(x, weight, padding):
                self.routed += 1
                return _LeanConv2d.apply(x, weight, bias, _pair(stride), _pair(padding),
                                         _pair(dilation), groups)
        return func(*args, **kwargs)


def _routed_call(x: Any, weight: Any, padding: Any) -> bool:
    """Whether ``LeanConv`` records this ``conv2d`` call with ``_LeanConv2d``."""
    if type(x) is not torch.Tensor or type(weight) not in (torch.Tensor, nn.Parameter):
        return False  # fx proxies, fake and other subclass tensors: left to PyTorch
    return (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and not isinstance(padding, str)  # "same" / "valid": left to PyTorch
            and x.dim() == 4 and not torch.is_autocast_enabled("cpu")
            and routes_to_native(x, weight))


def _conv2d_args(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> tuple:
    return input, weight, bias, stride, padding, dilation, groups


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(
            f"trainer.cpu_conv_backward must be one of {', '.join(POLICIES)}; got {policy!r}")
    return policy


def conv_backward_kernels(policy: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context to run the training *forward* in (the backward follows what it recorded):
    ``LeanConv`` for ``lean`` on the CPU, otherwise a no-op."""
    if check_policy(policy) == "lean" and device.type == "cpu":
        return LeanConv()
    return contextlib.nullcontext()
