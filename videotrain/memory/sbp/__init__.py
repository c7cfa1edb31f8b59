"""``memory=sbp``: Stochastic Backpropagation (Cheng et al., CVPR 2022).

The forward pass covers every frame; the backward pass runs through the backbone for a random
subset of frames per clip, and the other frames' activations are never stored.

- ``strategy.py``: ``StochasticBackprop``, the options, and which implementation runs.
- ``split.py``: the split primitive (kept rows with autograd, dropped rows under ``no_grad``)
  and the *record/apply* full-batch BatchNorm: record every BN's batch statistics over all
  frames without grad, then rerun the kept frames normalised with them.
- ``lockstep.py``: frame granularity in *one* forward: the fx-traced backbone rewritten once into
  code with kept and dropped twins of every op (two contiguous row blocks), meeting at every
  training-mode BN (one native BN kernel over all rows) and at TSM's temporal shift.
- ``blocks.py``: block granularity (the paper's graph model): split each residual branch.

Frame granularity runs the lockstep code whenever it can (a backbone ``torch.fx`` traces, no
recomputation of the kept path, ``memory.lockstep=true``): with full-batch BN, with frozen BN
and on LayerNorm models alike (the plain scheme: dropped frames in one ``no_grad`` pass, kept
frames in one pass). Block granularity runs it per residual branch with full-batch BN.
Record/apply is the documented fallback for the rest (``memory.recompute=...``, an untraceable
backbone or branch, ``memory.lockstep=false``); both give the same values, statistics and
gradients (tested against each other).
"""

from videotrain.memory.sbp.strategy import StochasticBackprop

__all__ = ["StochasticBackprop"]
