"""``memory=sbp``: Stochastic Backpropagation (Cheng et al., CVPR 2022).

The forward pass covers every frame; the backward pass runs through the backbone for a random
subset of frames per clip, and the other frames' activations are never stored.

- ``strategy.py``: ``StochasticBackprop``, the options, and which implementation runs.
- ``lockstep.py``: the implementation: the fx-traced backbone rewritten once into code with kept
  and dropped twins of every op (two contiguous row blocks), meeting at every training-mode BN
  (one native BN kernel over all rows) and at TSM's temporal shift.
- ``kept_rows.py``: the kept rows' autograd beside a conv, BN or add+ReLU run on all rows (the
  kept-rows BN backward, shared by both implementations).
- ``split.py``: record/apply, where the lockstep code cannot run (the kept path recomputed, an
  untraceable backbone, the dropped frames in ``no_grad`` chunks): the split primitive and the
  full-batch BN that records every BN's statistics over all frames, then reruns the kept frames
  normalised with them.
"""

from videotrain.memory.sbp.strategy import StochasticBackprop

__all__ = ["StochasticBackprop"]
