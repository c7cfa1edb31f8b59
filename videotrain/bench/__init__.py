"""Cost benchmark of the memory strategies (design §3): ``python -m videotrain.bench``.

Each configuration (a *row*) runs in a fresh subprocess on the same model config and the same
synthetic batch, and reports peak training-step memory, median step time after warm-up,
clips/s and the bytes of activations saved for backward, each also as a ratio to the e2e row
of the same backbone in the same run. Suites are lists of row specs in ``suites.py``, each
run at its own setting unless the command line says otherwise (``suites.setting_for``).
The GPU suite (``--suite gpu``) is the acceptance run on a CUDA machine: resnet50 + transformer
head, B=8 x T=16 at 224 px in bf16, written to ``outputs/bench/gpu/<gpu name>/`` unless
``--out`` names another folder; without CUDA it exits at once (status 2) with one line.

The lab's suites (data loaders, annotation files, accuracy, torch's ``sac_milp`` planner as a
peer of the recomputation rows) are not part of the package: they live beside it in the
repository's ``benchmarks/`` folder, each with its own entry point (``python -m
benchmarks.data``, ``python -m benchmarks.annotations``, ``python -m benchmarks.sac_milp``).
"""

from videotrain.bench.child import synthetic_batch
from videotrain.bench.cli import main, run_bench
from videotrain.bench.suites import SUITES, row

__all__ = ["SUITES", "main", "row", "run_bench", "synthetic_batch"]
