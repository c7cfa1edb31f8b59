"""What a recomputed op costs on the device that trains: one cost function for every planner.

Why: a FLOP count calls BatchNorm, ReLU and add free, yet on a GPU they are bandwidth-bound and
cost about as much as the convs, and every recomputed segment costs host time on the backward's
critical path (docs/memory.md#what-the-planner-prices). So a node costs *seconds*: a roofline,
the larger of ``FLOPs / peak`` and ``bytes moved / bandwidth``, or (``cost_model=measured``) its
forward timed in the shape pass, never less than one launch (``op_s``); every recomputed segment
adds ``segment_s`` (``Graph.segment_cost``). ``Recompute``, ``memory=auto``'s recompute
candidates and SBP's recomputed kept path all plan with these prices, so they agree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

COST_MODELS = ("roofline", "measured", "flops")


@dataclass(frozen=True)
class DeviceProfile:
    """Throughputs a roofline needs, and the host time of a launch and of a segment.

    ``flops_half``: dense bf16/fp16 multiply-adds x 2 per second that convs and matmuls reach
    (not the datasheet's peak); ``flops_fp32`` the same in fp32 (TF32 on NVIDIA); ``bandwidth``
    bytes per second an elementwise kernel reaches; ``op_s`` the least an op costs (a kernel
    launch on a GPU, the dispatcher on a CPU); ``segment_s`` the host time one recomputed
    segment adds to a step (measured: about 0.3 ms on an H200 host, docs/design §9)."""

    name: str
    flops_fp32: float
    flops_half: float
    bandwidth: float
    op_s: float
    segment_s: float

    def seconds(self, flops: float, bytes_moved: float, half: bool,
                measured_s: float | None = None) -> float:
        """A node's cost: the measured time when there is one, else the roofline (compute- or
        bandwidth-bound); never less than one launch."""
        if measured_s is not None:
            return max(measured_s, self.op_s)
        peak = self.flops_half if half else self.flops_fp32
        return max(flops / peak, bytes_moved / self.bandwidth, self.op_s)


PROFILES: dict[str, DeviceProfile] = {
    # two shared CPU cores (this project's CI): ~50 GFLOP/s fp32, ~8 GB/s streamed
    "cpu": DeviceProfile("cpu", 50e9, 25e9, 8e9, 5e-6, 50e-6),
    # NVIDIA H100 SXM: ~400 TFLOP/s bf16 reached by cuDNN convs, 3.35 TB/s HBM3 (~2.6 reached)
    "h100": DeviceProfile("h100", 200e12, 400e12, 2.6e12, 5e-6, 300e-6),
    # NVIDIA H200: the H100's compute, 4.8 TB/s HBM3e (~3.6 reached)
    "h200": DeviceProfile("h200", 200e12, 400e12, 3.6e12, 5e-6, 300e-6),
    # any other CUDA device: an A100-like guess
    "cuda": DeviceProfile("cuda", 100e12, 200e12, 1.5e12, 5e-6, 300e-6),
}


def check_cost_model(name: str) -> str:
    """``name``, if it is one of :data:`COST_MODELS` (the one check of that choice)."""
    if name not in COST_MODELS:
        raise ValueError(f"cost_model must be one of {', '.join(COST_MODELS)}; got {name!r}")
    return name


def check_profile_name(name: str) -> str:
    """``name``, if it is ``auto`` or one of :data:`PROFILES` (the one check of that choice)."""
    if name != "auto" and name not in PROFILES:
        raise ValueError(f"device_profile must be auto or one of {', '.join(PROFILES)}; got {name!r}")
    return name


def profile_for(device: torch.device | str, name: str = "auto") -> DeviceProfile:
    """The named profile, or (``auto``) the one of ``device``: a CUDA device by its name
    (``H100``/``H200`` in it), else ``cuda``; anything else ``cpu``."""
    if check_profile_name(name) != "auto":
        return PROFILES[name]
    device = torch.device(device)
    if device.type != "cuda":
        return PROFILES["cpu"]
    gpu = torch.cuda.get_device_name(device).lower() if torch.cuda.is_available() else ""
    return next((PROFILES[k] for k in ("h200", "h100") if k in gpu), PROFILES["cuda"])


def time_call(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median seconds of ``fn()`` on ``device`` after one warm-up call: CUDA events on a GPU
    (device time, what the kernels take), ``perf_counter`` on anything else."""
    fn()
    times: list[float] = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
