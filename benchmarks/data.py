"""The data suite (``python -m benchmarks.data``, from the repository root): decoded and
transformed clips per second through the loaders, one fresh process per row (``--child``)
like the cost benchmark's rows.

Rows (``data_row``) cross a clip set shaped like a real dataset (``clips.py``:
Kinetics-like 10 s 340x256 H.264, SSv2-like 4 s 427x240 VP9), a pipeline and a backend:

- ``train``: one random clip of ``data.num_frames`` frames every ``data.sampling_rate``
  source frames per video, short-side resize and ``RandomResizedCrop`` to ``data.crop_size``:
  ``(B, T, C, crop, crop)`` batches;
- ``test``: ``data.val_clips`` uniformly spaced clips x ``data.val_crops`` spatial crops per
  video (the evaluation transform): ``(B, clips * crops, T, C, crop, crop)``;
- backends: ``pyav`` (this project's loader, ``VideoClipDataset``), ``pytorchvideo`` (its
  ``LabeledVideoDataset``, ``pytorchvideo.data.Kinetics`` on the same ``train.csv`` /
  ``val.csv``, with its PyAV ``EncodedVideo`` decoder, its random or
  ``ConstantClipsPerVideoSampler`` windows and the same torchvision transforms), and this
  project's loader with ``data.decoder=torchcodec`` or ``data.sampler=segment``. A backend
  whose option or module is missing is reported as unavailable with the reason (``unavailable``),
  never measured as something else.

A row times a fixed number of clips (``timed_clips``), not a pass over the set, after the
first wave of batches (one per worker, started together, so including worker start-up; it is
reported apart as ``startup_s``). Batches go to workers round-robin, so the timed batches are
whole waves: every worker has delivered as many, and no prefetched batch is counted for free.
Test clips count ``data.val_clips`` per video (each with ``data.val_crops`` crops), so that
both loaders' figures are temporal clips per second.

``run_data_bench`` is the parent side: it generates the clip sets (once), prints an estimate
of the run time, starts a process per row (``python -m benchmarks.data --child SPEC``:
``measure_data`` in it), and writes the table, the JSON and the bar chart
(``data_report.write_data``) with the ratios to pytorchvideo and, given a target rate, the
workers needed to feed it (``data_report.target_workers``), into ``outputs/bench_data/``
unless ``--out`` names another folder (the published table: ``docs/results/bench_data/``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

LOADERS = ("videotrain", "pytorchvideo")
# Clips timed per row by default (test: 6 videos of 10 clips), 5-25 s a row on 2 cores.
TIMED_CLIPS = {"train": 64, "test": 60}
# What every data row runs at, under the user's overrides: the training recipe of the paper
# experiments (16 frames at stride 4, RandomResizedCrop to 224; 10 x 3 views at test).
PIPELINE_OVERRIDES = (
    "data=kinetics",
    "data.num_frames=16",
    "data.sampling_rate=4",
    "data.short_side=256",
    "data.crop_size=224",
    "data.val_clips=10",
    "data.val_crops=3",
    "data.batch_size=4",
    "data.val_batch_size=1",
    "logger.wandb.mode=disabled",
)


def set_overrides(root: str, fps: float) -> list[str]:
    """The overrides that point the kinetics reader at a clip set (``clips.ensure_clip_set``)."""
    return [*PIPELINE_OVERRIDES, f"data.root={root}", f"data.fps={fps:g}"]


def unavailable(spec: dict[str, Any], data_cfg: Any) -> str | None:
    """Why a backend cannot run here (None: it can): its module does not import
    (``module``), or the data key its variant sets is not in this version's config
    (``needs``)."""
    module = spec.get("module")
    if module:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - ImportError, or a library that fails to load
            return f"not installed ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
    needs = spec.get("needs")
    if needs and needs not in data_cfg:
        return f"unavailable: this version has no data.{needs} option"
    return None


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




# ---------------------------------------------------------------------- the loaders
def videotrain_loader(cfg, pipeline: str, num_workers: int, pin_memory: bool):
    """The loader ``python -m videotrain`` trains (``train``) or validates (``test``) with.
    Returns ``(loader, start_epoch, videos, clips_per_item)``."""
    from videotrain.build import build_data_from_cfg

    device = torch.device("cuda" if pin_memory else "cpu")
    data, _ = build_data_from_cfg(cfg, device, num_workers=num_workers)
    if pipeline == "train":
        def start(epoch: int) -> None:
            data.train_sampler.set_epoch(epoch)
        return data.train, start, len(data.train.dataset), 1
    return data.val, lambda epoch: None, len(data.val.dataset), int(cfg.data.val_clips)


class _PeerTransform:
    """pytorchvideo sample dict -> the same clip tensor the project's loader yields."""

    def __init__(self, num_frames: int, transform) -> None:
        self.num_frames, self.transform = num_frames, transform

    def __call__(self, sample: dict) -> dict:
        from videotrain.data.clip_sampling import uniform_indices

        frames = sample["video"]  # (C, T_window, H, W) float in [0, 255]
        # what pytorchvideo.transforms.UniformTemporalSubsample does (that module cannot be
        # imported with this torchvision)
        frames = frames[:, uniform_indices(frames.shape[1], self.num_frames)]
        clip = frames.permute(1, 0, 2, 3).to(torch.uint8)  # (T, C, H, W)
        # train: (T, C, crop, crop); test: (crops, T, C, crop, crop)
        return {"video": self.transform(clip), "label": sample["label"]}


def pytorchvideo_loader(cfg, pipeline: str, num_workers: int, pin_memory: bool):
    """``pytorchvideo.data.Kinetics`` (a ``LabeledVideoDataset``) on the same files: a random
    clip per video (train), or ``ConstantClipsPerVideoSampler(clip_duration, val_clips)``, one
    item per clip with ``val_crops`` crops (test). Returns what ``videotrain_loader`` does."""
    from pytorchvideo.data import Kinetics, make_clip_sampler

    from videotrain.data.loaders import resolve_root
    from videotrain.data.transforms import eval_transform, train_transform

    d = cfg.data
    root = resolve_root(d.name, d.root, d.get("synthetic"), d.layout)
    clip_duration = d.num_frames * d.sampling_rate / d.fps
    if pipeline == "train":
        csv, sampler, video_sampler = "train.csv", make_clip_sampler("random", clip_duration), \
            torch.utils.data.RandomSampler
        transform = train_transform(d.short_side, d.crop_size, tuple(d.train_scale), d.hflip)
        batch_size = d.batch_size
    else:
        csv, video_sampler = "val.csv", torch.utils.data.SequentialSampler
        sampler = make_clip_sampler("constant_clips_per_video", clip_duration, d.val_clips)
        transform = eval_transform(d.short_side, d.crop_size, d.val_crops)
        batch_size = d.val_batch_size * d.val_clips  # as many clips as a videotrain batch
    dataset = Kinetics(
        data_path=str(root / csv), clip_sampler=sampler, video_sampler=video_sampler,
        transform=_PeerTransform(d.num_frames, transform), video_path_prefix=str(root),
        decode_audio=False, decoder="pyav",
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                         pin_memory=pin_memory, drop_last=False)
    return loader, lambda epoch: None, dataset.num_videos, 1


def batches(loader, start) -> Iterator[torch.Tensor]:
    """The loader's ``video`` tensors, epoch after epoch (a tiny set runs out)."""
    epoch = 0
    while True:
        start(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch["video"]
        if empty:
            raise RuntimeError("the loader yields no batches")
        epoch += 1


def stop_workers(loader, stream) -> None:
    """End the loader's worker processes now. Left to the interpreter's exit, a persistent
    iterator is collected late, and joining each worker then times out (5 s a worker)."""
    stream.close()
    it = getattr(loader, "_iterator", None)  # persistent_workers keeps the iterator here
    if it is not None and hasattr(it, "_shutdown_workers"):
        loader._iterator = None
        it._shutdown_workers()


def timed_batches(timed_clips: int, clips_per_batch: int, workers: int) -> int:
    """Batches to time: enough for ``timed_clips`` clips, in whole waves of ``workers``."""
    waves = math.ceil(timed_clips / (clips_per_batch * workers))
    return max(waves, 1) * workers


# ---------------------------------------------------------------------- one row
def measure_data(spec: dict[str, Any]) -> dict[str, Any]:
    """Child side of one data row: ``spec`` has ``loader``, ``pipeline``, ``num_workers``,
    ``overrides`` (the set's, the user's, the backend's), ``timed_clips`` and ``device``."""
    if spec["loader"] not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, got {spec['loader']!r}")
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    from videotrain.build import compose_cfg

    cfg = compose_cfg(spec["overrides"])
    reason = unavailable(spec, cfg.data)
    if reason:
        return {"unavailable": reason}
    pipeline, workers = spec.get("pipeline", "train"), int(spec["num_workers"])
    pin = str(spec["device"]).startswith("cuda")
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    build = videotrain_loader if spec["loader"] == "videotrain" else pytorchvideo_loader
    t0 = time.perf_counter()
    loader, start, videos, clips_per_item = build(cfg, pipeline, workers, pin)
    stream = batches(loader, start)
    wave = max(workers, 1)
    first = [next(stream) for _ in range(wave)]  # the first wave also starts the workers
    startup = time.perf_counter() - t0
    per_batch = first[0].shape[0] * clips_per_item
    n = timed_batches(int(spec.get("timed_clips") or TIMED_CLIPS[pipeline]), per_batch, wave)
    clips = 0
    t1 = time.perf_counter()
    for _ in range(n):
        clips += next(stream).shape[0] * clips_per_item
    elapsed = time.perf_counter() - t1
    # one clip as the model gets it: train (T, C, h, w); test (crops, T, C, h, w) per clip
    shape = tuple(first[0].shape[1:])
    if spec["loader"] == "videotrain" and pipeline == "test":
        shape = (shape[0] // clips_per_item, *shape[1:])
    stop_workers(loader, stream)
    return {
        "clips_per_s": clips / elapsed, "clips_per_s_per_worker": clips / elapsed / wave,
        "clips": clips, "batches": n, "elapsed_s": elapsed, "startup_s": startup,
        "clip_shape": shape, "videos": videos, "batch_size": int(first[0].shape[0]),
        "pin_memory": pin, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "device": str(spec["device"]), "load_avg_start": load_avg,
        "decoder": cfg.data.get("decoder"), "sampler": cfg.data.get("sampler"),
    }


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
    from videotrain.build import compose_cfg

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
    """Child side: measure one row, print exactly one JSON line on stdout (the error, with
    status 1, where the row raised)."""
    try:
        result = measure_data(json.loads(spec_json))
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
    print(table, end="")
    failed = [r["name"] for r in rows if r.get("error")]
    if failed:
        print(f"{len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
