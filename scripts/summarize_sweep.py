#!/usr/bin/env python
"""Tabulate and plot a Hydra multirun of ``python -m videotrain``.

    python scripts/summarize_sweep.py multirun/2024-01-01/12-00-00 [more folders] [--out DIR]

Reads every job's ``results.json`` and ``.hydra/overrides.yaml`` (``.hydra/config.yaml`` for a
job that died first), writes ``summary.md`` (one row per job; failed jobs listed) and
``summary.png`` (val top-1 and peak memory against keep ratio, one line per strategy), and prints
the table. Where the jobs hold e2e runs, each job is paired with the e2e job of the same seed and
other overrides, and the summary adds the paired differences with their 95% Student-t intervals.

Invariants: a sweep folder may be someone else's, so it is read as data only, within bounds
(``videotrain.untrusted``); a job file that fails lists its job as failed with the reason, never
the file's text; every text taken from a job is escaped; a folder that cannot be checked, listed
or written ends the script with one ``error:`` line and exit status 2. How keep ratios, lines and
pairs are found: ``docs/design/internals.md``.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from videotrain.untrusted import check_run_folder, shown, write_bytes, write_text
from videotrain.untrusted.bounds import (
    ANY,
    MAX_CONFIG_BYTES,
    MAX_OVERRIDES_BYTES,
    MAX_RESULTS_BYTES,
    MAX_STEPS,
    MAX_SWEEP_DEPTH,
    MAX_SWEEP_ENTRIES,
    BadValue,
    Float,
    Map,
    Optional,
    Seq,
    Str,
    checked,
)
from videotrain.untrusted.files import read_text
from videotrain.untrusted.formats import load_yaml_data, read_json

# Overrides shown in their own columns or averaged over, never used to split lines.
OWN_COLUMNS = {"memory", "memory.keep_ratio", "memory.granularity", "seed", "memory.seed", "row"}
TARGETS = {"EndToEnd": "e2e", "StochasticBackprop": "sbp", "FrameDropout": "frame_dropout",
           "Recompute": "recompute", "AutoStrategy": "auto"}
CELL_CHARS = 120  # a text cell (a job's name, its overrides) is cut to this many characters

# what this script reads of a job's files (any other key is ignored, bounded by the reader)
_NUMBER = Optional(Float(finite=False))
_TEXT = Optional(Str(256))
_MEMORY = Optional(Map({"strategy": _TEXT, "granularity": _TEXT, "keep_ratio": _NUMBER,
                        "_target_": _TEXT}, extra=ANY))
RESULTS = Map({"val_top1": _NUMBER, "val_top5": _NUMBER, "train_peak_mem_mb": _NUMBER,
               "step_time_s": _NUMBER, "clips_per_s": _NUMBER, "val_loss": _NUMBER,
               "epochs": Optional(Float(0, MAX_STEPS)), "memory_strategy": _TEXT,
               "memory": _MEMORY, "param_digests": Optional(Seq(Str(256), 100_000))}, extra=ANY)
OVERRIDES = Optional(Seq(Str(4096), 10_000))  # Hydra's list of key=value strings
JOB_CONFIG = Optional(Map({"memory": _MEMORY}, extra=ANY))


class JobFileError(ValueError):
    """A job's file that cannot be read as what this script expects (the job is failed)."""


def _read_yaml(path: Path, limit: int) -> Any:
    """A job's YAML file as plain data (bounded, no tags, anchors or aliases); None if absent;
    :class:`JobFileError` naming the file otherwise."""
    try:
        return load_yaml_data(read_text(path, limit, path.name), shown(path))
    except FileNotFoundError:
        return None
    except ValueError as err:  # UnsafeFileError, BadValue: the file named, never its text
        raise JobFileError(str(err)) from None
    except OSError as err:
        raise JobFileError(f"{shown(path)} cannot be read ({err.strerror})") from None


def _parse_value(text: str) -> Any:
    """An override's value as YAML would type it (``0.5`` a number), else the text itself."""
    try:
        return load_yaml_data(text, "an override's value")
    except (BadValue, RecursionError):
        return text


def read_overrides(job: Path) -> dict[str, Any]:
    """``.hydra/overrides.yaml`` (a list of ``key=value``) -> ``{key: value}``."""
    path = job / ".hydra" / "overrides.yaml"
    items = _read_yaml(path, MAX_OVERRIDES_BYTES)
    try:
        checked(items, OVERRIDES, shown(path))
    except BadValue as err:
        raise JobFileError(str(err)) from None
    out: dict[str, Any] = {}
    for item in items or []:
        key, _, value = item.partition("=")
        out[key.lstrip("+~")] = _parse_value(value)
    return out


def _read_memory_config(job: Path) -> dict[str, Any]:
    path = job / ".hydra" / "config.yaml"
    try:
        config = checked(_read_yaml(path, MAX_CONFIG_BYTES), JOB_CONFIG, shown(path))
    except (JobFileError, BadValue):
        return {}  # only a fallback for the strategy's name and keep ratio
    return (config or {}).get("memory") or {}


def _job_order(job: Path) -> tuple[int, str]:
    m = re.match(r"([0-9]{1,18})", job.name)
    return (int(m.group(1)) if m else sys.maxsize, str(job))


def find_jobs(root: Path) -> list[Path]:
    """Job folders under ``root``: those holding ``.hydra/overrides.yaml`` or ``results.json``,
    found without following a link (at most ``MAX_SWEEP_ENTRIES`` entries, ``MAX_SWEEP_DEPTH``
    folders deep; past either, ``BadValue``). A folder that cannot be listed raises
    (``PermissionError``): no job is passed over unseen."""
    jobs: set[Path] = set()
    stack, seen = [(root, 0)], 0
    while stack:
        here, depth = stack.pop()
        with os.scandir(here) as entries:
            for entry in entries:
                seen += 1
                if seen > MAX_SWEEP_ENTRIES:
                    raise BadValue(f"{shown(root)}: more than {MAX_SWEEP_ENTRIES} entries; not "
                                   "read further")
                if entry.is_dir(follow_symlinks=False):
                    if entry.name == ".hydra":
                        if os.path.lexists(os.path.join(entry.path, "overrides.yaml")):
                            jobs.add(here)
                    elif depth >= MAX_SWEEP_DEPTH:
                        raise BadValue(f"{shown(root)}: folders nested more than {MAX_SWEEP_DEPTH} "
                                       "deep; not read further")
                    else:
                        stack.append((Path(entry.path), depth + 1))
                elif entry.name == "results.json":
                    jobs.add(here)
    return sorted(jobs, key=_job_order)


def _ratio(value: Any) -> float | None:
    """A keep ratio as a float, if it is a finite number (an override's value may be anything)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        ratio = float(value)
    except OverflowError:
        return None
    return ratio if math.isfinite(ratio) else None


def load_job(job: Path, root: Path) -> dict[str, Any]:
    """One job's row: what its files say, or failed with the reason (a file named, escaped)."""
    errors: list[str] = []
    overrides: dict[str, Any] = {}
    try:
        overrides = read_overrides(job)
    except JobFileError as err:
        errors.append(f"unreadable .hydra/overrides.yaml: {err}")
    results_path = job / "results.json"
    results: dict[str, Any] = {}
    try:
        results = read_json(results_path, RESULTS, MAX_RESULTS_BYTES, "results.json")
    except FileNotFoundError:
        errors.append("no results.json")
    except ValueError as err:  # UnsafeFileError, BadValue: never the file's text
        errors.append(f"unreadable results.json: {err}")
    except OSError as err:
        errors.append(f"unreadable results.json ({err.strerror})")
    memory = results.get("memory") or {}
    config = _read_memory_config(job)
    target = str(config.get("_target_") or "").rsplit(".", 1)[-1]
    strategy = (results.get("memory_strategy") or memory.get("strategy") or overrides.get("memory")
                or TARGETS.get(target) or "unknown")
    keep = overrides.get("memory.keep_ratio", memory.get("keep_ratio", config.get("keep_ratio")))
    if keep is None and strategy == "e2e":
        keep = 1.0
    granularity = overrides.get("memory.granularity",
                                memory.get("granularity", config.get("granularity")))
    return {
        "job": str(job.relative_to(root)) if job != root else ".",
        "strategy": str(strategy),
        "granularity": None if granularity is None else str(granularity),
        "keep_ratio": _ratio(keep),
        "val_top1": results.get("val_top1"),
        "val_top5": results.get("val_top5"),
        "train_peak_mem_mb": results.get("train_peak_mem_mb"),
        "step_time_s": results.get("step_time_s"),
        "clips_per_s": results.get("clips_per_s"),
        "epochs": results.get("epochs"),
        "val_loss": results.get("val_loss"),
        "param_digests": results.get("param_digests"),
        "row": overrides.get("row"),
        "overrides": overrides,
        "status": "failed" if errors else "ok",
        "error": "; ".join(errors) or None,
    }


def text_cell(value: Any, limit: int = CELL_CHARS) -> str:
    """Text taken from a job as a table cell and a terminal line: escaped and cut
    (``untrusted.shown``: no newline, control character or escape), and no ``|``."""
    return shown(value if isinstance(value, str) else str(value), limit).replace("|", "\\|")


def varying_keys(jobs: list[dict[str, Any]]) -> list[str]:
    """Override keys (outside ``OWN_COLUMNS`` and ``hydra.*``) whose value differs across jobs."""
    keys = sorted({k for j in jobs for k in j["overrides"]})
    return [k for k in keys if k not in OWN_COLUMNS and not k.startswith("hydra.")
            and len({repr(j["overrides"].get(k)) for j in jobs}) > 1]


def line_label(job: dict[str, Any], split_by: list[str]) -> str:
    if job.get("row"):
        return str(job["row"])
    label = job["strategy"] + (f"/{job['granularity']}" if job["granularity"] else "")
    extra = [f"{k}={job['overrides'][k]}" for k in split_by if k in job["overrides"]]
    return label + (f" ({', '.join(extra)})" if extra else "")


def sort_key(job: dict[str, Any]) -> tuple:
    keep = job["keep_ratio"]
    return (job["strategy"], job["granularity"] or "", -1.0 if keep is None else keep,
            _job_order(Path(job["job"])))


def _fmt(value: Any, spec: str) -> str:
    """A number of a job's (checked by ``RESULTS``) formatted, or "–"."""
    if value is None:
        return "–"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return text_cell(value)


def markdown(jobs: list[dict[str, Any]]) -> str:
    split_by = varying_keys(jobs)
    cols = ["job", "strategy", "granularity", "keep", "val top-1", "val top-5", "peak MB",
            "step s", "clips/s", "epochs", "status"] + (["varying overrides"] if split_by else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for j in sorted(jobs, key=sort_key):
        cells = [text_cell(j["job"]), text_cell(j["strategy"]), text_cell(j["granularity"] or "–"),
                 _fmt(j["keep_ratio"], ".2f"), _fmt(j["val_top1"], ".3f"),
                 _fmt(j["val_top5"], ".3f"), _fmt(j["train_peak_mem_mb"], ".1f"),
                 _fmt(j["step_time_s"], ".3f"), _fmt(j["clips_per_s"], ".2f"),
                 _fmt(j["epochs"], ""),
                 j["status"] + (f" ({text_cell(j['error'], 400)})" if j["error"] else "")]
        if split_by:
            cells.append(text_cell(", ".join(f"{k}={j['overrides'][k]}" for k in split_by
                                        if k in j["overrides"]) or "–", 300))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _label(text: str) -> str:
    """Text from a job as matplotlib draws it: escaped and cut, no ``$`` (mathtext)."""
    return shown(text, 80).replace("$", r"\$")


def plot(jobs: list[dict[str, Any]], path: Path, title: str = "",
         root: Path | None = None) -> None:
    """Val top-1 and peak memory against keep ratio, one line per strategy (mean over jobs
    at the same keep ratio, every job as a dot), drawn into memory and written to ``path``
    through the one writer (below ``root``, no link followed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    split_by = varying_keys(jobs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    lines: dict[str, list[dict[str, Any]]] = {}
    for j in jobs:
        if j["status"] == "ok" and j["keep_ratio"] is not None:
            lines.setdefault(line_label(j, split_by), []).append(j)
    for i, (label, js) in enumerate(sorted(lines.items())):
        color = f"C{i % 10}"
        for ax, key in zip(axes, ("val_top1", "train_peak_mem_mb"), strict=True):
            pts = [(j["keep_ratio"], j[key]) for j in js if j[key] is not None]
            if not pts:
                continue
            keeps = sorted({k for k, _ in pts})
            means = [statistics.mean(v for k, v in pts if k == x) for x in keeps]
            ax.plot(keeps, means, marker="*" if label.startswith("e2e") else "o", color=color,
                    markersize=11 if label.startswith("e2e") else 6, label=_label(label))
            if len(pts) > len(keeps):
                ax.scatter(*zip(*pts, strict=True), color=color, alpha=0.35, s=14)
    for ax, ylabel in zip(axes, ("val top-1", "peak training memory (MB)"), strict=True):
        ax.set_xlabel("keep ratio")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].set_ylim(bottom=0)
    if lines:
        axes[0].legend(fontsize=8, loc="best")
    failed = sum(j["status"] != "ok" for j in jobs)
    fig.suptitle((_label(title) + " · " if title else "") + f"{len(jobs)} jobs"
                 + (f", {failed} failed" if failed else ""), fontsize=9)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, png.getvalue(), root)


# two-sided 95% Student-t quantiles by degrees of freedom (above 60: the normal's 1.96;
# between tabulated values the smaller df's, the wider interval)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 24: 2.064, 29: 2.045, 40: 2.021,
        60: 2.000}


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean, sample std and the half-width of the mean's 95% t interval (nan for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan, math.nan
    df = len(values) - 1
    t = 1.96 if df > max(_T95) else _T95[max(k for k in _T95 if k <= df)]
    sd = statistics.stdev(values)
    return m, sd, t * sd / math.sqrt(len(values))


def pair_key(job: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """What a job shares with the e2e job it is paired with: every override but the row's own
    (strategy, ``memory.*``, ``row``), the seed and Hydra's."""
    return tuple(sorted((k, str(v)) for k, v in job["overrides"].items()
                        if k not in OWN_COLUMNS and not k.startswith(("memory.", "hydra."))))


def paired(jobs: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Per (row, group of the other overrides): ``metric``'s mean and std over seeds and the
    paired difference to e2e; per row: the mean difference over every pair with its interval,
    and whether every pair's trained weights were identical (recomputation must give e2e's)."""
    def seed(j: dict[str, Any]) -> Any:
        return j["overrides"].get("seed")

    ok = [j for j in jobs if isinstance(j.get(metric), int | float) and not math.isnan(j[metric])]
    ref = {(pair_key(j), seed(j)): j for j in ok if j["strategy"] == "e2e"}
    split_by = varying_keys(jobs)
    shown_keys = set(split_by)  # a group is named by the overrides that vary (the task)
    groups: dict[tuple[str, tuple], list[dict[str, Any]]] = {}
    for j in ok:
        label = line_label(j, split_by)
        if not j.get("row") and j["strategy"] != "e2e" and j["keep_ratio"] is not None:
            label += f" keep {j['keep_ratio']:g}"  # a keep-ratio sweep: one row per ratio
        groups.setdefault((label, pair_key(j)), []).append(j)
    per_group, overall = [], []
    for label in dict.fromkeys(lab for lab, _ in groups):
        pooled, same = [], []
        for (lab, key), js in groups.items():
            if lab != label:
                continue
            pairs = [(j, ref[key, seed(j)]) for j in js if (key, seed(j)) in ref]
            diffs = [j[metric] - e[metric] for j, e in pairs]
            same += [j["param_digests"] is not None and j["param_digests"] == e["param_digests"]
                     for j, e in pairs]
            pooled += diffs
            m, sd, _ = mean_ci([j[metric] for j in js])
            dm, _, dci = mean_ci(diffs) if diffs else (math.nan, math.nan, math.nan)
            name = ", ".join(v for k, v in key if k in shown_keys) or "all"
            per_group.append({"row": label, "group": name,
                              "seeds": len(js), "mean": m, "std": sd, "diff": dm, "diff_ci95": dci})
        dm, dsd, dci = mean_ci(pooled) if pooled else (math.nan, math.nan, math.nan)
        means = [g["mean"] for g in per_group if g["row"] == label]
        overall.append({"row": label, "pairs": len(pooled), "mean": statistics.fmean(means),
                        "diff": dm, "diff_std": dsd, "diff_ci95": dci,
                        "weights_equal_e2e": bool(same) and all(same)})
    return {"per_group": per_group, "overall": overall}


def paired_markdown(summary: dict[str, Any], metric: str, scale: float, fmt: str) -> str:
    """The paired table: a line per row, a column per group (mean ± std over seeds, Δ to e2e),
    the mean over groups and the pooled Δ ± the 95% interval's half-width. ``scale``: 100 shows
    top-1 in points."""
    def pm(x: float, f: str) -> str:
        return "" if math.isnan(x) else f" ± {x:{f}}"

    def delta(d: float, ci: float) -> str:
        return ("–" if math.isnan(d) else f"{scale * d:+{fmt}}") + pm(scale * ci, fmt)

    groups = list(dict.fromkeys(g["group"] for g in summary["per_group"]))
    by = {(g["row"], g["group"]): g for g in summary["per_group"]}
    lines = [f"| row ({metric}) | " + " | ".join(text_cell(g) for g in groups)
             + " | mean | Δ to e2e (95% CI) |",
             "|---|" + "---|" * len(groups) + "---|---|"]
    for o in summary["overall"]:
        cells = []
        for grp in groups:
            g = by.get((o["row"], grp))
            cell = "–" if g is None else f"{g['mean']:.3f}{pm(g['std'], '.3f')}"
            if g is not None and o["pairs"] and o["row"] != "e2e":
                cell += f" (Δ {delta(g['diff'], g['diff_ci95'])})"
            cells.append(cell)
        if o["row"] == "e2e" or not o["pairs"]:
            diff = "reference" if o["row"] == "e2e" else "no e2e job of the same seed"
        else:
            diff = f"{delta(o['diff'], o['diff_ci95'])} (n={o['pairs']})" + (
                "; weights identical to e2e" if o["weights_equal_e2e"] else "")
        lines.append(f"| {text_cell(o['row'])} | " + " | ".join(cells) + f" | {o['mean']:.3f} | {diff} |")
    return "\n".join(lines) + "\n"


def paired_section(jobs: list[dict[str, Any]]) -> str:
    """The paired tables (val top-1 in points, val loss), or "" where no job has an e2e partner."""
    top1, loss = paired(jobs, "val_top1"), paired(jobs, "val_loss")
    if not any(o["pairs"] for o in top1["overall"]):
        return ""
    text = ("\n## Paired against e2e\n\nMean ± std over seeds; Δ: the paired difference to the e2e "
            "job of the same seed and other overrides (val top-1 in points), ± the half-width of "
            "its 95% t interval.\n\n" + paired_markdown(top1, "val top-1", 100.0, ".1f"))
    if any(o["pairs"] for o in loss["overall"]):
        text += "\n" + paired_markdown(loss, "val loss", 1.0, ".3f")
    return text


def summarize(roots: str | Path | list[str | Path],
              out: str | Path | None = None) -> tuple[list[dict[str, Any]], str]:
    """Write ``summary.md`` and ``summary.png`` into ``out`` (default: the first folder); returns
    (jobs, the markdown). Several folders are summarized as one sweep. Each folder is checked
    (``check_run_folder``) before it is read, and ``out`` before anything is written there."""
    roots = [Path(r) for r in (roots if isinstance(roots, list) else [roots])]
    jobs = []
    for root in roots:
        if not root.is_dir() or root.is_symlink():
            raise FileNotFoundError(f"{shown(root)} is not a directory")
        check_run_folder(root, "read from")
        found = [load_job(j, root) for j in find_jobs(root)]
        if not found:
            raise FileNotFoundError(f"no jobs (.hydra/overrides.yaml or results.json) under "
                                    f"{shown(root)}")
        if len(roots) > 1:
            for j in found:
                j["job"] = f"{root.name}/{j['job']}"
        jobs += found
    table = markdown(jobs) + paired_section(jobs)
    dest = Path(out) if out is not None else roots[0]
    check_run_folder(dest, "write into")
    names = ", ".join(shown(r) for r in roots)
    write_text(dest / "summary.md", f"# sweep summary: {names}\n\n{table}", root=dest)
    plot(jobs, dest / "summary.png", title=", ".join(map(str, roots)), root=dest)
    return jobs, table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("multirun_dir", nargs="+",
                   help="a Hydra multirun folder (multirun/DATE/TIME); several: one sweep")
    p.add_argument("--out", help="write summary.md and summary.png here (default: the first folder)")
    args = p.parse_args(argv)
    try:
        jobs, table = summarize(args.multirun_dir, args.out)
    except (OSError, ValueError) as exc:  # a folder refused, unlistable or unwritable
        text = str(exc) if isinstance(exc, ValueError | FileNotFoundError) else \
            f"{type(exc).__name__}: {exc.strerror or exc}" + (
                f" ({shown(exc.filename)})" if getattr(exc, "filename", None) else "")
        print(f"error: {shown(text, 2000)}", file=sys.stderr)
        return 2
    print(table, end="")
    failed = [text_cell(j["job"]) for j in jobs if j["status"] != "ok"]
    if failed:
        print(f"{len(failed)} failed job(s): {', '.join(failed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
