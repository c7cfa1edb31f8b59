"""How a training step's arithmetic runs: autocast and the GradScaler (``trainer.precision``).
The trainer, ``memory=auto``'s profiling steps and the benchmark all go through
``Precision.autocast`` and ``Precision.backward``, so the steps they measure are computed alike."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

PRECISIONS = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


class Precision:
    """``32`` (no autocast), ``bf16`` (CPU and CUDA) or ``16`` (CUDA, with loss scaling).

    fp16 needs a GradScaler because its small exponent range underflows gradients; bf16 has
    fp32's range, so it needs none. On CPU, fp16 autocast is refused rather than silently
    slow and unscaled.
    """

    def __init__(self, precision: str | int, device: torch.device) -> None:
        key = str(precision)
        if key not in PRECISIONS:
            raise ValueError(f"trainer.precision must be one of 32, bf16, 16; got {precision!r}")
        if key == "16" and device.type != "cuda":
            raise ValueError("trainer.precision=16 needs CUDA; use trainer.precision=bf16 on CPU")
        self.key, self.dtype, self.device = key, PRECISIONS[key], device
        self.scaler = torch.amp.GradScaler(device.type, enabled=key == "16")

    @classmethod
    def from_config(cls, trainer: Any, device: torch.device) -> Precision:
        """From the ``trainer`` config group: the one place the trainer, ``memory=auto``'s
        planner, evaluation and the benchmark read it, so their steps match."""
        return cls(trainer.precision, device)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context of a forward pass: autocast to ``dtype``, or nothing in fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler | None = None) -> None:
        """``scaler.scale(loss).backward()`` (default: this run's scaler)."""
        (scaler or self.scaler).scale(loss).backward()
