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
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

# Overrides shown in their own columns or averaged over, never used to split lines.
OWN_COLUMNS = {"memory", "memory.keep_ratio", "memory.granularity", "seed", "memory.seed"}
TARGETS = {"EndToEnd": "e2e", "StochasticBackprop": "sbp", "FrameDropout": "frame_dropout"}


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


def summarize(root: str | Path) -> tuple[list[dict[str, Any]], str]:
    """Write ``summary.md`` and ``summary.png`` into ``root``; returns (jobs, table)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    jobs = [load_job(j, root) for j in find_jobs(root)]
    if not jobs:
        raise FileNotFoundError(f"no jobs (.hydra/overrides.yaml or results.json) under {root}")
    table = markdown(jobs)
    (root / "summary.md").write_text(f"# sweep summary: {root}\n\n{table}")
    plot(jobs, root / "summary.png", title=str(root))
    return jobs, table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("multirun_dir", help="a Hydra multirun folder (multirun/DATE/TIME)")
    args = p.parse_args(argv)
    try:
        jobs, table = summarize(args.multirun_dir)
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
