"""The video classifier: a per-frame backbone, a memory strategy, and a temporal head."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from videotrain.memory.base import MemoryStrategy, encode_all_frames
from videotrain.memory.e2e import EndToEnd
from videotrain.memory.estimate import eval_chunk
from videotrain.models.backbones import FrameBackbone


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
        # trainer.channels_last (``use_channels_last``): the backbone's weights, and every clip
        # it sees, in channels_last, so cuDNN's NHWC kernels run without transposes
        self.channels_last = False

    def use_channels_last(self, on: bool = True) -> VideoClassifier:
        """Put the backbone's 4-D weights in channels_last (NHWC) and lay out every clip
        per frame likewise (``frames_channels_last``) in training and evaluation; ``False``
        puts them back in the contiguous (NCHW) format."""
        fmt = torch.channels_last if on else torch.contiguous_format
        if not any(is_fake(p) for p in self.backbone.parameters()):
            # a model built on fake tensors (memory/simulate.py, to count memory) cannot swap its
            # parameters; the layout changes no byte count, so its weights stay as they are
            self.backbone.to(memory_format=fmt)
        self.channels_last = on
        return self

    def train(self, mode: bool = True) -> VideoClassifier:
        super().train(mode)
        if self.backbone_frozen:
            self.backbone.eval()
        return self

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        if video.dim() != 5:
            raise ValueError(f"expected video (B, T, C, H, W), got shape {tuple(video.shape)}")
        if not video.is_floating_point():  # e.g. a loader's uint8 batch fed as it comes
            raise TypeError(f"expected normalized float clips, got {video.dtype}: a loader's uint8 "
                            "clips go through videotrain.data.transforms.clips_to_device first")
        max_frames = getattr(self.head, "max_frames", None)  # heads with position embeddings
        if max_frames is not None and video.shape[1] > max_frames:
            raise ValueError(f"a clip of {video.shape[1]} frames has frame positions up to "
                             f"{video.shape[1] - 1}, but model.head.max_frames={max_frames}")
        # the layout the backbone runs in is the model's (``use_channels_last``), whatever the
        # caller's: decoded clips come per-frame channels_last, and a CPU conv fed one runs NHWC
        video = frames_channels_last(video) if self.channels_last else video.contiguous()
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


def frames_channels_last(video: torch.Tensor) -> torch.Tensor:
    """``video (B, T, C, H, W)`` laid out so that every frame is channels_last (C innermost):
    ``video.flatten(0, 1)`` is then a ``(B*T, C, H, W)`` channels_last view, and so is any
    frame or set of frames taken from it. A clip already in that layout is returned as is."""
    b, t, c, h, w = video.shape
    if video.stride() == (t * h * w * c, h * w * c, 1, w * c, c):
        return video
    return video.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)


def is_conv_backbone(backbone: nn.Module) -> bool:
    """More than one 2-D convolution (a ViT's patch embedding alone does not count): the
    backbones channels_last speeds up."""
    return sum(isinstance(m, nn.Conv2d) for m in backbone.modules()) > 1


def wants_channels_last(setting: bool | str, device_type: str, backbone: nn.Module) -> bool:
    """``trainer.channels_last``: true / false force it; ``auto`` is on for a convolutional
    backbone on CUDA, off otherwise (on a CPU the NCHW kernels are the tuned ones)."""
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"trainer.channels_last must be auto, true or false, got {setting!r}")
    return device_type == "cuda" and is_conv_backbone(backbone)
