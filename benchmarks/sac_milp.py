"""torch's sac_milp planner as a peer of our recomputation rows: ``python -m benchmarks.sac_milp``
(from the repository root), each row in a fresh process like the cost benchmark's.

The rows are e2e ResNet-18 rows whose backbone torch's planner (``sac_peer.py``) checkpoints at a
fraction of its own e2e activation estimate (``peer``: 0.7, 0.5, or ``"min"``, the smallest it
solves), at the setting of ``python -m videotrain.bench --suite recompute``, so that the two
tables compare. ``videotrain.bench``'s runner runs them, with this module as the child
(``--child``): the package's row measurement, with ``prepare_row`` below applying the plan.
Needs ``pulp`` and ``pwlf``. Details: ``docs/benchmarks.md``, "torch's sac_milp planner".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.sac_peer import apply_sac_milp
from videotrain.bench import row, run_bench
from videotrain.bench.child import measure
from videotrain.bench.cli import NoRows, finish
from videotrain.bench.row_setup import prepare_row as bench_prepare_row
from videotrain.bench.spawn import child_reply
from videotrain.bench.suites import R18

REPO = Path(__file__).resolve().parent.parent  # the children import benchmarks from here
RESULTS = "outputs/bench_sac_milp"  # the default --out
SUITE = "sac_milp"  # the suite's name in bench.json

# ``peer``: torch's plan at this fraction of its e2e activation estimate, or "min"
ROWS = [
    *({**row(R18, "e2e"), "policy": "sac_milp", "budget_frac": f, "peer": f} for f in (0.7, 0.5)),
    {**row(R18, "e2e"), "policy": "sac_milp", "budget": "min", "peer": "min"},
]


def prepare_row(model: torch.nn.Module, cfg: Any, spec: dict[str, Any], device: torch.device,
                precision: Any) -> dict[str, Any]:
    """The package's ``prepare_row`` for a row without a ``peer``; for one with it, torch's plan
    applied to ``model``'s backbone in place, and the plan's figures."""
    if spec.get("peer") is None:
        return bench_prepare_row(model, cfg, spec, device, precision)
    from hydra.utils import instantiate

    shape = (spec["batch_size"] * spec["frames"], 3, spec["size"], spec["size"])
    return apply_sac_milp(model.backbone, lambda: instantiate(cfg.model.backbone), shape,
                          device, spec["peer"], precision.autocast,
                          bool(spec.get("free_grads", False)))


def measure_row(spec: dict[str, Any]) -> dict[str, Any]:
    """One row measured as ``videotrain.bench`` measures it, prepared by ``prepare_row``."""
    return measure(spec, prepare=prepare_row)


def child_main(spec_json: str) -> int:
    """Child side: measure one row (``spawn.child_reply``: one JSON line on stdout)."""
    return child_reply(measure_row, spec_json)


def run_sac_bench(rows: list[dict[str, Any]] | None = None,
                  **kwargs: Any) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """``videotrain.bench.run_bench`` over ``rows`` (default ``ROWS``; an e2e reference row is
    added) with this module's child; ``kwargs`` as ``run_bench`` takes them."""
    return run_bench(suite=SUITE, rows=ROWS if rows is None else rows,
                     child="benchmarks.sac_milp", child_path=REPO, **kwargs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sac_milp",
        description="torch's sac_milp activation-checkpointing planner on resnet18 at 0.7, 0.5 "
                    "and the smallest fraction of its e2e activation estimate it solves, each "
                    "row in a fresh process at the setting of videotrain.bench --suite "
                    "recompute. Run from the repository root.",
        epilog="Extra arguments are Hydra overrides applied to every row after its own, e.g. "
               "model/backbone=resnet10.")
    p.add_argument("--out", default=RESULTS,
                   help=f"write bench.json, bench.md and bench.png here (default {RESULTS}/)")
    p.add_argument("--steps", type=int, help="timed steps per row (default: 20 on CUDA, 5 on a CPU)")
    p.add_argument("--warmup", type=int, help="unmeasured steps before them (default: 5 on CUDA, 2 on a CPU)")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--batch-size", type=int, help="default 2")
    p.add_argument("--frames", type=int, help="default 16")
    p.add_argument("--size", type=int, help="crop size, default 112")
    p.add_argument("--only", help="comma-separated globs on row names, e.g. 'e2e-sac_milp-bmin' "
                                  "(an e2e reference row is always kept)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the rows round-robin this many times, pooling their steps")
    p.add_argument("--timeout", type=float, help="seconds per row (default 1800)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads in each row (default: torch's)")
    p.add_argument("--free-grads", action="store_true",
                   help="free parameter gradients after each step, as videotrain.bench --free-grads")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every row")
    args = p.parse_args(argv)
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0) \
            or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    try:
        rows, _, table = run_sac_bench(
            out=args.out, steps=args.steps, warmup=args.warmup, device=args.device,
            batch_size=args.batch_size, frames=args.frames, size=args.size,
            extra_overrides=args.overrides, only=only, timeout=args.timeout,
            threads=args.threads, rounds=args.rounds, free_grads=args.free_grads)
    except NoRows as err:  # before any row starts
        print(f"error: {err}", file=sys.stderr)
        return 2
    return finish(rows, table)


if __name__ == "__main__":
    sys.exit(main())
