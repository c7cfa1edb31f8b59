"""``python -m videotrain.bench``: run a suite, one fresh subprocess per row (``spawn.run_child``),
and report; with ``--child``, measure that one row (``child_main``)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from videotrain.bench import report
from videotrain.bench.child import step_stats
from videotrain.bench.spawn import child_reply, device_name, machine_info, run_child
from videotrain.bench.suites import (
    CHILD_KEYS,
    COMPILE_AXIS,
    SUITES,
    on_axis,
    own_shape,
    resolve,
    setting_for,
)

DEFAULT_HEAD = "transformer"
MIN_ROW_S = 20.0  # a row needs this much of a suite's time budget left to start


class CudaRequired(RuntimeError):
    """A CUDA-only suite was asked to run where there is no CUDA device (or on another one)."""


class NoRows(ValueError):
    """``--only`` left no row of the suite to run."""


def setting_overrides(batch_size: int, frames: int, size: int, device: str,
                      extra: tuple[str, ...] = ()) -> list[str]:
    """The bench setting as Hydra overrides (applied under every row's own overrides);
    ``extra``: the suite's own (the GPU suite's ``trainer.precision=bf16``)."""
    return [
        f"model/head={DEFAULT_HEAD}",
        f"data.crop_size={size}",  # vit backbones take image_size=${data.crop_size}
        f"data.num_frames={frames}",
        f"data.batch_size={batch_size}",
        f"device={device}",
        "logger.wandb.mode=disabled",
        *extra,
    ]


def require_cuda(suite: str, device: str) -> None:
    """Raise ``CudaRequired`` (one line, before anything is spawned) unless ``device`` is a
    CUDA device that this machine has."""
    import torch

    if not device.startswith("cuda"):
        raise CudaRequired(f"videotrain.bench --suite {suite} needs a CUDA GPU; --device {device} "
                           "was given (no GPU figure was measured)")
    if not torch.cuda.is_available():
        raise CudaRequired(f"videotrain.bench --suite {suite} needs a CUDA GPU; "
                           "torch.cuda.is_available() is False on this machine (no GPU figure "
                           "was measured)")


def slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (a folder name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def default_out(suite: str, device: str) -> Path | None:
    """Where a suite with a ``results_root`` writes without ``--out``: one folder per GPU model
    (``outputs/bench/gpu/nvidia-h100-80gb-hbm3/``), relative to the current directory; never
    into docs/ (the published tables are written there with ``--out``)."""
    root = setting_for(suite).results_root
    if root is None or not device.startswith("cuda"):
        return None
    import torch

    return Path(root) / slug(torch.cuda.get_device_name(torch.device(device)))


def child_main(spec_json: str) -> int:
    """Child side: measure one row, print exactly one JSON line on stdout."""
    from videotrain.bench.child import measure

    return child_reply(measure, spec_json)


# Steps per row by default: on CUDA 5 warm-up and 20 timed steps (5 timed steps gave 1.31x to
# 1.51x for one row across runs, docs/design §9); on a CPU 2 and 5 (a CPU step is 10-100x longer).
CUDA_STEPS, CUDA_WARMUP, CPU_STEPS, CPU_WARMUP = 20, 5, 5, 2


def timed_steps(device: str, steps: int | None, warmup: int | None) -> tuple[int, int]:
    """(timed steps, warm-up steps) per row: as given, else the device's defaults."""
    cuda = device.startswith("cuda")
    return (steps or (CUDA_STEPS if cuda else CPU_STEPS),
            (CUDA_WARMUP if cuda else CPU_WARMUP) if warmup is None else warmup)


def combine(spec: dict[str, Any], runs: list[dict[str, Any]], device: str) -> dict[str, Any]:
    """One table row from a row's runs (one per round): steps pooled, the first error kept.
    ``spec`` names the row's input shape (``batch_size``, ``frames``)."""
    failed = [r for r in runs if r.get("error")]
    res = dict(failed[0] if failed else runs[0])
    if not failed and len(runs) > 1:
        pooled = {k: [x for r in runs for x in r.get(k, [])]
                  for k in ("step_times_s", "peak_mems_mb", "fwd_bwd_mems_mb", "metered_step_times_s")}
        res.update(step_stats(pooled["step_times_s"], pooled["peak_mems_mb"],
                              pooled["fwd_bwd_mems_mb"], spec["batch_size"], pooled["metered_step_times_s"]))
    res["wall_s"] = sum(r.get("wall_s", 0.0) for r in runs)
    res["rounds"] = len(runs)
    row = {**spec, **res, "device": res.get("device", device)}
    for key in ("strategy", "keep_ratio", "granularity", "policy"):
        if res.get("memory", {}).get(key) is not None:  # what was actually built
            row[key] = res["memory"][key]
    if spec.get("budget") == "min" and res.get("min_budget_frac") is not None:
        row["budget_frac"] = res["min_budget_frac"]
    if res.get("memory", {}).get("plan"):  # memory=auto: the plan it chose
        row["policy"] = res["memory"]["plan"]
    return row


def auto_budget(spec: dict[str, Any], specs: list[dict[str, Any]],
                per_row: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """``spec`` with ``memory.budget_mb`` set to ``auto_budget_of_e2e`` x the measured peak of
    the e2e row of its backbone (first round), or with an ``error`` when there is none."""
    ref = next((runs[0] for s, runs in zip(specs, per_row, strict=True)
                if s["backbone"] == spec["backbone"] and s["strategy"] == "e2e"
                and not s.get("policy") and runs and not runs[0].get("error")), None)
    if ref is None or ref.get("peak_mem_mb") is None:
        return {**spec, "error": "memory=auto's budget is a fraction of the e2e row's measured "
                                 "peak, and that row has no result"}
    budget = round(spec["auto_budget_of_e2e"] * ref["peak_mem_mb"], 1)
    return {**spec, "auto_budget_mb": budget, "e2e_peak_mem_mb": ref["peak_mem_mb"],
            "overrides": [*spec["overrides"], f"memory.budget_mb={budget}"]}


def estimated_steps(specs: list[dict[str, Any]], device: str, free_grads: bool = False,
                    processes: int = 2) -> list[float | None]:
    """Each row's step peak (MB, the scale of its measured ``peak_mem_mb``) as
    ``python -m videotrain.plan --fit`` estimates it on fake tensors, for the same model, batch
    and step (AdamW, no clipping). None for rows the config alone does not describe: the peers
    that change the model when they run (torch.compile, a suite's peer) and memory=auto (it chooses
    its plan then); and all rows with ``free_grads`` (the estimate keeps gradients)."""
    from videotrain.config.estimate import run_isolated

    if free_grads:
        return [None] * len(specs)
    rows = [i for i, s in enumerate(specs) if s["strategy"] != "auto"
            and not any(s.get(k) not in (None, False) for k in CHILD_KEYS)]
    step = ["optim=adamw", "trainer.grad_clip=null", "trainer.label_smoothing=0.0"]
    jobs = [([*specs[i]["overrides"], *step], device.split(":")[0]) for i in rows]
    done = run_isolated(jobs, processes) if jobs else []
    out: list[float | None] = [None] * len(specs)
    for i, res in zip(rows, done, strict=True):
        out[i] = res["memory"].step_increase / 2**20 if "memory" in res else None
    return out


ESTIMATE_WAIT_S = 60.0  # how long a CUDA run waits, after its rows, for the CPU's estimates


def start_estimates(specs: list[dict[str, Any]], device: str,
                    free_grads: bool) -> Callable[[], list[float | None]]:
    """:func:`estimated_steps`, and a function that returns them. With CUDA they run on the CPU
    while the rows run on the GPU (half the cores), and the rows' results do not wait for them
    more than ``ESTIMATE_WAIT_S`` (a daemon thread: a device call's time limit is not spent on
    them); on the CPU they wait until the rows are done, so that they never share the cores
    with a timed step."""
    if not device.startswith("cuda"):
        return lambda: estimated_steps(specs, device, free_grads)
    done: list[list[float | None]] = []
    worker = threading.Thread(target=lambda: done.append(estimated_steps(
        specs, device, free_grads, max(min((os.cpu_count() or 2) // 2, 8), 1))), daemon=True)
    worker.start()

    def result() -> list[float | None]:
        worker.join(ESTIMATE_WAIT_S)
        return done[0] if done else [None] * len(specs)
    return result


def suite_specs(suite: str, device: str, batch_size: int | None = None, frames: int | None = None,
                size: int | None = None, extra: list[str] | None = None,
                only: list[str] | None = None,
                rows: list[dict[str, Any]] | None = None,
                compile_axis: str = "eager") -> list[dict[str, Any]]:
    """The final row specs of ``suite`` (or of ``rows``) at its setting, where ``batch_size``,
    ``frames`` and ``size`` (None: the suite's) and the user's ``extra`` overrides apply;
    ``compile_axis`` (``--compile``): the rows as they are, compiled, or both ways."""
    base = setting_for(suite)
    setting = setting_overrides(batch_size or base.batch_size, frames or base.frames,
                                size or base.size, device, base.overrides)
    chosen = on_axis(rows if rows is not None else SUITES[suite], compile_axis)
    specs = resolve(chosen, setting, list(extra or []), only)
    if not specs:
        raise NoRows(f"no rows left after --only {only}")
    return specs


def run_bench(
    suite: str = "default", out: str | Path | None = None, steps: int | None = None,
    warmup: int | None = None,
    device: str | None = None, batch_size: int | None = None, frames: int | None = None,
    size: int | None = None, num_classes: int = 10, extra_overrides: list[str] | None = None,
    only: list[str] | None = None, rows: list[dict[str, Any]] | None = None,
    timeout: float | None = None, threads: int | None = None, rounds: int = 1,
    free_grads: bool = False, time_budget: float | None = None, compile_axis: str = "eager",
    child: str = "videotrain.bench", child_path: str | Path | None = None, log=print,
) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """Run ``suite`` (or the given row specs). Returns (rows, meta, markdown table).

    ``device``, ``batch_size``, ``frames``, ``size``, ``timeout`` and ``time_budget`` (seconds
    for the whole run; 0: none) default to the suite's setting (``suites.setting_for``). A CUDA-only suite raises ``CudaRequired`` before it
    starts anything where there is no CUDA device. ``out``: where to write bench.json/.md/.png;
    None writes nothing, except for a suite with a ``results_root`` (gpu: one folder per GPU
    model under outputs/bench/gpu/). ``child`` (found first on ``child_path``) measures each
    row, ``python -m child --child SPEC``: a suite beside the package names its own."""
    if suite not in SUITES and rows is None:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    base = setting_for(suite)
    device = device_name(device or base.device)
    if base.needs_cuda:
        require_cuda(suite, device)
    batch_size = batch_size or base.batch_size
    frames, size = frames or base.frames, size or base.size
    timeout = timeout or base.timeout
    steps, warmup = timed_steps(device, steps, warmup)
    time_budget = base.time_budget if time_budget is None else (time_budget or None)
    deadline = time.monotonic() + time_budget if time_budget else float("inf")
    extra = list(extra_overrides or [])
    specs = suite_specs(suite, device, batch_size, frames, size, extra, only, rows, compile_axis)
    setting = {"suite": suite, "batch_size": batch_size, "frames": frames, "size": size,
               "steps": steps, "warmup": warmup, "num_classes": num_classes, "head": DEFAULT_HEAD,
               "suite_overrides": list(base.overrides), "extra_overrides": extra, "only": only,
               "threads": threads, "rounds": rounds, "free_grads": free_grads, "timeout": timeout,
               "time_budget": time_budget, "compile": compile_axis}
    common = {"steps": steps, "warmup": warmup, "batch_size": batch_size, "frames": frames,
              "size": size, "num_classes": num_classes, "device": device, "seed": 0,
              "threads": threads, "free_grads": free_grads, "eval_peak": True}
    per_row: list[list[dict[str, Any]]] = [[] for _ in specs]
    out = default_out(suite, device) if out is None else out

    def report_rows(estimated: list[float | None] | None) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
        """The rows run so far (all of them once ``estimated`` is given), written to ``out``.
        The GPU is read for the last report only, after the rows, so that this process holds
        no CUDA context while they run."""
        machine = machine_info(device, gpu=estimated is not None)
        results = [combine({**spec, "batch_size": batch_size, "frames": frames, **own_shape(spec)},
                           runs, device)
                   for spec, runs in zip(specs, per_row, strict=True) if runs]  # each names its shape
        for row, mb in zip(results, estimated or [], strict=False):
            row["step_estimated_mb"] = mb
        report.add_ratios(results)
        meta = {"device": device, "torch": machine["torch"], "setting": setting,
                "machine": machine, "memory_metric": (
                    "CUDA max_memory_allocated - allocated before the step" if device.startswith("cuda")
                    else "CPU VmHWM - VmRSS before the step (MALLOC_MMAP_THRESHOLD_=65536)"),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "complete": estimated is not None}
        table = (report.write(Path(out), results, meta, plot=estimated is not None) if out
                 else report.markdown(results))
        return results, meta, table

    estimates = start_estimates(specs, device, free_grads)
    for rnd in range(rounds):  # round-robin, so slow drifts of machine load hit every row
        for i, spec in enumerate(specs):
            if any(r.get("error") for r in per_row[i]):
                continue  # a failed row is not retried
            if spec.get("auto_budget_of_e2e") is not None and "auto_budget_mb" not in spec:
                spec = specs[i] = auto_budget(spec, specs, per_row)  # fixed for later rounds
            left = deadline - time.monotonic()
            if spec.get("error") or left < MIN_ROW_S:
                res = {"error": spec.get("error") or f"not run: the suite's {time_budget:.0f} s "
                                                    "time budget was spent"}
            else:
                res = run_child({**common, **own_shape(spec), "overrides": spec["overrides"],
                                 **{k: spec.get(k) for k in CHILD_KEYS}}, min(timeout, left),
                                module=child, pythonpath=child_path)
            per_row[i].append(res)
            tag = f"[{i + 1}/{len(specs)}" + (f" round {rnd + 1}/{rounds}]" if rounds > 1 else "]")
            if res.get("error"):
                log(f"{tag} {spec['name']}: FAILED ({res['error'].splitlines()[-1]})",
                    file=sys.stderr)
            else:
                log(f"{tag} {spec['name']}: peak {res['peak_mem_mb']:.1f} MB, step "
                    f"{res['step_time_s']:.3f} s, saved {res['saved_act_mb']:.1f} MB "
                    f"({res['wall_s']:.0f} s)", file=sys.stderr)
            if out:  # what has run survives a run cut short (a device call's time limit)
                report_rows(None)
    return report_rows(estimates())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m videotrain.bench",
        description="Peak memory, step time and saved activations of memory strategies; each "
                    "row runs in a fresh subprocess on the same model and synthetic batch.",
        epilog="Extra arguments are Hydra overrides applied to every row after its own, e.g. "
               "model/backbone=resnet10 model/head=tconv trainer.precision=bf16.")
    p.add_argument("--suite", default="default", choices=sorted(SUITES),
                   help="the rows to run (suites.py): default, sbp, recompute, all, or gpu: the "
                        "CUDA acceptance suite (resnet50 + transformer head, B=8 x T=16 at 224 px, "
                        "bf16; e2e, sbp, frame dropout, recompute, memory=auto at half of e2e's "
                        "peak, torch.compile), written to outputs/bench/gpu/<gpu>/ unless --out; "
                        "exits with status 2 at once where there is no CUDA GPU. The lab's "
                        "suites are beside the package: python -m benchmarks.data, python -m "
                        "benchmarks.annotations, python -m benchmarks.sac_milp (from the "
                        "repository root)")
    p.add_argument("--out", help="write bench.json, bench.md and bench.png here (default: "
                                 "nothing written; gpu suite: outputs/bench/gpu/<gpu name>/)")
    p.add_argument("--steps", type=int, help="timed steps per row (default: 20 on CUDA, 5 on a CPU)")
    p.add_argument("--warmup", type=int, help="unmeasured steps before them (default: 5 on CUDA, 2 on a CPU)")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto; gpu suite: cuda)")
    p.add_argument("--batch-size", type=int, help="default 2, gpu suite 8")
    p.add_argument("--frames", type=int, help="default 16")
    p.add_argument("--size", type=int, help="crop size, default 112, gpu suite 224")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--only", help="comma-separated globs on row names, e.g. 'e2e,sbp-frame-*' "
                                  "(an e2e reference row is always kept)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the rows round-robin this many times, pooling their steps (each "
                        "round is a fresh subprocess per row); smooths drifting machine load")
    p.add_argument("--timeout", type=float, help="seconds per row (default 1800, gpu suite 240)")
    p.add_argument("--time-budget", type=float,
                   help="seconds for the whole run; rows that would start later are recorded as "
                        "not run (default: none; gpu suite 570; 0: none)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads in each row (default: torch's)")
    p.add_argument("--free-grads", action="store_true",
                   help="free parameter gradients after each step (zero_grad(set_to_none=True)), "
                   "so the step peak also counts the gradients backward allocates; by default "
                   "they persist between steps like the weights and optimizer state")
    p.add_argument("--compile", default="eager", choices=COMPILE_AXIS,
                   help="every row eager (default; the gpu suite has compiled rows of its own), "
                        "compiled (trainer.compile=true), or both, each with its compiled twin")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every row")
    args = p.parse_args(argv)
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0) \
            or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    return args


def finish(rows: list[dict[str, Any]], table: str) -> int:
    """Print a bench's table; the exit status: 1 (naming them on stderr) if rows failed, else 0."""
    print(table, end="")
    failed = [r["name"] for r in rows if r.get("error")]
    if failed:
        print(f"{len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    try:
        rows, _, table = run_bench(
            suite=args.suite, out=args.out, steps=args.steps, warmup=args.warmup,
            device=args.device, batch_size=args.batch_size, frames=args.frames,
            size=args.size, num_classes=args.num_classes, extra_overrides=args.overrides,
            timeout=args.timeout, threads=args.threads, rounds=args.rounds,
            free_grads=args.free_grads, time_budget=args.time_budget, only=only,
            compile_axis=args.compile,
        )
    except (CudaRequired, NoRows) as err:  # before any row starts
        print(f"error: {err}", file=sys.stderr)
        return 2
    return finish(rows, table)
