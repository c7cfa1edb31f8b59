"""A configured run's training step simulated on fake tensors, no device (the config layer).

- ``config_run.py``: a configured run's step (``simulate_cfg``), in processes of their own
  (``run_isolated``), and ``memory=auto``'s estimator (``ConfigEstimator``). It builds the model
  with ``build`` and counts its step with ``videotrain.memory.simulate`` (the step on fake
  tensors, a part of ``memory/``, below the models that use its ``eval_chunk``).

Nothing is imported here: ``config_run`` imports ``build``; ``build`` does not import it (the
commands pass ``ConfigEstimator`` into ``build.plan_memory``).
"""
