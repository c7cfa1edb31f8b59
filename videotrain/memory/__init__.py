"""Memory strategies: how gradients flow through the per-frame backbone in training.

A strategy is chosen by ``memory=NAME`` and only changes the training forward
(``MemoryStrategy.encode``); evaluation is the same plain forward for all of them.

Where each family lives:

- ``registry.py``: the strategies named once (``memory=NAME`` -> class, one line each), which
  the config schema, the check of configs read from files and ``memory=auto`` read.
- ``base.py``: the seam (``MemoryStrategy``, ``FrameFeatures``, optional ``StepObserver`` and
  ``SelfPlanning``) and ``encode_all_frames``, the forward every strategy evaluates with.
- ``e2e.py``: ``memory=e2e``, plain backpropagation through every frame (the reference).
- ``frame_dropout.py``: ``memory=frame_dropout``, train on a random subset of frames.
- ``sampling.py``: the frame sampler shared by frame dropout, SBP and ``memory=auto``.
- ``sbp/``: ``memory=sbp``, Stochastic Backpropagation (forward over every frame, backward
  through a random subset).
- ``recompute/``: ``memory=recompute``, recomputation: the fx graph of the backbone, the
  Kusumoto / Chen planner, and the recomputing executor (``torch.utils.checkpoint``).
- ``auto/``: ``memory=auto``, give it a budget and it profiles, estimates and picks the fastest
  plan of the families above that fits.

``docs/memory.md`` describes each strategy's semantics and its measured cost.
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
