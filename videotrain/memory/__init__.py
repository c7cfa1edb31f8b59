"""Memory strategies: how gradients flow through the per-frame backbone in training."""

from videotrain.memory.base import FrameFeatures, MemoryStrategy, encode_all_frames
from videotrain.memory.checkpoint import Recompute
from videotrain.memory.e2e import EndToEnd
from videotrain.memory.frame_dropout import FrameDropout
from videotrain.memory.sampling import FrameSampler, n_keep
from videotrain.memory.sbp import StochasticBackprop

__all__ = [
    "EndToEnd",
    "FrameDropout",
    "FrameFeatures",
    "FrameSampler",
    "MemoryStrategy",
    "Recompute",
    "StochasticBackprop",
    "encode_all_frames",
    "n_keep",
]
