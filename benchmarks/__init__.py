"""The lab beside the library: benchmark suites that are not part of the ``videotrain`` wheel.

Each suite is a module with its own small command line, run from the repository root:

- ``python -m benchmarks.data``: decoded and transformed clips/s of the data loaders
  (``data.py``, the child side in ``data_child.py``, the tables in ``data_report.py``) on
  Kinetics-like and SSv2-like videos generated once (``clips.py``);
- ``python -m benchmarks.annotations``: what a training start pays to read the official
  annotation files at their real sizes (``annotations.py``);
- ``python -m benchmarks.sac_milp``: torch's sac_milp checkpointing planner (``sac_peer.py``)
  as a peer of the recomputation rows, through the cost benchmark's runner (``sac_milp.py``);
- the accuracy sweep, an ordinary Hydra multirun over ``conf/`` (``python -m videotrain -m
  --config-dir benchmarks/conf +sweep=accuracy``; at equal time ``python -m
  benchmarks.equal_time``), summarised by ``scripts/summarize_sweep.py``.

They write under ``outputs/`` by default; the published tables under ``docs/results/`` are
written only when ``--out`` names them. The strategies' cost benchmark on a user's own config
stays in the package: ``python -m videotrain.bench``.
"""
