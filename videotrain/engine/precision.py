"""Mixed precision: one autocast context and one GradScaler, chosen by ``trainer.precision``."""

from __future__ import annotations

import contextlib

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

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)
