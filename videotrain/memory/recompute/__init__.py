"""``memory=recompute``'s public names (the modules: ``docs/layout.md``; the strategy:
``strategy.py``). ``python -m videotrain.plan`` prints a plan without running any activation."""

from videotrain.memory.recompute.planner import InfeasibleBudget
from videotrain.memory.recompute.strategy import Recompute

__all__ = ["InfeasibleBudget", "Recompute"]
