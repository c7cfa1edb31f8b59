"""``memory=auto``: give it a memory budget, get the fastest training plan that fits.

- ``profile.py``: ``StepProbe``, real training steps of the configured model and batch on a
  copy of the model, measured with the trainer's own peak meter (``Profile``).
- ``candidates.py``: the candidate plans (e2e, recomputation, SBP at every keep ratio, SBP with
  recomputation or frozen BN, frame dropout when allowed), their peak and step time estimated
  from a profile (or none yet, to be simulated), their ranking (best expected accuracy first,
  fastest among equals) and the decision table.
- ``choice.py``: the choice, one walk down the ranking with two evaluators: ``MeasuredPeaks``
  (profiled peaks and profiling steps) and ``SimulatedPeaks`` (each candidate's step simulated at
  full size on fake tensors, ``videotrain.simulate``; each family bisected).
- ``strategy.py``: ``AutoStrategy``: plans before training, verifies the choice, swaps the
  concrete strategy in, and steps down to the next plan if a step exceeds the budget.
"""

from videotrain.memory.auto.candidates import NoPlanFits
from videotrain.memory.auto.strategy import AutoStrategy

__all__ = ["AutoStrategy", "NoPlanFits"]
