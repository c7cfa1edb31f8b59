"""The accuracy suite (``python -m videotrain.bench --suite accuracy``): what each memory strategy
costs in accuracy, on temporal tasks that the default model does not saturate.

Every (task, row, seed) is one ordinary training run, ``python -m videotrain`` in a fresh
subprocess on a generated task of ``videotrain/data/temporal_tasks.py`` (four classes each,
an order-blind model at chance), with the default model, the suite's recipe (``SUITE_RECIPE``:
more videos, a lower learning rate) and the row's ``memory`` overrides. Runs of one seed share
the model initialisation and the data order, so each row is compared with ``e2e`` of the same
task and seed: the paired difference, with a 95% Student-t interval over seeds (per task) and
over every (task, seed) pair (the average over the tasks).
Stored activations, the memory a row saves, are counted for one training forward of the
row's model (``metrics.saved``), relative to ``e2e``.

The runs live in ``--runs-dir`` (default ``outputs/bench_accuracy``); a finished run (its
``results.json``) is not run again: an interrupted suite goes on where it stopped, from the
checkpoints of the run it stopped in. A finished run's checkpoints are deleted (about 150 MB a
run, 11 GB for the whole suite, and the report needs none of them) unless
``--keep-checkpoints``. A finished run made with other overrides (an older recipe) stops the
suite before it starts, naming the keys. Results: ``accuracy.json`` (every run),
``accuracy.md`` (the tables) and ``accuracy.png`` (accuracy against stored activations) in
``--out``.

Equal time (``--equal-time``): a user spends wall-clock time, not steps, so each row other than
e2e trains for ``e2e's steps x (e2e's step time / the row's step time)`` steps (its learning-rate
schedule stretched or shrunk to match), where both step times are measured in the same suite run,
on the machine that trains: a few training steps of each row's model on a batch of the
configured shape, in one process, one row after the other (:func:`measure_step_times`). The
measurement is kept in ``--runs-dir``'s ``equal_time.json``, so a resumed suite trains the same
steps (delete it to measure again). The rows are reported as ``ROW@time``, paired with e2e's runs
of the same task and seed (the equal-step e2e runs: e2e's steps are the same either way).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TASKS = ("direction", "rotation", "order", "speed")
SEEDS = (0, 1, 2)
RESULTS = "docs/results/bench_accuracy"
RUNS = "outputs/bench_accuracy"
JOBS = 2  # training runs at a time (--jobs)
CHANCE = 0.25  # every task has 4 classes
NOT_RUN = "not run"  # the error of a run --report-only found unfinished (not a failure)
# the generated tasks: 16 source frames, so the default clip (8 frames at rate 2) spans the video;
# validation once, at the end, on 32 videos per class; the CPU peak meter on as few steps as it takes
TASK_DATA = ("data.synthetic.num_frames=16", "data.synthetic.val_per_class=32",
             "trainer.val_every_n_epochs=${trainer.max_epochs}", "trainer.cpu_metered_steps=2")
# the suite's recipe on them: 256 training videos per class for 2 epochs (the default job's 256
# steps) at lr 3e-4. With the default job's 64 videos at lr 1e-3 some seeds memorise their
# videos or stall at ln 2 (one of two binary factors learned): docs/benchmarks.md "The suite's
# recipe". The default job keeps lr 1e-3 (val 1.00 on its task; 0.984 at 3e-4).
SUITE_RECIPE = ("data.synthetic.train_per_class=256", "trainer.max_epochs=2", "optim.lr=3e-4")
CLASSES = 4  # every task's classes
EQUAL_TIME = "equal_time.json"  # in --runs-dir: the step times the equal-time rows were sized by


@dataclass(frozen=True)
class Row:
    name: str
    overrides: tuple[str, ...]
    frame_mixing: bool | None = None  # True: only where the backbone mixes frames; False: only where not
    default: bool = True  # False: a settings variant, run only when --only names it


_STRATEGY_ROWS: tuple[Row, ...] = (
    Row("e2e", ("memory=e2e",)),
    # frame granularity on every backbone (on a temporal-shift one through the lockstep code since
    # issue 45, the default granularity there), block granularity where the backbone mixes frames
    Row("sbp-frame-0.5", ("memory=sbp", "memory.keep_ratio=0.5", "memory.granularity=frame")),
    Row("sbp-frame-0.25", ("memory=sbp", "memory.keep_ratio=0.25", "memory.granularity=frame")),
    Row("sbp-block-0.5", ("memory=sbp", "memory.keep_ratio=0.5", "memory.granularity=block"), True),
    Row("sbp-block-0.25", ("memory=sbp", "memory.keep_ratio=0.25", "memory.granularity=block"), True),
    Row("frame_dropout-0.5", ("memory=frame_dropout", "memory.keep_ratio=0.5")),
    Row("frame_dropout-0.25", ("memory=frame_dropout", "memory.keep_ratio=0.25")),
    Row("checkpoint-optimal", ("memory=checkpoint", "memory.policy=optimal")),
)
# the re-check of SBP's defaults: each SBP row with one setting changed from its default (sampler
# uniform; grad_scale auto: inverse_keep at block granularity, none at frame), e.g.
# --only 'e2e,sbp-block-0.5,sbp-block-0.5-*'
def _settings(granularity: str) -> tuple[tuple[str, str], ...]:
    grad = ("unscaled", "memory.grad_scale=none") if granularity == "block" else (
        "inverse_keep", "memory.grad_scale=inverse_keep")
    return ("random", "memory.sampler=random"), grad


ROWS: tuple[Row, ...] = _STRATEGY_ROWS + tuple(
    Row(f"{r.name}-{name}", (*r.overrides, change), r.frame_mixing, default=False)
    for r in _STRATEGY_ROWS if r.name.startswith("sbp-")
    for name, change in _settings(r.name.split("-")[1])
)

# two-sided 95% Student-t quantiles by degrees of freedom (larger df: the normal's 1.96)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
        17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 24: 2.064, 29: 2.045, 40: 2.021, 60: 2.000}


def t95(df: int) -> float:
    """The two-sided 95% Student-t quantile for ``df`` degrees of freedom (conservative between
    tabulated values)."""
    if df < 1:
        return math.nan
    if df > max(_T95):
        return 1.96
    return _T95[max(k for k in _T95 if k <= df)]


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean, sample std and the half-width of the mean's 95% t interval (nan for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan, math.nan
    sd = statistics.stdev(values)
    return m, sd, t95(len(values) - 1) * sd / math.sqrt(len(values))


def rows_for(overrides: list[str]) -> list[Row]:
    """The suite's rows for a model: frame-granularity SBP on every backbone, block granularity
    too where the backbone mixes frames (``model.backbone.temporal_shift``)."""
    from videotrain.build import compose_cfg, config_mixes_frames

    mixing = config_mixes_frames(compose_cfg(overrides))
    return [r for r in ROWS if r.frame_mixing is None or r.frame_mixing == mixing]


def run_overrides(task: str, row: Row, seed: int, extra: list[str]) -> list[str]:
    return [f"data.synthetic.task={task}", *TASK_DATA, *SUITE_RECIPE, f"seed={seed}", *row.overrides,
            *extra, "trainer.progress=false", "logger.wandb.mode=disabled"]


def _as_dict(overrides: list[str]) -> dict[str, str]:
    """``key=value`` overrides as {key: value}, the last one winning (as in Hydra)."""
    return dict(o.partition("=")[::2] for o in overrides)


def _same(a: str | None, b: str | None) -> bool:
    """One override value: numbers as numbers (``3e-4`` is ``0.0003``), the rest as text."""
    try:
        return float(a) == float(b)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return a == b


def stale_run(run_dir: Path, overrides: list[str]) -> str | None:
    """Why the finished run in ``run_dir`` is not this (task, row, seed) under ``overrides``:
    the keys whose values differ from those it was run with (its ``.hydra/overrides.yaml``), or
    None. A run of an older suite recipe, or of other overrides, must not be reported as this
    one. A run without the record (restored results) is taken as it is."""
    import yaml

    record = run_dir / ".hydra" / "overrides.yaml"
    if not (run_dir / "results.json").exists() or not record.exists():
        return None
    old, new = _as_dict(yaml.safe_load(record.read_text()) or []), _as_dict(overrides)
    diffs = [f"{k}: {old.get(k, '(not set)')} -> {new.get(k, '(not set)')}"
             for k in sorted(set(old) | set(new)) if not _same(old.get(k), new.get(k))]
    return "; ".join(diffs) or None


def train_one(run_dir: Path, overrides: list[str], threads: int, timeout: float,
              train: bool = True, keep_checkpoints: bool = False) -> dict[str, Any]:
    """One training run in a fresh interpreter; its results.json, or the error it ended with.
    ``train=False``: only what a finished run left (the report of a partial suite). The
    checkpoints of a run that finished are deleted unless ``keep_checkpoints``; those of a run
    that failed or timed out stay, for its resume."""
    done = run_dir / "results.json"
    if done.exists():
        return json.loads(done.read_text())
    if not train:
        return {"error": NOT_RUN}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "videotrain", *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not done.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    result = json.loads(done.read_text())
    result["wall_s"] = time.perf_counter() - start
    done.write_text(json.dumps(result, indent=2))
    if not keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return result


def measure_step_times(rows: list[Row], extra: list[str], threads: int, steps: int = 5,
                       warmup: int = 2) -> dict[str, float]:
    """Seconds per training step (forward, loss, backward, optimizer step; the median of
    ``steps`` after ``warmup``) of each row's model on a random batch of the configured shape,
    one row after the other in this process with ``threads`` torch threads, on the device the
    runs train on: the step times equal-time mode sizes its rows by."""
    import torch

    from videotrain.build import build_model, compose_cfg

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    times: dict[str, float] = {}
    try:
        for row in rows:
            cfg = compose_cfg([*row.overrides, *extra])
            device = torch.device("cuda" if torch.cuda.is_available() and str(cfg.device) != "cpu" else "cpu")
            torch.manual_seed(0)
            model = build_model(cfg, num_classes=CLASSES).to(device).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            d = cfg.data
            video = torch.randn(d.batch_size, d.num_frames, 3, d.crop_size, d.crop_size, device=device)
            labels = torch.arange(d.batch_size, device=device) % CLASSES
            samples = []
            for i in range(warmup + steps):
                start = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(video), labels).backward()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    samples.append(time.perf_counter() - start)
            times[row.name] = statistics.median(samples)
    finally:
        torch.set_num_threads(previous)
    return times


def e2e_steps(extra: list[str]) -> tuple[int, int]:
    """(optimizer steps per epoch, total steps) of an e2e run of the suite with ``extra``."""
    from videotrain.build import compose_cfg
    from videotrain.engine.trainer import TrainerSettings, plan_steps

    cfg = compose_cfg(run_overrides(TASKS[0], _STRATEGY_ROWS[0], 0, extra))
    batches = cfg.data.synthetic.train_per_class * CLASSES // cfg.data.batch_size  # drop_last
    t = cfg.trainer
    return plan_steps(batches, TrainerSettings(max_epochs=t.max_epochs, max_steps=t.max_steps,
                                               grad_accum=t.grad_accum))


def equal_time_rows(rows: list[Row], times: dict[str, float], per_epoch: int, steps: int) -> list[Row]:
    """``rows`` with every row but e2e trained for ``steps x times[e2e] / times[row]`` steps (at
    least one): ``ROW@time``, with ``trainer.max_steps`` and enough ``trainer.max_epochs``."""
    out = []
    for r in rows:
        if r.name == "e2e":
            out.append(r)
            continue
        n = max(1, round(steps * times["e2e"] / times[r.name]))
        out.append(Row(f"{r.name}@time", (*r.overrides, f"trainer.max_steps={n}",
                                          f"trainer.max_epochs={math.ceil(n / per_epoch)}"),
                       r.frame_mixing, r.default))
    return out


def stored_activation_bytes(overrides: list[str]) -> int:
    """Bytes that one training forward of the row's model keeps for backward, on a batch of
    the configured shape (the same for every task: they share the clip and model settings)."""
    import torch

    from videotrain.build import build_model, compose_cfg
    from videotrain.metrics.saved import saved_activation_bytes

    cfg = compose_cfg(overrides)
    torch.manual_seed(0)
    model = build_model(cfg, num_classes=4).train()
    d = cfg.data
    video = torch.randn(d.batch_size, d.num_frames, 3, d.crop_size, d.crop_size)  # (B, T, C, H, W)
    return saved_activation_bytes(model, video)


def summarize(runs: list[dict[str, Any]], rows: list[Row], metric: str = "val_top1") -> dict[str, Any]:
    """Per (task, row): mean/std of ``metric`` over seeds and the paired difference to e2e with
    its interval; per row: the same over every (task, seed) pair. A run without the metric (not
    finished, or older than it) is left out, not counted as zero."""
    acc = {(r["task"], r["row"], r["seed"]): float(r[metric]) for r in runs
           if isinstance(r.get(metric), (int, float)) and not math.isnan(r[metric])}
    digests = {(r["task"], r["row"], r["seed"]): r.get("param_digests") for r in runs if "val_top1" in r}
    per_task, overall = [], []
    tasks = sorted({r["task"] for r in runs}, key=lambda t: TASKS.index(t) if t in TASKS else 99)
    for row in rows:
        pooled: list[float] = []
        for task in tasks:
            seeds = sorted(s for (t, n, s) in acc if t == task and n == row.name)
            if not seeds:
                continue
            vals = [acc[task, row.name, s] for s in seeds]
            diffs = [acc[task, row.name, s] - acc[task, "e2e", s] for s in seeds if (task, "e2e", s) in acc]
            pooled += diffs
            m, sd, _ = mean_ci(vals)
            dm, _, dci = mean_ci(diffs) if diffs else (math.nan, math.nan, math.nan)
            per_task.append({"task": task, "row": row.name, "seeds": len(vals), "mean": m, "std": sd,
                             "diff": dm, "diff_ci95": dci})
        if pooled:
            dm, dsd, dci = mean_ci(pooled)
            means = [p["mean"] for p in per_task if p["row"] == row.name]
            # the trained weights equal e2e's in every (task, seed) pair (checkpointing must)
            same = [digests[k] is not None and digests[k] == digests.get((k[0], "e2e", k[2]))
                    for k in digests if k[1] == row.name and (k[0], "e2e", k[2]) in digests]
            overall.append({"row": row.name, "pairs": len(pooled), "mean": statistics.fmean(means),
                            "diff": dm, "diff_std": dsd, "diff_ci95": dci,
                            "weights_equal_e2e": bool(same) and all(same)})
    return {"per_task": per_task, "overall": overall}


def _pct(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:+.1f}"


def _pm(x: float, fmt: str) -> str:
    """`` ± x`` in ``fmt``, or nothing where one value has no spread (one seed, one pair)."""
    return "" if math.isnan(x) else f" ± {x:{fmt}}"


def _diff_top1(d: float, ci: float) -> str:
    return f"{_pct(d)}{_pm(100 * ci, '.1f')}"  # in points


def _diff_loss(d: float, ci: float) -> str:
    return f"{'–' if math.isnan(d) else f'{d:+.3f}'}{_pm(ci, '.3f')}"


def _table(summary: dict[str, Any], stored: dict[str, float] | None,
           diff: Callable[[float, float], str]) -> list[str]:
    """One markdown table: a line per row, a column per task that has a value (mean ± std over
    seeds, with the paired Δ to e2e), the mean over tasks and the pooled Δ; ``stored`` adds that
    column."""
    tasks = list(dict.fromkeys(p["task"] for p in summary["per_task"]))
    head = "| row | " + ("stored | " if stored is not None else "")
    lines = [head + " | ".join(tasks) + " | mean | Δ mean (95% CI) |",
             "|---|" + ("---|" if stored is not None else "") + "---|" * len(tasks) + "---|---|"]
    by = {(p["task"], p["row"]): p for p in summary["per_task"]}
    for o in summary["overall"]:
        cells = []
        for t in tasks:
            p = by.get((t, o["row"]))
            if p is None:
                cells.append("–")
                continue
            cell = f"{p['mean']:.3f}{_pm(p['std'], '.3f')}"
            if o["row"] != "e2e":
                cell += f" (Δ {diff(p['diff'], p['diff_ci95'])})"
            cells.append(cell)
        delta = "" if o["row"] == "e2e" else f"{diff(o['diff'], o['diff_ci95'])} (n={o['pairs']})"
        if o["row"] != "e2e" and o["weights_equal_e2e"]:
            delta += "; weights identical to e2e"
        col = f"{stored.get(o['row'], math.nan):.2f} | " if stored is not None else ""
        lines.append(f"| {o['row']} | {col}" + " | ".join(cells) + f" | {o['mean']:.3f} | {delta} |")
    return lines


def render(summary: dict[str, Any], stored: dict[str, float], meta: dict[str, Any],
           loss: dict[str, Any] | None = None) -> str:
    """The report: val top-1 with stored activations, then (``loss``: ``summarize`` of
    ``val_loss``) the same for the val loss, which still tells rows apart where top-1 saturates."""
    lines = [f"# Accuracy suite: {meta['command']}", "",
             f"{meta['machine']}; {len(meta['seeds'])} seeds ({', '.join(map(str, meta['seeds']))}); "
             "val top-1 on 128 videos per task (32 per class); mean ± std over seeds; Δ: the paired "
             "difference to e2e of the same task and seed, in points, ± the 95% t interval's "
             "half-width. Stored: activations one training forward keeps, relative to e2e.", "",
             *_table(summary, stored, _diff_top1)]
    timing = meta.get("equal_time")
    if timing:
        sizes = ", ".join(f"{name} {n} ({timing['step_s'].get(name.removesuffix('@time'), math.nan):.3f} s)"
                          for name, n in timing["steps"].items())
        lines[4:4] = ["Equal time: every row trained for e2e's wall-clock time, e2e's steps x (e2e's "
                      "step time / the row's), the step times measured in this suite run on this "
                      f"machine: steps (s per step) {sizes}.", ""]
    if loss and loss["overall"]:
        lines += ["", "Val loss (cross-entropy on the same videos; lower is better, ln 4 = 1.386 is a "
                  "uniform guess): where top-1 saturates at 1.000 the loss still shows how far each row "
                  "got. Δ in loss units.", "",
                  *_table(loss, None, _diff_loss)]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], stored: dict[str, float], path: Path) -> None:
    """``path``: accuracy against stored activations, per task and the mean over tasks."""
    import matplotlib.pyplot as plt

    fig = figure(summary, stored)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(summary: dict[str, Any], stored: dict[str, float]) -> Any:
    """The plot's matplotlib figure (Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for o in summary["overall"]:
        x = stored.get(o["row"], math.nan)
        ax.plot([x], [o["mean"]], "o")
        ax.annotate(o["row"], (x, o["mean"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for t in dict.fromkeys(p["task"] for p in summary["per_task"]):
        pts = sorted((stored.get(p["row"], math.nan), p["mean"]) for p in summary["per_task"] if p["task"] == t)
        ax.plot([a for a, _ in pts], [b for _, b in pts], ".", alpha=0.5, label=t)
    # a fixed axis from below chance (every task has 4 classes) to 1: a one-video difference
    # between saturated rows must not fill the plot
    low = min([0.2, *(p["mean"] - 0.05 for p in summary["per_task"])])
    ax.axhline(CHANCE, color="grey", linestyle=":", linewidth=1)
    ax.annotate("chance", (0.0, CHANCE), xycoords=("axes fraction", "data"), xytext=(3, 3),
                textcoords="offset points", fontsize=7, color="grey")
    ax.set_ylim(low, 1.02)
    ax.set_xlabel("stored activations per training forward (fraction of e2e)")
    ax.set_ylabel("val top-1 (mean over seeds; large: mean over tasks)")
    if ax.get_legend_handles_labels()[0]:  # no task has a finished run: no legend (and no warning)
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def run_accuracy_bench(out: str | Path = RESULTS, tasks: list[str] | None = None,
                       seeds: list[int] | None = None, only: list[str] | None = None,
                       extra: list[str] | None = None, jobs: int = JOBS, timeout: float = 1800,
                       train: bool = True, runs_dir: str | Path = RUNS, threads: int | None = None,
                       keep_checkpoints: bool = False, equal_time: bool = False,
                       ) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """Run (or resume) the suite and write its results; returns (runs, summary, markdown).
    ``train=False`` reports the finished runs and trains nothing. ``threads``: torch threads per
    run (default: the cores shared among ``jobs``; two suites at once need it set).
    ``keep_checkpoints``: keep each finished run's checkpoints (deleted by default).
    ``equal_time``: every row but e2e trains for e2e's wall-clock time (module doc)."""
    import fnmatch
    import platform

    out, extra = Path(out), list(extra or [])
    tasks, seeds = list(tasks or TASKS), list(seeds or SEEDS)
    available = rows_for(extra)
    unmatched = [g for g in only or [] if not any(fnmatch.fnmatch(r.name, g) for r in available)]
    if unmatched:  # a renamed or mistyped row would otherwise run nothing, silently
        raise ValueError(f"--only {','.join(unmatched)}: no such row for this model; rows: "
                         f"{', '.join(r.name for r in available)}")
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"--tasks {','.join(unknown)}: no such task; tasks: {', '.join(TASKS)}")
    rows = [r for r in available if r.name == "e2e" or (r.default if not only else
            any(fnmatch.fnmatch(r.name, g) for g in only))]
    threads_arg, threads = threads, threads or max(1, (os.cpu_count() or 1) // max(jobs, 1))
    timing: dict[str, Any] | None = None
    if equal_time:
        record = Path(runs_dir) / EQUAL_TIME
        timing = json.loads(record.read_text()) if record.exists() else {}
        known = timing.setdefault("step_s", {})
        missing = [r for r in rows if r.name not in known]
        if missing and train:  # measured with e2e in this run, then kept for resumes
            new = measure_step_times([rows[0], *(r for r in missing if r.name != "e2e")], extra, threads)
            # a row added later keeps its ratio to the e2e it was measured beside
            scale = known["e2e"] / new["e2e"] if "e2e" in known else 1.0
            known.update({name: t * scale for name, t in new.items() if name not in known})
            timing["threads"] = threads
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(timing, indent=2))
        elif missing:
            raise ValueError(f"--equal-time --report-only: no step times in {record} for "
                             f"{', '.join(r.name for r in missing)}")
        per_epoch, steps = e2e_steps(extra)
        rows = equal_time_rows(rows, timing["step_s"], per_epoch, steps)
        timing["steps"] = {r.name: int(_as_dict(list(r.overrides)).get("trainer.max_steps", steps))
                           for r in rows}
    todo = [(t, r, s) for s in seeds for t in tasks for r in rows]
    for t, r, s in todo:  # before any run starts: a finished run of other overrides is not reused
        run_dir = Path(runs_dir) / t / r.name / f"seed{s}"
        why = stale_run(run_dir, run_overrides(t, r, s, extra))
        if why:
            raise ValueError(f"{run_dir} holds a finished run with other overrides ({why}); "
                             "delete it, or pass another --runs-dir")

    def one(item: tuple[str, Row, int]) -> dict[str, Any]:
        t, r, s = item
        res = train_one(Path(runs_dir) / t / r.name / f"seed{s}", run_overrides(t, r, s, extra), threads,
                        timeout, train, keep_checkpoints)
        print(f"{t} {r.name} seed {s}: " + (f"val top-1 {res['val_top1']:.3f}" + (
            f", loss {res['val_loss']:.3f}" if isinstance(res.get("val_loss"), (int, float)) else "")
            if "val_top1" in res else res["error"]), flush=True)
        return {"task": t, "row": r.name, "seed": s, **res}

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        runs = list(pool.map(one, todo))
    e2e_bytes = stored_activation_bytes(list(extra))
    stored = {r.name: stored_activation_bytes([o for o in (*r.overrides, *extra)
                                                 if not o.startswith("trainer.max_")]) / e2e_bytes
              for r in rows}
    summary, loss = summarize(runs, rows), summarize(runs, rows, "val_loss")
    # the command that reproduces these results: every flag whose value is not the default
    flags = (["--equal-time"] if equal_time else []) + ([f"--tasks {','.join(tasks)}"] if tasks != list(TASKS) else []) + (
        [f"--seeds {','.join(map(str, seeds))}"] if seeds != list(SEEDS) else []) + (
        [f"--only '{','.join(only)}'"] if only else []) + (
        [f"--jobs {jobs}"] if jobs != JOBS else []) + ([f"--threads {threads_arg}"] if threads_arg else []) + (
        [f"--runs-dir {runs_dir}"] if Path(runs_dir) != Path(RUNS) else []) + (
        [f"--out {out}"] if out != Path(RESULTS) else [])
    meta = {"command": " ".join(["python -m videotrain.bench --suite accuracy", *flags, *extra]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {jobs} "
                       f"run{'s' if jobs != 1 else ''} at a time, {threads} torch thread{'s' if threads != 1 else ''} each",
            "seeds": seeds, "tasks": tasks, "extra_overrides": extra, "stored_frac": stored,
            "equal_time": timing}
    table = render(summary, stored, meta, loss)
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k not in ("param_digests", "class_names", "skipped_paths")} for r in runs]
    (out / "accuracy.json").write_text(json.dumps({"meta": meta, "summary": summary, "summary_val_loss": loss,
                                                       "runs": slim}, indent=2))
    (out / "accuracy.md").write_text(table)
    plot(summary, stored, out / "accuracy.png")
    return runs, summary, table
