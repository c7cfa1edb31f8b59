"""Memory strategies: how gradients flow through the per-frame backbone in training."""

from videotrain.memory.base import FrameFeatures, MemoryStrategy, encode_all_frames
from videotrain.memory.e2e import EndToEnd

__all__ = ["EndToEnd", "FrameFeatures", "MemoryStrategy", "encode_all_frames"]
