"""Run by tests/memory/test_compiled.py in a fresh process (not collected by pytest).

The CPU step peak is the resident set's (``metrics.memory.StepPeakMemory``), which reads high in
a process where ``keep_freed_memory`` ran (any in-process ``run.train``: the trainer calls it
after its metered steps), as it may have in a test worker. Here nothing else ran: for each
strategy named, the eager and compiled models of ``test_compiled.pair`` train side by side and
the median step peaks after the warm-up are printed, one JSON object.
Usage: ``python tests/memory/compiled_peaks_worker.py NAME [NAME ...]``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conftest  # noqa: E402  (tests/memory/conftest.py: the kit)
import test_compiled as tc  # noqa: E402

KIT = SimpleNamespace(**{k: v for k, v in vars(conftest).items()
                         if not k.startswith("_") and k not in ("pytest", "kit")})


def main(names: list[str]) -> None:
    peaks: dict[str, dict[str, float]] = {}
    for name in names:
        torch._dynamo.reset()
        kind = tc.STRATEGIES[name][0]
        got = tc.train(list(tc.pair(KIT, name)), tc.WARMUP + tc.STEPS, tc.PX[kind], tc.FRAMES[kind])
        peaks[name] = {"eager": statistics.median(p[0] for p in got["peak"][tc.WARMUP:]),
                       "compiled": statistics.median(p[1] for p in got["peak"][tc.WARMUP:])}
    print(json.dumps(peaks))


if __name__ == "__main__":
    main(sys.argv[1:])
