"""How a training step's arithmetic runs: autocast and the GradScaler (``trainer.precision``),
and which CPU kernels compute convolution backwards (``trainer.cpu_conv_backward``, see
``videotrain.engine.conv_backward``). The trainer, ``memory=auto``'s profiling steps and the
benchmark all go through ``Precision.autocast`` and ``Precision.backward``, so the steps they
measure are computed alike."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from videotrain.engine.conv_backward import check_policy, conv_backward_kernels

PRECISIONS = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


class Precision:
    """``32`` (no autocast), ``bf16`` (CPU and CUDA) or ``16`` (CUDA, with loss scaling).

    fp16 needs a GradScaler because its small exponent range underflows gradients; bf16 has
    fp32's range, so it needs none. On CPU, fp16 autocast is refused rather than silently
    slow and unscaled. ``cpu_conv_backward`` (``onednn`` | ``lean``) picks the CPU kernels of
    fp32 convolution backwards, recorded in the forward (``autocast``); see
    ``videotrain.engine.conv_backward``.
    """

    def __init__(self, precision: str | int, device: torch.device,
                 cpu_conv_backward: str = "onednn") -> None:
        key = str(precision)
        if key not in PRECISIONS:
            raise ValueError(f"trainer.precision must be one of 32, bf16, 16; got {precision!r}")
        if key == "16" and device.type != "cuda":
            raise ValueError("trainer.precision=16 needs CUDA; use trainer.precision=bf16 on CPU")
        self.key, self.dtype, self.device = key, PRECISIONS[key], device
        self.scaler = torch.amp.GradScaler(device.type, enabled=key == "16")
        self.cpu_conv_backward = check_policy(cpu_conv_backward)

    @classmethod
    def from_config(cls, trainer: Any, device: torch.device) -> Precision:
        """From the ``trainer`` config group (``precision``, ``cpu_conv_backward``): the one place
        the trainer, ``memory=auto``'s planner and the benchmark read them, so their steps match."""
        return cls(trainer.precision, device, trainer.cpu_conv_backward)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context of a forward pass: autocast, or in fp32 the CPU convolution-backward
        policy (which records the kernels the backward will run)."""
        if self.dtype is None:
            return conv_backward_kernels(self.cpu_conv_backward, self.device)
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler | None = None) -> None:
        """``scaler.scale(loss).backward()`` (default: this run's scaler)."""
        (scaler or self.scaler).scale(loss).backward()
