"""``memory=e2e``: plain backpropagation through every frame (the reference strategy)."""

from __future__ import annotations

import torch
from torch import nn

from videotrain.memory.base import FrameFeatures, StatelessStrategy, encode_all_frames


class EndToEnd(StatelessStrategy):
    """Every frame goes through the backbone with autograd; activations of all are stored."""

    name = "e2e"

    def encode(self, backbone: nn.Module, video: torch.Tensor) -> FrameFeatures:
        return encode_all_frames(backbone, video)  # video (B, T, C, H, W) -> (B, T, D)
