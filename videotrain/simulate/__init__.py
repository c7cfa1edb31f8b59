"""Simulated training steps: what a step would allocate, counted on fake tensors, no device.

- ``config_run.py``: a configured run's step (``simulate_cfg``), in processes of their own
  (``run_isolated``), and ``memory=auto``'s predictor (``ConfigPredictor``).

Nothing is imported here: ``config_run`` imports ``build``, which the model package reaches.
"""
