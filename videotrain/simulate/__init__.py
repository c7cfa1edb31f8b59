"""Simulated training steps: what a step would allocate, counted on fake tensors, no device.

- ``step.py``: a model's training step and validation forward on fake tensors, counted
  (``simulate_step``, ``StepMemory``), and the evaluation's frame chunk (``eval_chunk``, which
  ``models/video.py`` uses); it imports nothing of videotrain but ``metrics.live_bytes``.
- ``config_run.py``: a configured run's step (``simulate_cfg``), in processes of their own
  (``run_isolated``), and ``memory=auto``'s predictor (``ConfigPredictor``).

Nothing is imported here: ``config_run`` imports ``build``, which the model package reaches.
"""
