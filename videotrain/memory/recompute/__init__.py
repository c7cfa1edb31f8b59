"""``memory=recompute``: recomputation (Chen et al. 2016; Kusumoto et al., NeurIPS 2019).

Only some activations are kept in the forward; the rest are recomputed in backward, so the
gradients equal e2e's exactly and the price is extra forward compute.

- ``strategy.py``: ``Recompute``, the strategy and its policies (``blocks``: recompute each
  residual / encoder block; ``sqrt``: Chen's segments at articulation points; ``optimal``:
  the lower-set plan for a budget).
- ``graph.py``: the backbone as a DAG of intermediate tensors (fx trace, shape propagation,
  saved bytes per node), rewritten without in-place ops so that any cut is legal.
- ``planner.py``: the planners (exact and approximate lower-set DP, ``sqrt_plan``) and the
  push-aware peak model they optimise.
- ``execute.py``: the checkpointed call (non-reentrant ``torch.utils.checkpoint`` that frees
  its inputs after the recompute, leaves BN running statistics alone and replays the
  forward's contexts).

``python -m videotrain.plan`` prints a plan without running any activation.
"""

from videotrain.memory.recompute.planner import InfeasibleBudget
from videotrain.memory.recompute.strategy import Recompute

__all__ = ["InfeasibleBudget", "Recompute"]
