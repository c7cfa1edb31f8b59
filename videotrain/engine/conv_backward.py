"""Which CPU kernel computes a convolution's backward (``trainer.cpu_conv_backward``).

Why this exists: on the CPU, PyTorch runs fp32 convolutions through oneDNN. oneDNN's backward
computes the weight gradient into a buffer in its own blocked layout and then reorders it into
the plain tensor that autograd adds into ``.grad``, so two weight-sized buffers are alive at
once. ATen's native kernel (what PyTorch runs with oneDNN switched off) writes the weight
gradient once. For most convolutions the difference is noise, but not where the weight is
larger than the input: a ResNet's last stage (512x512x3x3, 9.0 MiB of weight against a 1 MB
input for 32 frames of 112 px) is the first thing backward reaches, while every stored activation
is still alive, so oneDNN's extra copy lands on top of the step's peak, in every memory strategy
alike. Measured on the project's CPU: one such backward (16 frames) peaks at 18.4 MB with oneDNN
and 9.6 MB with the native kernel (``tests/engine/test_conv_backward.py``); at the bench setting
(resnet18, B=2, T=16, 112 px) the whole step's peak drops by 8.4 MB for e2e, SBP and frame
dropout alike (see the README's benchmark section).

Policies:

``onednn`` (default): PyTorch's own choice for every convolution.

``lean``: a convolution whose weight has at least ``WEIGHT_TO_INPUT`` (4) times as
many elements as its input runs its backward through the native kernel; every other convolution
keeps oneDNN. Those are the layers where the copy matters: backward reaches them first, with
every activation alive. By the time backward reaches a layer whose weight is about its input's
size (resnet18's third stage at 32 frames), enough has been freed that oneDNN's copy no longer
sets the peak, and routing it would only cost time (measured: routing resnet18's 7 layers with
weight > input gave the same peak as routing its 3 layers at 4x, at a higher step time).
Applies to fp32 on the CPU only. CUDA convolutions use cuDNN and are never touched, and bf16
keeps oneDNN, since the native bf16 kernel is far slower (about 80x on that 512x512 layer). The
gradients are the same up to float rounding. The native kernel is slower (inside resnet18 at the bench setting,
about 50 ms more per routed layer: e2e's backward 40% slower, its step 27%), which is why
it is not the default: it is for CPU runs where memory, not time, is what runs out.

How: a dispatch mode is active only around ``loss.backward()`` (``Precision.backward``). The CPU
autograd engine runs backward in the calling thread, so the mode sees each
``aten.convolution_backward`` and re-runs the routed ones with oneDNN disabled for that call
alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class LeanConvBackward(TorchDispatchMode):
    """Routes weight-heavy fp32 CPU convolution backwards to ATen's native kernel (``lean``).

    ``routed`` counts the calls it routed, so tests and users can see that it acted."""

    def __init__(self) -> None:
        super().__init__()
        self.routed = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # convolution_backward(grad_output, input, weight, ...)
        if func is _CONV_BACKWARD and routes_to_native(args[1], args[2]):
            self.routed += 1
            with onednn_disabled():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(
            f"trainer.cpu_conv_backward must be one of {', '.join(POLICIES)}; got {policy!r}")
    return policy


def conv_backward_kernels(policy: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context to run ``loss.backward()`` in: ``LeanConvBackward`` for ``lean`` on the CPU,
    otherwise a no-op."""
    if check_policy(policy) == "lean" and device.type == "cpu":
        return LeanConvBackward()
    return contextlib.nullcontext()
