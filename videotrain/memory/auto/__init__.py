"""``memory=auto``'s public names (the modules: ``docs/layout.md``; the strategy:
``strategy.py``)."""

from videotrain.memory.auto.candidates import NoPlanFits
from videotrain.memory.auto.strategy import AutoStrategy

__all__ = ["AutoStrategy", "NoPlanFits"]
