"""``memory=auto``: give it a memory budget, get the best training plan that fits.

- ``candidates.py``: the candidate plans (e2e, recomputation, SBP at every keep ratio, SBP with
  recomputation or frozen BN, frame dropout when allowed), their ranking (expected accuracy
  first, then fixed relative costs) and the decision table.
- ``choice.py``: the choice, one walk down the ranking, each family bisected, every candidate
  reached estimated on fake tensors at full size (as ``plan --fit`` estimates a row).
- ``strategy.py``: ``AutoStrategy``: plans before training, swaps the concrete strategy in, and
  steps down to the next plan if a measured step exceeds the budget.
"""

from videotrain.memory.auto.candidates import NoPlanFits
from videotrain.memory.auto.strategy import AutoStrategy

__all__ = ["AutoStrategy", "NoPlanFits"]
