"""``python -m videotrain.bench``: run a suite, one fresh subprocess per row, and report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from videotrain.bench import report
from videotrain.bench.child import step_stats
from videotrain.bench.suites import DATA_SUITES, SUITES, resolve

DEFAULT_HEAD = "transformer"


def setting_overrides(batch_size: int, frames: int, size: int, device: str) -> list[str]:
    """The bench setting as Hydra overrides (applied under every row's own overrides)."""
    return [
        f"model/head={DEFAULT_HEAD}",
        f"data.crop_size={size}",  # vit backbones take image_size=${data.crop_size}
        f"data.num_frames={frames}",
        f"data.batch_size={batch_size}",
        f"device={device}",
        "logger.wandb.mode=disabled",
    ]


def resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one row in a fresh interpreter; the result (or the error) as a dict."""
    env = os.environ.copy()
    env.setdefault("WANDB_MODE", "disabled")
    if spec["device"] == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, "-m", "videotrain.bench", "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    result: dict[str, Any] | None = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if result is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        result = {"error": f"child exited with {proc.returncode} and no result:\n{tail}"}
    elif proc.returncode != 0 and not result.get("error"):
        result["error"] = f"child exited with {proc.returncode}"
    result["wall_s"] = wall
    return result


def child_main(spec_json: str) -> int:
    """Child side: measure one row, print exactly one JSON line on stdout."""
    from videotrain.bench.child import measure
    from videotrain.bench.data import measure_data

    try:
        spec = json.loads(spec_json)
        result = (measure_data if spec.get("kind") == "data" else measure)(spec)
        code = 0
    except Exception as exc:  # noqa: BLE001 - recorded in the row, the parent decides
        traceback.print_exc()
        cause = exc.__cause__ or exc
        result = {"error": f"{type(exc).__name__}: {exc}"
                           + (f" ({type(cause).__name__}: {cause})" if cause is not exc else "")}
        code = 1
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return code


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        info["load_avg"] = os.getloadavg()
    except OSError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                     text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def combine(spec: dict[str, Any], runs: list[dict[str, Any]], device: str,
            batch_size: int) -> dict[str, Any]:
    """One table row from a row's runs (one per round): steps pooled, the first error kept."""
    failed = [r for r in runs if r.get("error")]
    res = dict(failed[0] if failed else runs[0])
    if not failed and len(runs) > 1:
        pooled = {k: [x for r in runs for x in r.get(k, [])]
                  for k in ("step_times_s", "peak_mems_mb", "fwd_bwd_mems_mb", "metered_step_times_s")}
        res.update(step_stats(pooled["step_times_s"], pooled["peak_mems_mb"],
                              pooled["fwd_bwd_mems_mb"], batch_size, pooled["metered_step_times_s"]))
    res["wall_s"] = sum(r.get("wall_s", 0.0) for r in runs)
    res["rounds"] = len(runs)
    row = {**spec, **res, "device": res.get("device", device)}
    for key in ("strategy", "keep_ratio", "granularity", "policy"):
        if res.get("memory", {}).get(key) is not None:  # what was actually built
            row[key] = res["memory"][key]
    if spec.get("budget") == "min" and res.get("min_budget_frac") is not None:
        row["budget_frac"] = res["min_budget_frac"]
    return row


def run_bench(
    suite: str = "default", out: str | Path | None = None, steps: int = 5, warmup: int = 2,
    device: str = "auto", batch_size: int = 2, frames: int = 16, size: int = 112,
    num_classes: int = 10, extra_overrides: list[str] | None = None, only: list[str] | None = None,
    rows: list[dict[str, Any]] | None = None, timeout: float = 1800, threads: int | None = None,
    rounds: int = 1, free_grads: bool = False, log=print,
) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """Run ``suite`` (or the given row specs). Returns (rows, meta, markdown table)."""
    if suite not in SUITES and rows is None:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    device = resolve_device(device)
    extra = list(extra_overrides or [])
    specs = resolve(rows if rows is not None else SUITES[suite],
                    setting_overrides(batch_size, frames, size, device), extra, only)
    if not specs:
        raise ValueError(f"no rows left after --only {only}")
    setting = {"suite": suite, "batch_size": batch_size, "frames": frames, "size": size,
               "steps": steps, "warmup": warmup, "num_classes": num_classes, "head": DEFAULT_HEAD,
               "extra_overrides": extra, "only": only, "threads": threads,
               "rounds": rounds, "free_grads": free_grads}
    per_row: list[list[dict[str, Any]]] = [[] for _ in specs]
    for rnd in range(rounds):  # round-robin, so slow drifts of machine load hit every row
        for i, spec in enumerate(specs):
            if any(r.get("error") for r in per_row[i]):
                continue  # a failed row is not retried
            child_spec = {"overrides": spec["overrides"], "steps": steps, "warmup": warmup,
                          "batch_size": batch_size, "frames": frames, "size": size,
                          "num_classes": num_classes, "device": device, "seed": 0,
                          "threads": threads, "free_grads": free_grads,
                          "compile_budget": spec.get("compile_budget")}
            res = run_child(child_spec, timeout)
            per_row[i].append(res)
            tag = f"[{i + 1}/{len(specs)}" + (f" round {rnd + 1}/{rounds}]" if rounds > 1 else "]")
            if res.get("error"):
                log(f"{tag} {spec['name']}: FAILED ({res['error'].splitlines()[-1]})",
                    file=sys.stderr)
            else:
                log(f"{tag} {spec['name']}: peak {res['peak_mem_mb']:.1f} MB, step "
                    f"{res['step_time_s']:.3f} s, saved {res['saved_act_mb']:.1f} MB "
                    f"({res['wall_s']:.0f} s)", file=sys.stderr)
    results = [combine(spec, runs, device, batch_size) for spec, runs in zip(specs, per_row, strict=True)]
    report.add_ratios(results)
    machine = machine_info(device)
    meta = {"device": device, "torch": machine["torch"], "setting": setting,
            "machine": machine, "memory_metric": (
                "CUDA max_memory_allocated - allocated before the step" if device.startswith("cuda")
                else "CPU VmHWM - VmRSS before the step (MALLOC_MMAP_THRESHOLD_=65536)"),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    table = report.write(Path(out), results, meta) if out else report.markdown(results)
    return results, meta, table


def run_data_bench(
    suite: str = "data", out: str | Path | None = None, device: str = "auto",
    extra_overrides: list[str] | None = None, rounds: int = 1, timeout: float = 1800,
    threads: int | None = None, only: list[str] | None = None,
    rows: list[dict[str, Any]] | None = None, log=print,
) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """Run a data suite (or the given ``data_row`` specs): decoded clips/s per loader row
    (bench/data.py), each row in a fresh process, ``rounds`` times round-robin; a row reports
    the median over its rounds."""
    import fnmatch

    from videotrain.build import compose_cfg
    from videotrain.data.loaders import resolve_root

    device = resolve_device(device)
    overrides = ["data=synthetic", f"device={device}", "logger.wandb.mode=disabled",
                 *(extra_overrides or [])]
    specs = [r for r in (rows if rows is not None else DATA_SUITES[suite])
             if not only or any(fnmatch.fnmatch(r["name"], p) for p in only)]
    if not specs:
        raise ValueError(f"no rows left after --only {only}")
    d = compose_cfg(overrides).data
    root = resolve_root(d.name, d.root, d.get("synthetic"), d.layout)  # generated once, here
    per_row: list[list[dict[str, Any]]] = [[] for _ in specs]
    for rnd in range(rounds):
        for i, spec in enumerate(specs):
            if any(r.get("error") for r in per_row[i]):
                continue
            res = run_child({**spec, "overrides": overrides, "device": device, "threads": threads},
                            timeout)
            per_row[i].append(res)
            tag = f"[{i + 1}/{len(specs)}" + (f" round {rnd + 1}/{rounds}]" if rounds > 1 else "]")
            log(f"{tag} {spec['name']}: " + (f"FAILED ({res['error'].splitlines()[-1]})"
                if res.get("error") else f"{res['clips_per_s']:.1f} clips/s "
                f"({res['clips']} clips in {res['elapsed_s']:.1f} s)"), file=sys.stderr)
    results = [report.combine_data(spec, runs) for spec, runs in zip(specs, per_row, strict=True)]
    report.add_data_ratios(results)
    machine = machine_info(device)
    setting = {"suite": suite, "rounds": rounds, "extra_overrides": list(extra_overrides or []),
               "only": only, "threads": threads, "root": str(root),
               "num_frames": int(d.num_frames), "sampling_rate": int(d.sampling_rate),
               "fps": float(d.fps), "short_side": int(d.short_side), "crop_size": int(d.crop_size),
               "batch_size": int(d.batch_size), "synthetic": dict(d.synthetic or {})}
    meta = {"device": device, "torch": machine["torch"], "setting": setting, "machine": machine,
            "metric": "decoded training clips per second over one pass after the first batch",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    table = report.write_data(Path(out), results, meta) if out else report.data_markdown(results)
    return results, meta, table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m videotrain.bench",
        description="Peak memory, step time and saved activations of memory strategies; each "
                    "row runs in a fresh subprocess on the same model and synthetic batch.",
        epilog="Extra arguments are Hydra overrides applied to every row after its own, e.g. "
               "model/backbone=resnet10 model/head=tconv trainer.precision=bf16.")
    p.add_argument("--suite", default="default", choices=sorted([*SUITES, *DATA_SUITES]),
                   help="data: decoded clips/s of the loaders (0/1/2 workers and pytorchvideo's "
                        "pipeline) on the synthetic set; configure it with data.* overrides")
    p.add_argument("--out", help="write bench.json, bench.md and bench.png here")
    p.add_argument("--steps", type=int, default=5, help="measured steps per row")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--batch-size", type=int, help="default 2 (data suite: data.batch_size)")
    p.add_argument("--frames", type=int, help="default 16 (data suite: data.num_frames)")
    p.add_argument("--size", type=int, help="crop size, default 112 (data suite: data.crop_size)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--only", help="comma-separated globs on row names, e.g. 'e2e,sbp-frame-*' "
                                  "(an e2e reference row is always kept)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the rows round-robin this many times, pooling their steps (each "
                        "round is a fresh subprocess per row); smooths drifting machine load")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per row")
    p.add_argument("--threads", type=int, help="torch.set_num_threads in each row (default: torch's)")
    p.add_argument("--free-grads", action="store_true",
                   help="free parameter gradients after each step (zero_grad(set_to_none=True)), "
                   "so the step peak also counts the gradients backward allocates; by default "
                   "they persist between steps like the weights and optimizer state")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every row")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    if args.suite in DATA_SUITES:
        flags = [f"data.{key}={value}" for key, value in (
            ("batch_size", args.batch_size), ("num_frames", args.frames), ("crop_size", args.size))
            if value is not None]
        rows, _, table = run_data_bench(
            suite=args.suite, out=args.out, device=args.device, rounds=args.rounds,
            extra_overrides=[*flags, *args.overrides], timeout=args.timeout, threads=args.threads,
            only=only)
    else:
        rows, _, table = run_bench(
            suite=args.suite, out=args.out, steps=args.steps, warmup=args.warmup,
            device=args.device, batch_size=args.batch_size or 2, frames=args.frames or 16,
            size=args.size or 112, num_classes=args.num_classes, extra_overrides=args.overrides,
            timeout=args.timeout, threads=args.threads, rounds=args.rounds,
            free_grads=args.free_grads, only=only,
        )
    print(table, end="")
    failed = [r["name"] for r in rows if r.get("error")]
    if failed:
        print(f"{len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
