"""``trainer.cpu_conv_backward``: which CPU kernel computes convolution backwards.

``lean`` must route exactly the weight-heavy fp32 convolutions to ATen's native kernel, give the
gradients oneDNN gives, hold one weight-gradient buffer where oneDNN holds two, leave bf16 and
non-CPU devices alone, and always restore PyTorch's oneDNN flag.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from videotrain.engine.conv_backward import (
    LeanConv,
    conv_backward_kernels,
    onednn_disabled,
    routes_to_native,
)
from videotrain.engine.precision import Precision

CPU = torch.device("cpu")


def test_rule_is_weight_heavy_fp32_on_the_cpu() -> None:
    w = torch.empty(512, 512, 3, 3)  # 2.36M elements
    assert routes_to_native(torch.empty(32, 512, 4, 4), w)  # 262k-element input: 9x
    assert routes_to_native(torch.empty(1, 576, 32, 32), w)  # exactly 4x
    assert not routes_to_native(torch.empty(1, 577, 32, 32), w)  # just under 4x
    assert not routes_to_native(torch.empty(32, 256, 7, 7), torch.empty(256, 256, 3, 3))  # 1.5x
    assert not routes_to_native(torch.empty(32, 64, 28, 28), torch.empty(64, 64, 3, 3))
    assert not routes_to_native(torch.empty(32, 512, 4, 4, dtype=torch.bfloat16), w.bfloat16())
    assert not routes_to_native(torch.empty(32, 512, 4, 4, device="meta"), w.to("meta"))


def _resnet_and_batch(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=5).train()
    x = torch.randn(4, 3, 64, 64)  # layer4 at 2x2: its 3x3 convs' weights are 36x their input
    return model, x, torch.tensor([0, 1, 2, 3])


def _weight_heavy_convs(model: nn.Module, x: torch.Tensor) -> int:
    """How many convolutions of one forward ``lean`` routes (weight >= 4x input)."""
    seen: list[bool] = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(routes_to_native(i[0], m.weight)))
             for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return sum(seen)


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, policy: str) -> tuple[dict, int]:
    model.zero_grad(set_to_none=True)
    with conv_backward_kernels(policy, CPU) as mode:  # the forward records the kernels
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    routed = mode.routed if isinstance(mode, LeanConv) else 0
    return {n: p.grad.clone() for n, p in model.named_parameters()}, routed


def test_lean_routes_the_weight_heavy_convs_and_keeps_the_gradients() -> None:
    model, x, y = _resnet_and_batch()
    heavy = _weight_heavy_convs(model, x)
    assert 0 < heavy < sum(isinstance(m, nn.Conv2d) for m in model.modules())  # not all, not none
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref, routed_ref = _grads(model, x, y, "onednn")
    model.load_state_dict(state)  # the same BN running statistics for the second pass
    lean, routed = _grads(model, x, y, "lean")
    assert routed_ref == 0 and routed == heavy
    assert torch.backends.mkldnn.enabled  # restored after every routed call
    assert not isinstance(torch.overrides._get_current_function_mode(), LeanConv)  # mode left
    for name, g in ref.items():
        torch.testing.assert_close(lean[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")


# One 512x512x3x3 convolution's backward, peak measured with the trainer's CPU meter in a fresh
# process started the way the benchmark starts its rows (MALLOC_MMAP_THRESHOLD_), so freed heap
# left by earlier tests in this process cannot hide an allocation.
_PEAKS_SCRIPT = """
import json, torch
from torch import nn
from videotrain.engine.conv_backward import conv_backward_kernels
from videotrain.metrics.memory import StepPeakMemory
cpu = torch.device("cpu")
meter = StepPeakMemory(cpu)
conv = nn.Conv2d(512, 512, 3, padding=1, bias=False)
conv.weight.grad = torch.zeros_like(conv.weight)  # held between steps, as in the trainer
x = torch.randn(16, 512, 4, 4, requires_grad=True)
peaks = {"onednn": [], "lean": []}
for _ in range(3):  # the first round warms kernel caches up
    for policy in peaks:
        with conv_backward_kernels(policy, cpu):
            y = conv(x)
        g = torch.randn_like(y)
        meter.start()
        y.backward(g)
        peaks[policy].append(meter.stop())
print(json.dumps({k: min(v[1:]) for k, v in peaks.items()}))
"""


def test_lean_holds_one_weight_gradient_buffer_where_onednn_holds_two() -> None:
    """The reason the option exists, measured as the trainer measures a step (CPU meter)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", _PEAKS_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    assert None not in peaks.values(), "the CPU meter needs a writable /proc/self/clear_refs"
    weight_mb = 512 * 512 * 9 * 4 / 2**20  # 9.0 MiB
    assert peaks["onednn"] >= 1.75 * weight_mb, peaks  # blocked copy + plain gradient
    # the plain gradient, or the input gradient's weight reorder (freed before the weight
    # gradient is computed), plus grad_input and columns
    assert peaks["lean"] <= 1.4 * weight_mb, peaks
    assert peaks["onednn"] - peaks["lean"] >= 0.75 * weight_mb, peaks


def test_bf16_autocast_and_no_grad_keep_onednn() -> None:
    model, x, y = _resnet_and_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16), conv_backward_kernels("lean", CPU) as mode:
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    assert mode.routed == 0
    with torch.no_grad(), conv_backward_kernels("lean", CPU) as mode:
        model(x)
    assert mode.routed == 0
    assert all(p.grad.isfinite().all() for p in model.parameters())


def test_precision_forward_records_the_policy_and_backward_uses_the_given_scaler() -> None:
    model, x, y = _resnet_and_batch()
    assert Precision("32", CPU).cpu_conv_backward == "onednn"  # the default: PyTorch's kernels
    assert not isinstance(Precision("bf16", CPU, "lean").autocast(), LeanConv)  # autocast only
    precision = Precision("32", CPU, "lean")
    calls: list[torch.Tensor] = []

    class Spy(torch.amp.GradScaler):
        def scale(self, outputs):  # type: ignore[override]
            calls.append(outputs)
            return super().scale(outputs)

    with precision.autocast() as mode:
        loss = F.cross_entropy(model(x), y)
    assert isinstance(mode, LeanConv) and mode.routed == _weight_heavy_convs(model, x)
    precision.backward(loss, Spy("cpu", enabled=False))
    assert len(calls) == 1
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("stride", "padding", "dilation", "bias", "input_grad"), [
    (1, 1, 1, False, True), (2, (1, 0), 1, True, True), (1, 2, 2, True, False), (1, 0, 1, True, True),
])
def test_routed_convolution_gradients_match_pytorch(stride, padding, dilation, bias, input_grad) -> None:
    """Every argument form ``conv2d`` takes (int or pair, bias or none, a frozen input)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 64, 3, stride=stride, padding=padding, dilation=dilation, bias=bias)
    x = torch.randn(2, 32, 6, 6, requires_grad=input_grad)  # weight 18k elements, input 2.3k
    ref = conv(x)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, [x, *conv.parameters()] if input_grad else list(conv.parameters()), g)
    with conv_backward_kernels("lean", CPU) as mode:
        out = conv(x)
    assert mode.routed == 1 and torch.equal(out, ref)
    got = torch.autograd.grad(out, [x, *conv.parameters()] if input_grad else list(conv.parameters()), g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with conv_backward_kernels("lean", CPU) as mode:  # padding="same" is left to PyTorch
        nn.functional.conv2d(x, conv.weight, padding="same")
    assert mode.routed == 0


def test_policy_is_validated_and_a_no_op_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="trainer.cpu_conv_backward must be one of onednn, lean"):
        Precision("32", CPU, "fast")
    assert isinstance(conv_backward_kernels("onednn", CPU), contextlib.nullcontext)
    assert isinstance(conv_backward_kernels("lean", torch.device("cuda")), contextlib.nullcontext)
    assert isinstance(conv_backward_kernels("lean", CPU), LeanConv)


def test_onednn_flag_restored_when_the_body_raises() -> None:
    assert torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError, match="boom"), onednn_disabled():
        assert not torch.backends.mkldnn.enabled
        raise RuntimeError("boom")
    assert torch.backends.mkldnn.enabled


def test_torch_compile_traces_through_the_mode() -> None:
    """Dynamo traces the forward with the mode active (``backend="eager"``: dynamo's tracing
    without inductor's C++ build) and the gradients are still PyTorch's."""
    model, x, y = _resnet_and_batch()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want, _ = _grads(model, x, y, "onednn")
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="eager")
    with conv_backward_kernels("lean", CPU):
        loss = F.cross_entropy(compiled(x), y)
    loss.backward()
    for name, p in model.named_parameters():
        g = want[name]
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
