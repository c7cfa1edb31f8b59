"""``memory=frame_dropout``: train on a random subset of frames; the rest are never computed.

The SBP paper's "Frame Dropout" baseline: each training clip keeps ``n_keep`` frames, and the
head sees only those, at their true positions (a train/test gap for temporal heads; evaluation
uses all frames). Invariants: one backbone pass per step over the kept frames (BN statistics
are theirs, running statistics update once); ``keep_ratio=1`` is exactly e2e; a backbone that
mixes frames sees the kept frames as one clip in time order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from videotrain.memory.base import FrameFeatures, encode_all_frames, set_clip_length
from videotrain.memory.sampling import FrameSampler, SamplerStateMixin, n_keep


def gather_frames(video: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``video (B, T, ...)``, kept indices ``idx (B, n)`` -> kept frames ``(B, n, ...)``."""
    batch = torch.arange(video.shape[0], device=video.device)[:, None]  # (B, 1)
    return video[batch, idx]


class FrameDropout(SamplerStateMixin):
    """Keep a subset of frames per clip in training (evenly spaced with a random offset by
    default, as configs/memory/frame_dropout.yaml has it); see the module docstring.

    ``rank`` defaults to the ``RANK`` environment variable, so DDP ranks draw different masks.
    """

    name = "frame_dropout"

    def __init__(
        self, keep_ratio: float = 0.5, sampler: str = "uniform", seed: int = 0, rank: int | None = None
    ) -> None:
        n_keep(keep_ratio, 1)  # validates the ratio
        self.keep_ratio = float(keep_ratio)
        self.sampler = FrameSampler(sampler, seed, rank)
        self.last_keep: torch.Tensor | None = None  # (B, n) of the last step, for inspection

    def prepare(self, backbone: nn.Module) -> nn.Module:
        return backbone  # nothing to wrap: dropped frames are simply not computed

    def encode(self, backbone: nn.Module, video: torch.Tensor) -> FrameFeatures:
        """``video (B, T, C, H, W) -> features (B, n, D)`` at their positions ``(B, n)``."""
        if not (torch.is_grad_enabled() and backbone.training):
            return encode_all_frames(backbone, video)
        b, t = video.shape[:2]
        keep = n_keep(self.keep_ratio, t)
        if keep == t:
            return encode_all_frames(backbone, video)  # r=1: exactly e2e
        idx = self.sampler.sample(b, t, keep, video.device)  # (B, n) sorted
        self.last_keep = idx
        kept = gather_frames(video, idx)  # (B, n, C, H, W), in time order
        set_clip_length(backbone, keep)  # a temporal shift mixes the kept neighbours
        feats = backbone(kept.flatten(0, 1))  # (B*n, D)
        return FrameFeatures(feats.view(b, keep, -1), idx)

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "keep_ratio": self.keep_ratio,
            "sampler": self.sampler.kind,
            "seed": self.sampler.seed,
        }
