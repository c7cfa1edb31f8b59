"""Run under torchrun by tests/test_distributed.py (not collected by pytest).

Tiny DDP runs with ``trainer.compile=true`` (the compiler's ``aot_eager`` backend: the C++
compiler inductor would call is not what is tested here), one per strategy in ``strategies``,
each also with ``trainer.compile=false``. Rank 0 writes ``compile.json``: per run, every rank's
count of frames compiled since the run began, after each optimizer step.
Usage: ``torchrun --standalone --nproc_per_node=2 tests/ddp_compile_worker.py SPEC_JSON``.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

import videotrain.engine.trainer as trainer_module
import videotrain.run as run
from videotrain.engine import distributed
from videotrain.engine.distributed import Comm
from videotrain.engine.trainer import Trainer
from videotrain.memory.compiled import Compiler, compile_counts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_worker import compose_cfg, merge  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    out, base = Path(spec["out"]), spec["overrides"]
    ctx, owns = distributed.init_from_env()
    comm = Comm(ctx)
    trainer_module.Compiler = functools.partial(Compiler, backend="aot_eager")
    real_step = Trainer._optimizer_step
    frames: list[int] = []
    start = [0]

    def counted(self):
        grad_norm = real_step(self)
        frames.append(compile_counts()["frames"] - start[0])
        return grad_norm

    Trainer._optimizer_step = counted
    counts: dict[str, list[list[int]]] = {}
    for name, overrides in spec["strategies"].items():
        for compiled in (False, True):
            torch._dynamo.reset()
            frames.clear()
            start[0] = compile_counts()["frames"]
            key = f"{name}_{'compiled' if compiled else 'eager'}"
            run.train(compose_cfg(merge(base, [*overrides, f"trainer.compile={str(compiled).lower()}"])),
                      out / key)
            counts[key] = comm.all_gather(list(frames))
    if ctx.is_main:
        (out / "compile.json").write_text(json.dumps(counts))
    comm.barrier()
    if owns:
        distributed.shutdown()


if __name__ == "__main__":
    main()
