"""The memory-strategy seam: how the backbone is run over the frames of a clip in training.

``prepare`` may wrap the backbone's blocks once; ``encode`` runs the backbone over a clip and
returns per-frame features with the *positions* of their frames, so a strategy that drops
frames hands the head a subset without lying about time. The model calls ``encode`` only in
training with autograd on; evaluation and ``no_grad`` always use ``encode_all_frames``, so the
strategies are identical at test time and the trainer's loop never branches on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@dataclass
class FrameFeatures:
    features: torch.Tensor  # (B, T', D)
    positions: torch.Tensor  # (B, T') long: frame index of each feature in the clip


@runtime_checkable
class MemoryStrategy(Protocol):
    name: str

    def prepare(self, backbone: nn.Module) -> nn.Module: ...

    def encode(self, backbone: nn.Module, video: torch.Tensor) -> FrameFeatures: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def describe(self) -> dict[str, Any]: ...


@runtime_checkable
class StepObserver(Protocol):
    """Optional: a strategy that watches each optimizer step's measured peak (MB, the trainer's
    ``peak_mem_mb``). The trainer calls it for any strategy that has it, so the loop never
    branches on which strategy runs; ``memory=auto`` uses it to re-check its plan."""

    def observe_step(self, step: int, peak_mb: float) -> None: ...


@runtime_checkable
class CompilesItself(Protocol):
    """Optional: a strategy that runs code other than the backbone module in training (SBP's
    generated code, recomputed segments) compiles it itself under ``trainer.compile``
    (``videotrain.memory.compiled``); ``compiler(module)`` compiles a module in place,
    ``compiler.function(fn)`` a callable. Without the hook the backbone module is compiled."""

    def compile(self, backbone: nn.Module, compiler: Any) -> None: ...


@runtime_checkable
class SelfPlanning(Protocol):
    """Optional: a strategy that chooses itself before training (``memory=auto``), from
    fake-tensor estimates of the configured run at full size. ``videotrain.config.build.plan_memory``
    hands it an estimator and records ``plan_report()`` in results.json as ``memory_plan``."""

    def plan(self, estimate: Any, num_frames: int, device: torch.device) -> dict[str, Any]: ...

    def plan_report(self) -> dict[str, Any]: ...


def all_positions(video: torch.Tensor) -> torch.Tensor:
    """Positions ``0..T-1`` for every clip of a ``(B, T, C, H, W)`` batch -> ``(B, T)``."""
    b, t = video.shape[:2]
    return torch.arange(t, device=video.device).expand(b, t)


def mixes_frames(backbone: nn.Module) -> bool:
    """Whether the frames of a clip interact inside ``backbone`` (TSM's temporal shift,
    ``FrameBackbone.mixes_frames``): it must then see whole clips, in time order."""
    return bool(getattr(backbone, "mixes_frames", False))


def set_clip_length(backbone: nn.Module, num_frames: int) -> None:
    """Tell ``backbone`` how many frames per clip its next calls get (``N = B * num_frames``):
    every strategy calls it before the backbone, with the frames the backbone actually sees.
    Backbones without the contract's ``set_clip_length`` ignore it."""
    setter = getattr(backbone, "set_clip_length", None)
    if callable(setter):
        setter(int(num_frames))


def encode_all_frames(backbone: nn.Module, video: torch.Tensor,
                      chunk: int | None = None) -> FrameFeatures:
    """Run the backbone on every frame as one batch of images: ``(B, T, ...) -> (B, T, D)``.

    Under ``no_grad`` with ``chunk``, the frames go through in chunks of ``chunk`` (frames are
    independent in eval mode), so the forward's transient memory is a chunk's, not the whole
    batch's; the features are written into one output, in order. A backbone that mixes frames
    (temporal shift) gets whole clips: ``chunk`` is rounded down to a multiple of ``T`` (at
    least one clip)."""
    b, t = video.shape[:2]
    frames = video.flatten(0, 1)  # (B*T, C, H, W)
    n = frames.shape[0]
    set_clip_length(backbone, t)
    if chunk and mixes_frames(backbone):
        chunk = max(t, chunk // t * t)
    if not chunk or chunk >= n or torch.is_grad_enabled():
        feats = backbone(frames)  # (B*T, D)
    else:
        first = backbone(frames[:chunk])
        feats = first.new_empty((n, *first.shape[1:]))
        feats[:chunk] = first
        del first
        for start in range(chunk, n, chunk):
            feats[start:start + chunk] = backbone(frames[start:start + chunk])
    return FrameFeatures(feats.view(b, t, -1), all_positions(video))


class StatelessStrategy:
    """Defaults for strategies that keep no RNG or other state between steps."""

    name = "base"

    def prepare(self, backbone: nn.Module) -> nn.Module:
        return backbone

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name}
