"""Memory strategies: how gradients flow through the per-frame backbone in training
(``memory=NAME``, named once in ``registry.py``; ``base.py`` is the seam). Each strategy:
``docs/memory.md``; each module: ``docs/layout.md``."""

from videotrain.memory.base import FrameFeatures, MemoryStrategy, encode_all_frames
from videotrain.memory.e2e import EndToEnd
from videotrain.memory.frame_dropout import FrameDropout
from videotrain.memory.recompute import Recompute
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
