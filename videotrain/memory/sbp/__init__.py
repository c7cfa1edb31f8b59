"""``memory=sbp``: Stochastic Backpropagation (Cheng et al., CVPR 2022).

The forward pass covers every frame; the backward pass runs through the backbone for a random
subset of frames per clip, and the other frames' activations are never stored.

- ``strategy.py``: ``StochasticBackprop``, the options, and which implementation runs.
- ``split.py``: the split primitive (kept rows with autograd, dropped rows under ``no_grad``)
  and the *record/apply* full-batch BatchNorm: record every BN's batch statistics over all
  frames without grad, then rerun the kept frames normalised with them.
- ``lockstep.py``: full-batch BatchNorm in *one* forward: the fx-traced backbone runs kept and
  dropped frames side by side and meets them at every BN.
- ``blocks.py``: block granularity (the paper's graph model): split each residual branch.

Which full-batch BN implementation runs is decided per step, automatically: *lockstep*
whenever it can (frame granularity, a backbone ``torch.fx`` traces, no checkpointing of the
kept path), because it runs each frame's layers once; *record/apply* otherwise (block
granularity, ``memory.checkpoint=...``, an untraceable backbone). Both give the same values,
statistics and gradients (tested against each other). ``memory.lockstep=false`` forces
record/apply, for comparison. Without train-mode BN (ViTs, ``bn_policy=frozen``) neither is
needed and the dropped frames run in chunks.
"""

from videotrain.memory.sbp.strategy import StochasticBackprop

__all__ = ["StochasticBackprop"]
