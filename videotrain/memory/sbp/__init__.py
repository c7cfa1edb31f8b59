"""``memory=sbp``'s public names (the modules: ``docs/layout.md``; the strategy and which
implementation runs: ``strategy.py``)."""

from videotrain.memory.sbp.strategy import StochasticBackprop

__all__ = ["StochasticBackprop"]
