"""Memory strategies: how gradients flow through the per-frame backbone in training.

A strategy is chosen by ``memory=NAME`` and only changes the training forward
(``MemoryStrategy.encode``); evaluation is the same plain forward for all of them.

The names are written once, in ``registry.py``; ``base.py`` is the seam every strategy
implements. The families: ``e2e.py`` (the reference), ``frame_dropout.py``, ``sbp/``
(Stochastic Backpropagation), ``recompute/`` (recomputation: the backbone's fx graph, the
planner, the executor) and ``auto/`` (a budget in, the best plan that fits out); ``sampling.py``
is the frame sampler they share, ``estimate.py`` a training step on fake tensors. Each strategy:
``docs/memory.md``; each module: ``docs/layout.md``.
"""

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
