"""The video classifier: a per-frame backbone, a memory strategy, and a temporal head."""

from __future__ import annotations

import torch
from torch import nn

from videotrain.memory.base import MemoryStrategy, encode_all_frames
from videotrain.memory.e2e import EndToEnd
from videotrain.models.backbones import FrameBackbone
from videotrain.simulate.step import eval_chunk


class VideoClassifier(nn.Module):
    """``(B, T, C, H, W) -> (B, K)``.

    In training with autograd on, the strategy decides how the backbone runs (and how much
    activation memory that costs); in eval mode or under ``no_grad`` every frame is encoded
    plainly, so all strategies agree at test time.
    """

    def __init__(
        self, backbone: FrameBackbone, head: nn.Module, strategy: MemoryStrategy | None = None
    ) -> None:
        super().__init__()
        self.strategy = strategy or EndToEnd()
        self.backbone = self.strategy.prepare(backbone)
        self.head = head
        # evaluation in frame chunks (``eval.frame_chunk``): None (all frames at once), a number
        # of frames, or "auto": as many as keep the forward within ``eval_memory_budget`` bytes
        # (the training step's peak: the trainer sets it from its measured steps)
        self.eval_frame_chunk: int | str | None = None
        self.eval_memory_budget: float | None = None
        self._chunks: dict[tuple, int] = {}  # (video shape, dtype, device, budget) -> chunk
        # model.freeze_backbone (videotrain.models.finetune): the backbone runs without autograd
        # and in eval mode (BatchNorm statistics fixed); the memory strategy has nothing to save
        self.backbone_frozen = False

    def train(self, mode: bool = True) -> VideoClassifier:
        super().train(mode)
        if self.backbone_frozen:
            self.backbone.eval()
        return self

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        if video.dim() != 5:
            raise ValueError(f"expected video (B, T, C, H, W), got shape {tuple(video.shape)}")
        max_frames = getattr(self.head, "max_frames", None)  # heads with position embeddings
        if max_frames is not None and video.shape[1] > max_frames:
            raise ValueError(f"a clip of {video.shape[1]} frames has frame positions up to "
                             f"{video.shape[1] - 1}, but model.head.max_frames={max_frames}")
        if self.backbone_frozen:
            with torch.no_grad():
                out = encode_all_frames(self.backbone, video, self.frame_chunk(video))
        elif self.training and torch.is_grad_enabled():
            out = self.strategy.encode(self.backbone, video)
        else:
            out = encode_all_frames(self.backbone, video, self.frame_chunk(video))
        return self.head(out.features, out.positions)  # (B, T', D), (B, T') -> (B, K)

    def frame_chunk(self, video: torch.Tensor) -> int | None:
        """Frames per backbone forward in evaluation (see ``eval_frame_chunk``); the "auto"
        size is the most frames whose no-grad forward stays within the budget, searched on fake
        tensors once per frame shape, precision, budget and batch."""
        if self.eval_frame_chunk != "auto":
            return self.eval_frame_chunk
        if self.eval_memory_budget is None or torch.is_grad_enabled():
            return None
        dtype = torch.get_autocast_dtype(video.device.type) if torch.is_autocast_enabled(
            video.device.type) else None
        key = (tuple(video.shape), dtype, video.device.type, self.eval_memory_budget)
        if key not in self._chunks:
            self._chunks[key] = eval_chunk(self, key[0], self.eval_memory_budget, dtype)
        return self._chunks[key]
