"""The data suite (``python -m benchmarks.data``, from the repository root): decoded and
transformed clips per second through the loaders, one fresh process per row (``--child``)
like the cost benchmark's rows.

A row crosses a clip set shaped like a real dataset (``clips.py``), a pipeline (``train``: one
random clip per video, ``(B, T, C, crop, crop)``; ``test``: the evaluation's views,
``(B, clips * crops, T, C, crop, crop)``) and a backend (this project's loader, with PyAV,
torchcodec or TSN segments, and pytorchvideo's on the same files and transforms). A backend whose
option or module is missing is reported as unavailable with the reason, never measured as
something else. ``run_data_bench`` is the parent side (clip sets, one process per row, the
report into ``outputs/bench_data/`` or ``--out``); ``data_child.measure_data`` the child side.
Details: ``docs/design/internals.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.data_child import TIMED_CLIPS, measure_data, set_overrides, unavailable
from videotrain.bench.cli import finish
from videotrain.bench.spawn import child_reply

# ---------------------------------------------------------------------- the rows
# Loader backends of the data suite: which loader builds the row (this project's or
# pytorchvideo's ``LabeledVideoDataset``) and the data overrides that select the variant.
# ``needs``: the data key the variant sets, reported as unavailable where the config lacks it.
DATA_BACKENDS: dict[str, dict[str, Any]] = {
    "pyav": {"loader": "videotrain", "overrides": []},
    "pytorchvideo": {"loader": "pytorchvideo", "overrides": []},
    "torchcodec": {"loader": "videotrain", "overrides": ["data.decoder=torchcodec"],
                   "needs": "decoder", "module": "torchcodec"},
    "segment": {"loader": "videotrain", "overrides": ["data.sampler=segment"], "needs": "sampler"},
}
DATA_PIPELINES = ("train", "test")
DATA_SETS = ("kinetics", "ssv2")  # clips.CLIP_SETS


def data_row(backend: str, num_workers: int, clip_set: str = "kinetics",
             pipeline: str = "train") -> dict[str, Any]:
    """A data-loading row: decoded and transformed clips/s of ``pipeline`` (``train``: one
    random clip per video; ``test``: ``data.val_clips`` x ``data.val_crops`` views) through
    ``backend`` (``DATA_BACKENDS``) with ``num_workers`` worker processes, on the
    ``clip_set``-like videos (``clips.py``)."""
    if backend not in DATA_BACKENDS or pipeline not in DATA_PIPELINES:
        raise ValueError(f"backend must be one of {', '.join(DATA_BACKENDS)} and pipeline one "
                         f"of {', '.join(DATA_PIPELINES)}, got {backend!r}, {pipeline!r}")
    b = DATA_BACKENDS[backend]
    return {"kind": "data", "set": clip_set, "pipeline": pipeline, "backend": backend,
            "loader": b["loader"], "num_workers": num_workers,
            "row_overrides": list(b["overrides"]), "needs": b.get("needs"),
            "module": b.get("module"),
            "name": f"data/{clip_set}/{pipeline}/{backend}-w{num_workers}"}


def worker_counts(cpus: int | None = None) -> tuple[int, ...]:
    """1, 2 and N = the CPU count worker processes (fewer where N <= 2)."""
    return tuple(sorted({1, 2, max(cpus or os.cpu_count() or 1, 1)}))


def data_rows(sets: tuple[str, ...] = DATA_SETS, pipelines: tuple[str, ...] = DATA_PIPELINES,
              backends: tuple[str, ...] = tuple(DATA_BACKENDS),
              workers: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    """Every combination, grouped by set and pipeline so that each ratio's rows run close
    together in time."""
    return [data_row(b, w, s, p) for s in sets for p in pipelines for w in (workers or worker_counts())
            for b in backends]





# ---------------------------------------------------------------------- the runner
# Rough seconds per data row on a 2-core CPU, to print the suite's estimate before it starts:
# a fresh interpreter, the config, preflight and the first wave, then the timed clips at these
# clips/s per worker (Kinetics-like clips; the time so far is printed as rows finish).
DATA_ROW_OVERHEAD_S = 6.0
DATA_RATE_GUESS = {("videotrain", "train"): 8.0, ("videotrain", "test"): 5.0,
                   ("pytorchvideo", "train"): 4.0, ("pytorchvideo", "test"): 2.5}


def estimate_data_row(spec: dict[str, Any], timed_clips: dict[str, int]) -> float:
    """Seconds a data row is expected to take (``DATA_ROW_OVERHEAD_S`` + its timed clips; a
    worker beyond the first adds 0.8 of one, up to the CPU count)."""
    workers = min(max(spec["num_workers"], 1), os.cpu_count() or 1)
    rate = DATA_RATE_GUESS[spec["loader"], spec["pipeline"]] * (1 + 0.8 * (workers - 1))
    return DATA_ROW_OVERHEAD_S + timed_clips[spec["pipeline"]] / rate


def run_data_bench(
    out: str | Path | None = None, device: str = "auto",
    extra_overrides: list[str] | None = None, rounds: int = 1, timeout: float = 600,
    threads: int | None = None, only: list[str] | None = None,
    rows: list[dict[str, Any]] | None = None, clips: int | None = None,
    timed_clips: int | None = None, target: float | None = None,
    sets: dict[str, Any] | None = None, log=print,
) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """Run the data suite (``data_rows()``, or the given ``data_row`` specs): decoded clips/s
    per loader row (``measure_data``), each row in a fresh process (``spawn.run_child`` of
    ``benchmarks.data --child``), ``rounds`` times round-robin; a row reports the median over
    its rounds. ``out``: where to write bench.json/.md/.png (None: nothing is written).

    The clip sets the rows read are generated first (once, cached: ``clips.py``), with
    ``clips`` videos each (default: the set's, 200); ``sets`` maps a set name to a
    ``ClipSetSpec`` to use instead (tests: tiny ones). ``timed_clips``: clips timed per row
    (default ``TIMED_CLIPS`` per pipeline). ``target``: also work out the workers that
    feed this many clips/s (``data_report.target_workers``)."""
    import fnmatch

    from benchmarks import clips as clip_sets
    from benchmarks import data_report as report
    from videotrain.bench.spawn import device_name, machine_info, run_child
    from videotrain.config.build import compose_cfg

    device = device_name(device)
    extra = list(extra_overrides or [])
    specs = [r for r in (rows if rows is not None else data_rows())
             if not only or any(fnmatch.fnmatch(r["name"], p) for p in only)]
    if not specs:
        raise ValueError(f"no rows left after --only {only}")
    timed = {p: timed_clips or n for p, n in TIMED_CLIPS.items()}
    set_specs = {name: (sets or {}).get(name) or clip_sets.clip_set(name, clips)
                 for name in dict.fromkeys(s["set"] for s in specs)}
    cfgs = {}
    for name, cs in set_specs.items():
        base = [*set_overrides(str(clip_sets.set_root(cs)), cs.fps), f"device={device}", *extra]
        cfgs[name] = (base, compose_cfg(base).data)
    # a row that cannot run here (a module not installed, an option this version lacks) is
    # reported with the reason, without starting a process
    reasons = [unavailable(s, cfgs[s["set"]][1]) for s in specs]
    estimate = rounds * sum(estimate_data_row(s, timed) for s, r in zip(specs, reasons, strict=True)
                            if not r)
    generate = sum(clip_sets.generation_estimate(cs) for cs in set_specs.values()
                   if not (clip_sets.set_root(cs) / "spec.json").exists())
    log(f"{len(specs)} rows ({sum(r is not None for r in reasons)} unavailable) x {rounds} "
        f"round(s): about {(estimate + generate) / 60:.0f} min on a 2-core CPU"
        + (f", {generate / 60:.0f} min of it generating the clip sets (once: they are cached)"
           if generate else ""), file=sys.stderr)
    roots = {name: clip_sets.ensure_clip_set(cs, log=lambda m: log(m, file=sys.stderr))
             for name, cs in set_specs.items()}
    infos = {name: clip_sets.set_info(root) for name, root in roots.items()}
    per_row: list[list[dict[str, Any]]] = [[] for _ in specs]
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    t_start = time.perf_counter()
    for rnd in range(rounds):
        for i, spec in enumerate(specs):
            if any(r.get("error") or r.get("unavailable") for r in per_row[i]):
                continue
            if reasons[i]:
                res: dict[str, Any] = {"unavailable": reasons[i]}
            else:
                base = cfgs[spec["set"]][0]
                res = run_child({**spec, "overrides": [*base, *spec["row_overrides"]],
                                 "device": device, "threads": threads,
                                 "timed_clips": timed[spec["pipeline"]]}, timeout,
                                module="benchmarks.data", metered=False, pythonpath=REPO)
            per_row[i].append(res)
            tag = f"[{i + 1}/{len(specs)}" + (f" round {rnd + 1}/{rounds}]" if rounds > 1 else "]")
            if res.get("unavailable"):
                msg = res["unavailable"]
            elif res.get("error"):
                msg = f"FAILED ({res['error'].splitlines()[-1]})"
            else:
                msg = (f"{res['clips_per_s']:.1f} clips/s ({res['clips']} clips in "
                       f"{res['elapsed_s']:.1f} s, row {res['wall_s']:.0f} s; "
                       f"{time.perf_counter() - t_start:.0f} s so far)")
            log(f"{tag} {spec['name']}: {msg}", file=sys.stderr)
    results = [report.combine_data(spec, runs) for spec, runs in zip(specs, per_row, strict=True)]
    report.add_data_ratios(results)
    targets = report.target_workers(results, target) if target else []
    machine = machine_info(device)
    d = next(iter(cfgs.values()))[1]
    setting = {"suite": "data", "rounds": rounds, "extra_overrides": extra, "only": only,
               "threads": threads, "timed_clips": timed, "sets": infos,
               "roots": {k: str(v) for k, v in roots.items()},
               "num_frames": int(d.num_frames), "sampling_rate": int(d.sampling_rate),
               "short_side": int(d.short_side), "crop_size": int(d.crop_size),
               "train_scale": list(d.train_scale), "val_clips": int(d.val_clips),
               "val_crops": int(d.val_crops), "batch_size": int(d.batch_size),
               "val_batch_size": int(d.val_batch_size),
               "target_clips_per_s": target, "wall_s": time.perf_counter() - t_start,
               "load_avg_start": load_start}
    meta = {"device": device, "torch": machine["torch"], "setting": setting, "machine": machine,
            "metric": "decoded and transformed clips per second (test: temporal clips, each "
                      "with its crops) over a fixed number of clips after the first wave of "
                      "batches", "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if out:
        table = report.write_data(Path(out), results, meta, targets)
    else:
        table = report.data_markdown(results, targets)
    return results, meta, table


# ---------------------------------------------------------------------- the command line
REPO = Path(__file__).resolve().parent.parent  # the children import benchmarks from here
RESULTS = "outputs/bench_data"  # the default --out (the published table: --out docs/...)


def child_main(spec_json: str) -> int:
    """Child side: measure one data row (``spawn.child_reply``: one JSON line on stdout)."""
    return child_reply(measure_data, spec_json)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.data",
        description="Decoded and transformed clips/s of the train and test pipelines (this "
                    "project's loader, pytorchvideo's, torchcodec, the segment sampler; 1, 2 "
                    "and N workers) on generated Kinetics-like and SSv2-like videos; each row "
                    "in a fresh process. Run from the repository root.",
        epilog="Extra arguments are data.* Hydra overrides applied to every row, e.g. "
               "data.num_frames=8.")
    p.add_argument("--out", default=RESULTS,
                   help=f"write bench.json, bench.md and bench.png here (default {RESULTS}/; the "
                        "published table is docs/results/bench_data/)")
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda: pins memory for CUDA (default auto)")
    p.add_argument("--batch-size", type=int, help="data.batch_size (default 4)")
    p.add_argument("--frames", type=int, help="data.num_frames (default 16)")
    p.add_argument("--size", type=int, help="data.crop_size (default 224)")
    p.add_argument("--only", help="comma-separated globs on row names, e.g. "
                                  "'data/kinetics/train/*'")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the rows round-robin this many times; a row reports the median")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per row (default 600)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads in each row (default: torch's)")
    p.add_argument("--clips", type=int,
                   help="videos per generated clip set (default 200 Kinetics-like + 200 "
                        "SSv2-like; generated once into $VIDEOTRAIN_CACHE)")
    p.add_argument("--timed-clips", type=int,
                   help="clips timed per row (default 64 train, 60 test)")
    p.add_argument("--target-clips-per-s", type=float,
                   help="also print the workers of the fastest backend that would feed this "
                        "many clips/s, per set and pipeline")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every row")
    args = p.parse_args(argv)
    if args.rounds < 1 or any(v is not None and v < 1 for v in (
            args.batch_size, args.frames, args.size, args.clips, args.timed_clips)):
        p.error("--rounds, --batch-size, --frames, --size, --clips and --timed-clips must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    flags = [f"data.{key}={value}" for key, value in (
        ("batch_size", args.batch_size), ("num_frames", args.frames), ("crop_size", args.size))
        if value is not None]
    try:
        rows, _, table = run_data_bench(
            out=args.out, device=args.device, rounds=args.rounds,
            extra_overrides=[*flags, *args.overrides], timeout=args.timeout,
            threads=args.threads, only=only, clips=args.clips, timed_clips=args.timed_clips,
            target=args.target_clips_per_s)
    except ValueError as exc:  # --only naming no row: before any row starts
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return finish(rows, table)


if __name__ == "__main__":
    sys.exit(main())
