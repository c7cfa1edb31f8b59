"""The accuracy sweep at equal wall-clock time: ``python -m benchmarks.equal_time``.

A user spends time, not steps, so each row other than e2e trains for ``e2e's steps x (e2e's step
time / the row's step time)`` steps, its learning-rate schedule stretched or shrunk to match.
Both step times are measured here, on the machine that trains, in one process, the rows' steps
taken in turn so that a change in the machine's load reaches them alike.

It writes into ``--out`` (default ``outputs/bench_accuracy_time``) only ``step_times.json`` and
one ``conf/row/ROW-at-time.yaml`` per row, then runs the ordinary accuracy multirun over those
rows there; e2e is not trained again (the summary pairs the rows with the equal-step sweep's e2e
jobs). Step times already in ``step_times.json`` are reused, so a resumed sweep trains the same
steps. Usage and details: ``docs/design/internals.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from videotrain.untrusted import BadValue, read_json
from videotrain.untrusted.bounds import ANY, MAX_KEY_CHARS, Float, Map, Str
from videotrain.untrusted.files import write_text

CONF = Path(__file__).resolve().parent / "conf"
RECORD_BYTES = 1 << 20  # step_times.json: a few rows' seconds
# what step_times.json may record of a step: positive seconds, at most an hour (a recorded
# time is divided by and multiplied into step counts, so a huge or tiny one overflows them)
STEP_SECONDS = Float(1e-6, 3600.0)
RECORD = Map({"step_s": Map(extra=STEP_SECONDS, keys=Str(MAX_KEY_CHARS), max_len=1000)},
             extra=ANY)  # the rest (threads, steps, overrides) is written for the reader only
SWEEP = "+sweep=accuracy"
CLASSES = 4  # every temporal task's classes


def sweep_overrides(row: str, extra: list[str]) -> list[str]:
    """The overrides that compose one job of the accuracy sweep for ``row``."""
    return [f"hydra.searchpath=[file://{CONF}]", SWEEP, f"row={row}", *extra]


def interleaved_medians(steps_of: dict[str, Callable[[], None]], steps: int,
                        warmup: int) -> dict[str, float]:
    """The median seconds of each callable over ``steps`` calls after ``warmup``, run in rounds of
    one call each, so that a change in the machine's load reaches every row alike."""
    samples: dict[str, list[float]] = {name: [] for name in steps_of}
    for i in range(warmup + steps):
        for name, step in steps_of.items():
            start = time.perf_counter()
            step()
            if i >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure_step_times(rows: list[str], extra: list[str], threads: int, steps: int = 20,
                       warmup: int = 5) -> dict[str, float]:
    """Seconds per training step of each row's model (median of ``steps`` after ``warmup``), the
    rows' steps interleaved in this process with ``threads`` torch threads, on the device the
    sweep trains on."""
    import torch

    from videotrain.config.build import build_model, compose_cfg

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steps_of: dict[str, Callable[[], None]] = {}
        for row in rows:
            cfg = compose_cfg(sweep_overrides(row, extra))
            cuda = torch.cuda.is_available() and str(cfg.device) != "cpu"
            device = torch.device("cuda" if cuda else "cpu")
            torch.manual_seed(0)
            model = build_model(cfg, num_classes=CLASSES).to(device).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            d = cfg.data
            video = torch.randn(d.batch_size, d.num_frames, 3, d.crop_size, d.crop_size,
                                device=device)  # (B, T, C, H, W)
            labels = torch.arange(d.batch_size, device=device) % CLASSES

            def step(model=model, opt=opt, video=video, labels=labels, cuda=cuda,
                     device=device) -> None:
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(video), labels).backward()
                opt.step()
                if cuda:
                    torch.cuda.synchronize(device)

            steps_of[row] = step
        return interleaved_medians(steps_of, steps, warmup)
    finally:
        torch.set_num_threads(previous)


def e2e_steps(extra: list[str]) -> tuple[int, int]:
    """(optimizer steps per epoch, total steps) of the sweep's e2e job under ``extra``."""
    from videotrain.config.build import compose_cfg
    from videotrain.engine.settings import TrainerSettings
    from videotrain.engine.trainer import plan_steps

    cfg = compose_cfg(sweep_overrides("e2e", extra))
    batches = cfg.data.synthetic.train_per_class * CLASSES // cfg.data.batch_size  # drop_last
    t = cfg.trainer
    return plan_steps(batches, TrainerSettings(max_epochs=t.max_epochs, max_steps=t.max_steps,
                                               grad_accum=t.grad_accum))


def at_time_steps(times: dict[str, float], steps: int) -> dict[str, int]:
    """Each row's steps at e2e's wall-clock time: ``steps x times[e2e] / times[row]``, at least 1."""
    return {row: max(1, round(steps * times["e2e"] / t)) for row, t in times.items() if row != "e2e"}


def write_row(out: Path, row: str, steps: int, per_epoch: int) -> str:
    """``out/conf/row/ROW-at-time.yaml``: the row's own config, trained for ``steps``."""
    name = f"{row}-at-time"
    body = (CONF / "row" / f"{row}.yaml").read_text()
    extra = (f"# equal time (benchmarks/equal_time.py): e2e's wall-clock time on this machine\n"
             f"trainer:\n  max_steps: {steps}\n  max_epochs: {math.ceil(steps / per_epoch)}\n")
    own = Path(out).resolve()  # the user's --out, followed as given; conf/row/ below it is ours
    write_text(own / "conf" / "row" / f"{name}.yaml", body.rstrip("\n") + "\n" + extra, root=own)
    return name


def step_times(out: Path, rows: list[str], extra: list[str], threads: int, steps: int = 20,
               warmup: int = 5) -> dict[str, float]:
    """The step times of ``rows`` and e2e: those kept in ``out/step_times.json``, the missing ones
    measured beside e2e now (scaled to the kept e2e's time) and kept."""
    record = out / "step_times.json"
    # read as the one reader reads: a regular file (a link there is refused), of bounded size,
    # counted before it is parsed, and each time checked (BadValue names the file and key)
    kept = (read_json(record, RECORD, RECORD_BYTES, "step_times.json")
            if os.path.lexists(record) else {})
    known = kept.get("step_s", {})
    missing = [r for r in rows if r not in known]
    if missing or "e2e" not in known:
        new = measure_step_times(["e2e", *missing], extra, threads, steps, warmup)
        scale = known["e2e"] / new["e2e"] if "e2e" in known else 1.0
        known.update({r: t * scale for r, t in new.items() if r not in known})
        write_text(record, json.dumps({"step_s": known, "threads": threads, "steps": steps,
                                       "warmup": warmup, "overrides": extra}, indent=2) + "\n")
    return known


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.equal_time", description=__doc__.split("\n\n")[0],
                                epilog="Other arguments are Hydra overrides of the sweep, e.g. seed=0,1,2 "
                                       "data.synthetic.task=direction,order (comma lists are swept).")
    p.add_argument("--rows", default="sbp-frame-0.5,sbp-frame-0.25",
                   help="comma-separated rows of benchmarks/conf/row/ (default: %(default)s)")
    p.add_argument("--out", default="outputs/bench_accuracy_time",
                   help="the sweep folder: step times, row configs, jobs (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads while measuring: those each job trains with (default: all cores)")
    p.add_argument("--steps", type=int, default=20,
                   help="timed steps per row, interleaved across rows (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps per row before them (default: %(default)s)")
    p.add_argument("--measure-only", action="store_true",
                   help="write the step times and row configs, print the multirun, train nothing")
    args, extra = p.parse_known_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip() and r.strip() != "e2e"]
    unknown = [r for r in rows if not (CONF / "row" / f"{r}.yaml").is_file()]
    bad = [o for o in extra if o.startswith("-") or "=" not in o]
    problem = (f"--rows {','.join(unknown)}: no such row in {CONF / 'row'}" if unknown else
               f"not a Hydra override: {bad[0]}" if bad else
               "--rows names no row but e2e" if not rows else
               f"--steps {args.steps} / --warmup {args.warmup}: at least 1 timed step and no "
               "negative warm-up" if args.steps < 1 or args.warmup < 0 else None)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # the step time does not depend on the task or seed: measured on the first values given
    single = [o.split(",")[0] if o.split("=")[0] in ("seed", "data.synthetic.task") else o
              for o in extra]
    out = Path(args.out)
    try:  # a record that is no regular file or no mapping; a link below --out: refused
        times = step_times(out, rows, single, args.threads, args.steps, args.warmup)
        per_epoch, steps = e2e_steps(single)
        sized = at_time_steps({r: times[r] for r in ("e2e", *rows)}, steps)
        names = [write_row(out, r, n, per_epoch) for r, n in sized.items()]
    except (ValueError, OSError) as err:  # UnsafeFileError and BadValue are ValueErrors
        hint = "; delete it to measure again" if isinstance(err, BadValue) else ""
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2
    for r, n in sized.items():
        print(f"{r}: {times[r]:.3f} s a step against e2e's {times['e2e']:.3f} s: {n} steps "
              f"(e2e: {steps})")
    cmd = [sys.executable, "-m", "videotrain", "-m", "--config-dir", str(CONF),
           f"hydra.searchpath=[file://{(out / 'conf').resolve()}]", SWEEP,
           f"row={','.join(names)}", f"hydra.sweep.dir={out}", *extra]
    print(" ".join(cmd[1:]), flush=True)
    if args.measure_only:
        return 0
    os.execv(sys.executable, cmd)  # the ordinary multirun, nothing in between
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
