#!/usr/bin/env python
"""Tabulate and plot a Hydra multirun of ``python -m videotrain``.

    python scripts/summarize_sweep.py multirun/2024-01-01/12-00-00

Reads every job's ``results.json`` and ``.hydra/overrides.yaml`` (and ``.hydra/config.yaml``
for jobs that died before writing results), writes ``summary.md`` (one row per job, sorted by
strategy and keep ratio; jobs without ``results.json`` are listed as failed) and
``summary.png`` (val top-1 and peak training memory against keep ratio, one line per
strategy) into MULTIRUN_DIR, and prints the table.

keep_ratio comes from the ``memory.keep_ratio`` override, else ``results["memory"]
["keep_ratio"]``, else the job's resolved config, else 1.0 for e2e. Overrides that vary across
jobs other than the strategy, keep ratio, granularity and seeds (say ``model/backbone``) split
the lines; jobs that differ only by seed share a line, which goes through their mean.

Paired against e2e: where the jobs hold e2e runs (``memory=e2e`` or ``row=e2e``) and other rows
of the same seeds, every job is paired with the e2e job of the same seed and the same other
overrides (a run of one seed shares the model initialisation and the data order with e2e's), and
the summary adds a table per metric (val top-1, val loss): per row and per group of the other
overrides (the tasks of the accuracy sweep, ``benchmarks/conf/sweep/accuracy.yaml``) the mean and
std over seeds with the paired difference to e2e, and per row the mean difference over every pair
with its 95% Student-t interval. Several folders are read as one sweep (an equal-time sweep
beside the equal-step one whose e2e it is paired with); ``--out`` writes the summary elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

# Overrides shown in their own columns or averaged over, never used to split lines.
OWN_COLUMNS = {"memory", "memory.keep_ratio", "memory.granularity", "seed", "memory.seed", "row"}
TARGETS = {"EndToEnd": "e2e", "StochasticBackprop": "sbp", "FrameDropout": "frame_dropout",
           "Recompute": "recompute", "AutoStrategy": "auto"}


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def read_overrides(job: Path) -> dict[str, Any]:
    """``.hydra/overrides.yaml`` (a list of ``key=value``) -> ``{key: value}``."""
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    out: dict[str, Any] = {}
    for item in yaml.safe_load(path.read_text()) or []:
        key, _, value = str(item).partition("=")
        out[key.lstrip("+~")] = _parse_value(value)
    return out


def _read_memory_config(job: Path) -> dict[str, Any]:
    path = job / ".hydra" / "config.yaml"
    if not path.is_file():
        return {}
    try:
        return (yaml.safe_load(path.read_text()) or {}).get("memory") or {}
    except yaml.YAMLError:
        return {}


def _job_order(job: Path) -> tuple[int, str]:
    m = re.match(r"(\d+)", job.name)
    return (int(m.group(1)) if m else sys.maxsize, str(job))


def find_jobs(root: Path) -> list[Path]:
    """Job folders under ``root``: those holding ``.hydra/overrides.yaml`` or ``results.json``."""
    jobs = {p.parent.parent for p in root.rglob(".hydra/overrides.yaml")}
    jobs |= {p.parent for p in root.rglob("results.json")}
    return sorted(jobs, key=_job_order)


def load_job(job: Path, root: Path) -> dict[str, Any]:
    overrides = read_overrides(job)
    results_path = job / "results.json"
    results: dict[str, Any] = {}
    error = None
    if results_path.is_file():
        try:
            results = json.loads(results_path.read_text())
        except json.JSONDecodeError as exc:
            error = f"unreadable results.json: {exc}"
    else:
        error = "no results.json"
    memory = results.get("memory") if isinstance(results.get("memory"), dict) else {}
    config = _read_memory_config(job)
    target = str(config.get("_target_", "")).rsplit(".", 1)[-1]
    strategy = (results.get("memory_strategy") or memory.get("strategy") or overrides.get("memory")
                or TARGETS.get(target) or "unknown")
    keep = overrides.get("memory.keep_ratio", memory.get("keep_ratio", config.get("keep_ratio")))
    if keep is None and strategy == "e2e":
        keep = 1.0
    granularity = overrides.get("memory.granularity",
                                memory.get("granularity", config.get("granularity")))
    return {
        "job": str(job.relative_to(root)) if job != root else ".",
        "strategy": strategy,
        "granularity": granularity,
        "keep_ratio": float(keep) if isinstance(keep, int | float) else None,
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
        "status": "ok" if error is None else "failed",
        "error": error,
    }


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
    if value is None:
        return "–"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def markdown(jobs: list[dict[str, Any]]) -> str:
    split_by = varying_keys(jobs)
    cols = ["job", "strategy", "granularity", "keep", "val top-1", "val top-5", "peak MB",
            "step s", "clips/s", "epochs", "status"] + (["varying overrides"] if split_by else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for j in sorted(jobs, key=sort_key):
        cells = [j["job"], j["strategy"], j["granularity"] or "–", _fmt(j["keep_ratio"], ".2f"),
                 _fmt(j["val_top1"], ".3f"), _fmt(j["val_top5"], ".3f"),
                 _fmt(j["train_peak_mem_mb"], ".1f"), _fmt(j["step_time_s"], ".3f"),
                 _fmt(j["clips_per_s"], ".2f"), _fmt(j["epochs"], ""),
                 j["status"] + (f" ({j['error']})" if j["error"] else "")]
        if split_by:
            cells.append(", ".join(f"{k}={j['overrides'][k]}" for k in split_by
                                   if k in j["overrides"]) or "–")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(jobs: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Val top-1 and peak memory against keep ratio, one line per strategy (mean over jobs
    at the same keep ratio, every job as a dot)."""
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
                    markersize=11 if label.startswith("e2e") else 6, label=label)
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
    fig.suptitle((title + " · " if title else "") + f"{len(jobs)} jobs"
                 + (f", {failed} failed" if failed else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    lines = [f"| row ({metric}) | " + " | ".join(groups) + " | mean | Δ to e2e (95% CI) |",
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
        lines.append(f"| {o['row']} | " + " | ".join(cells) + f" | {o['mean']:.3f} | {diff} |")
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
    (jobs, the markdown). Several folders are summarized as one sweep."""
    roots = [Path(r) for r in (roots if isinstance(roots, list) else [roots])]
    jobs = []
    for root in roots:
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory")
        found = [load_job(j, root) for j in find_jobs(root)]
        if not found:
            raise FileNotFoundError(f"no jobs (.hydra/overrides.yaml or results.json) under {root}")
        if len(roots) > 1:
            for j in found:
                j["job"] = f"{root.name}/{j['job']}"
        jobs += found
    table = markdown(jobs) + paired_section(jobs)
    dest = Path(out) if out is not None else roots[0]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.md").write_text(f"# sweep summary: {', '.join(map(str, roots))}\n\n{table}")
    plot(jobs, dest / "summary.png", title=", ".join(map(str, roots)))
    return jobs, table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("multirun_dir", nargs="+",
                   help="a Hydra multirun folder (multirun/DATE/TIME); several: one sweep")
    p.add_argument("--out", help="write summary.md and summary.png here (default: the first folder)")
    args = p.parse_args(argv)
    try:
        jobs, table = summarize(args.multirun_dir, args.out)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table, end="")
    failed = [j["job"] for j in jobs if j["status"] != "ok"]
    if failed:
        print(f"{len(failed)} failed job(s): {', '.join(failed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
