"""Run under torchrun by tests/test_distributed.py (not collected by pytest).

Several tiny DDP runs in one process group, so that the expensive part (starting processes,
importing torch) is paid once:

* ``sbp_a``: SBP, uninterrupted;
* ``sbp_b``: the same run, crashed on every rank at ``crash_at_step`` (after a checkpoint at
  an earlier step), then ``run.train`` again in the same directory: it must resume;
* ``sbp_c``: the same run, with a SIGTERM to rank 1 only during step ``crash_at_step``: every
  rank must stop after that step (``Preempted``), then resume;
* one short run per extra strategy in ``strategies`` (DDP must work with each).

Rank 0 writes ``checks.json`` into ``out``: per run, every rank's strategy rank and last mask.
Usage: ``torchrun --standalone --nproc_per_node=2 tests/ddp_worker.py SPEC_JSON``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

import videotrain.config.build as builder
import videotrain.run as run
from videotrain.engine import distributed
from videotrain.engine.distributed import Comm
from videotrain.engine.preempt import Preempted
from videotrain.engine.trainer import Trainer

LAST_TRAINER: list[Trainer] = []


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=builder.CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def merge(base: list[str], extra: list[str]) -> list[str]:
    """``base + extra``, where a backbone choice in ``extra`` drops the base's backbone keys."""
    if any(o.startswith("model/backbone=") for o in extra):
        base = [o for o in base if not o.startswith(("model/backbone=", "model.backbone."))]
    return [*base, *extra]


def strategy_probe(comm: Comm) -> list[dict]:
    """Every rank's strategy rank and the kept frames of its last SBP/frame-dropout step."""
    strategy = LAST_TRAINER[-1].strategy
    sampler = getattr(strategy, "sampler", None)
    last = getattr(strategy, "last_keep", None)
    mine = {"rank": comm.rank, "sampler_rank": None if sampler is None else sampler.rank,
            "last_keep": None if last is None else last.tolist()}
    return comm.all_gather(mine)


def main() -> None:
    spec = json.loads(sys.argv[1])
    out, base = Path(spec["out"]), spec["overrides"]
    ctx, owns = distributed.init_from_env()
    comm = Comm(ctx)
    real_fit, real_step = Trainer.fit, Trainer._optimizer_step

    def fit(self):  # remember the trainer, to look at its strategy afterwards
        LAST_TRAINER.append(self)
        return real_fit(self)

    Trainer.fit = fit
    checks: dict[str, list[dict]] = {}
    sbp = merge(base, spec["sbp_overrides"])

    run.train(compose_cfg(sbp), out / "sbp_a")
    checks["sbp_a"] = strategy_probe(comm)

    crash_at = spec["crash_at_step"]

    def crash(self):
        if self.state.step == crash_at - 1:  # on every rank, at the same step
            raise RuntimeError("simulated crash")
        return real_step(self)

    Trainer._optimizer_step = crash
    try:
        run.train(compose_cfg(sbp), out / "sbp_b")
        raise AssertionError("the simulated crash did not happen")
    except RuntimeError as err:
        assert "simulated crash" in str(err), err
    Trainer._optimizer_step = real_step
    crashed_ckpt = (out / "sbp_b" / "checkpoints" / "last.ckpt").exists()
    run.train(compose_cfg(sbp), out / "sbp_b")
    checks["sbp_b"] = strategy_probe(comm)

    def term_rank1(self):
        if self.state.step == crash_at - 1 and ctx.rank == 1:  # one rank gets the signal
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    Trainer._optimizer_step = term_rank1
    try:
        run.train(compose_cfg(sbp), out / "sbp_c")
        raise AssertionError("the SIGTERM did not stop training")
    except Preempted as stopped:
        preempted = comm.all_gather(stopped.step)  # the step each rank stopped after
    Trainer._optimizer_step = real_step
    run.train(compose_cfg(sbp), out / "sbp_c")

    for name, overrides in spec["strategies"].items():
        run.train(compose_cfg(merge(base, overrides)), out / name)
        checks[name] = strategy_probe(comm)

    # the reductions the trainer logs with, on values only some ranks have
    values = {"x": float(ctx.rank), "only_rank1": 3.0 if ctx.rank == 1 else None, "none": None}
    reduced = {op: comm.reduce(values, op) for op in ("mean", "max")}
    if ctx.is_main:
        (out / "checks.json").write_text(json.dumps(
            {"runs": checks, "crashed_ckpt": crashed_ckpt, "reduced": reduced,
             "preempted": preempted}))
    comm.barrier()
    if owns:
        distributed.shutdown()


if __name__ == "__main__":
    main()
