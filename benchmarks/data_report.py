"""The data suite's tables (``python -m benchmarks.data``): one row from its rounds, the
ratios to pytorchvideo and to one worker, the workers that would feed a target rate, and
``bench.json`` / ``bench.md`` / ``bench.png``."""

from __future__ import annotations

import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

from videotrain.bench.report import cell
from videotrain.untrusted.files import write_bytes, write_text

DATA_COLUMNS = [
    ("set", "set", "{}"),
    ("pipeline", "pipeline", "{}"),
    ("backend", "backend", "{}"),
    ("workers", "num_workers", "{}"),
    ("clips/s", "clips_per_s", "{:.1f}"),
    ("min–max over rounds", "clips_per_s_range", "{}"),
    ("clips/s per worker", "clips_per_s_per_worker", "{:.2f}"),
    ("× pytorchvideo, same workers", "vs_peer", "{:.2f}"),
    ("× 1 worker", "vs_w1", "{:.2f}"),
    ("first wave s", "startup_s", "{:.1f}"),
    ("clips timed", "clips", "{}"),
]


def combine_data(spec: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One data row from its rounds: the median clips/s, the range, the first error (or the
    reason it could not run) kept."""
    failed = [r for r in runs if r.get("error") or r.get("unavailable")]
    if failed:
        return {**spec, **failed[0], "rounds": len(runs)}
    rates = [r["clips_per_s"] for r in runs]
    rate = statistics.median(rates)
    workers = max(int(spec.get("num_workers", 1)), 1)
    row = {**spec, **runs[0], "rounds": len(runs), "clips_per_s": rate,
           "clips_per_s_per_worker": rate / workers, "clips_per_s_rounds": rates,
           "startup_s": statistics.median(r["startup_s"] for r in runs),
           "wall_s": sum(r.get("wall_s", 0.0) for r in runs)}
    row["clips_per_s_range"] = f"{min(rates):.1f}–{max(rates):.1f}" if len(rates) > 1 else None
    return row


def _group(r: dict[str, Any]) -> tuple[str, str]:
    return r.get("set", ""), r.get("pipeline", "train")


def add_data_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_peer``: clips/s over the pytorchvideo row of the same set, pipeline and worker
    count (None if there is none); ``vs_w1``: over the same backend with one worker."""
    ok = [r for r in rows if r.get("clips_per_s") and not r.get("error")]
    peers = {(*_group(r), r["num_workers"]): r for r in ok if r["backend"] == "pytorchvideo"}
    ones = {(*_group(r), r["backend"]): r for r in ok if r["num_workers"] == 1}
    for r in rows:
        rate = r.get("clips_per_s") if r in ok else None
        peer = peers.get((*_group(r), r.get("num_workers")))
        one = ones.get((*_group(r), r.get("backend")))
        r["vs_peer"] = rate / peer["clips_per_s"] if rate and peer else None
        r["vs_w1"] = rate / one["clips_per_s"] if rate and one else None


def workers_needed(target: float, rate_1: float, rate_2: float | None) -> tuple[int, float]:
    """Workers to feed ``target`` clips/s from one worker's rate and two workers' rate.
    Returns ``(workers, efficiency)``: each worker beyond the first is assumed to add what each
    of two added (``rate_2 / 2``, at most ``rate_1``), so rate(n) = n x rate_1 x efficiency."""
    if rate_1 <= 0:
        raise ValueError("rate_1 must be positive")
    eff = min(rate_2 / (2 * rate_1), 1.0) if rate_2 else 1.0
    if target <= rate_1:
        return 1, eff
    return max(2, math.ceil(target / (rate_1 * eff) - 1e-9)), eff


def target_workers(rows: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """Per set and pipeline: the backend with the highest per-worker rate at scale (one
    worker's rate x the 1 -> 2 worker efficiency) and the workers it needs for ``target``
    clips/s (one free core each). Backends are compared on the same clips: rows of another
    frame sampler (``data.sampler=segment``) read other frames and are left out."""
    ok = [r for r in rows if r.get("clips_per_s") and not r.get("error")
          and r.get("sampler") in (None, "random")]
    out = []
    for group in dict.fromkeys(_group(r) for r in ok):
        best = None
        for backend in dict.fromkeys(r["backend"] for r in ok if _group(r) == group):
            by_w = {r["num_workers"]: r["clips_per_s"] for r in ok
                    if _group(r) == group and r["backend"] == backend}
            if 1 not in by_w:
                continue
            n, eff = workers_needed(target, by_w[1], by_w.get(2))
            if best is None or by_w[1] * eff > best["rate_per_worker_at_scale"]:
                best = {"set": group[0], "pipeline": group[1], "backend": backend,
                        "target_clips_per_s": target, "workers": n, "rate_1": by_w[1],
                        "rate_2": by_w.get(2), "efficiency": eff,
                        "rate_per_worker_at_scale": by_w[1] * eff}
        if best:
            out.append(best)
    return out


def targets_markdown(targets: list[dict[str, Any]]) -> str:
    if not targets:
        return ""
    r0 = targets[0]["target_clips_per_s"]
    lines = [f"Workers to feed {r0:g} clips/s (fastest backend; one free core per worker; "
             "rate(n) = n x rate(1 worker) x efficiency(1 -> 2 workers)):", "",
             "| set | pipeline | backend | clips/s, 1 worker | clips/s, 2 workers | efficiency "
             "| workers needed |", "|---|---|---|---|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['set']} | {t['pipeline']} | {t['backend']} | {t['rate_1']:.2f} | "
                     f"{cell(t['rate_2'], '{:.2f}')} | {t['efficiency']:.2f} | "
                     f"**{t['workers']}** |")
    return "\n".join(lines) + "\n"


def data_status(r: dict[str, Any]) -> str:
    if r.get("unavailable"):
        return r["unavailable"].replace("|", "\\|")
    if r.get("error"):
        return "FAILED: " + r["error"].strip().splitlines()[-1][:160].replace("|", "\\|")
    return "ok"


def data_markdown(rows: list[dict[str, Any]], targets: list[dict[str, Any]] | None = None) -> str:
    lines = ["| " + " | ".join(c[0] for c in DATA_COLUMNS) + " | status |",
             "|" + "---|" * (len(DATA_COLUMNS) + 1)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(k), f) for _, k, f in DATA_COLUMNS)
                     + f" | {data_status(r)} |")
    table = "\n".join(lines) + "\n"
    return table + ("\n" + targets_markdown(targets) if targets else "")


BACKEND_COLORS = {"pyav": "C0", "pytorchvideo": "C1", "torchcodec": "C2", "segment": "C3"}


def plot_data(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """One panel per set and pipeline: bars of clips/s per worker count, one per backend, the
    ratio to pytorchvideo above each; each round's figure as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("clips_per_s") and not r.get("error")]
    groups = list(dict.fromkeys(_group(r) for r in rows)) or [("", "")]
    ncols = min(len(groups), 2)
    nrows = math.ceil(len(groups) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, group in zip(axes.flat, groups, strict=False):
        rs = [r for r in ok if _group(r) == group]
        workers = sorted({r["num_workers"] for r in rows if _group(r) == group})
        present = list(dict.fromkeys(r["backend"] for r in rs))
        width = 0.8 / max(len(present), 1)
        for j, backend in enumerate(present):
            for i, w in enumerate(workers):
                r = next((x for x in rs if x["backend"] == backend and x["num_workers"] == w), None)
                if r is None:
                    continue
                x = i + (j - (len(present) - 1) / 2) * width
                ax.bar(x, r["clips_per_s"], width, color=BACKEND_COLORS.get(backend, "C7"),
                       label=backend)
                rounds = r.get("clips_per_s_rounds") or [r["clips_per_s"]]
                ax.plot([x] * len(rounds), rounds, "k.", markersize=3)
                if r.get("vs_peer") and backend != "pytorchvideo":
                    ax.text(x, r["clips_per_s"], f"{r['vs_peer']:.2f}x", ha="center",
                            va="bottom", fontsize=7)
        missing = [b for b in dict.fromkeys(r["backend"] for r in rows if _group(r) == group)
                   if b not in present]
        ax.set_xticks(range(len(workers)), [f"{w} worker{'s' if w > 1 else ''}" for w in workers])
        ax.set_title(f"{group[0]}-like, {group[1]}" + (f" (n/a: {', '.join(missing)})"
                                                       if missing else ""), fontsize=9)
        ax.set_ylabel("clips / s")
        ax.grid(axis="y", alpha=0.3)
        handles = dict(zip(*ax.get_legend_handles_labels()[::-1], strict=True))  # one per backend
        if handles:
            ax.legend(list(handles.values()), list(handles), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()  # drawn in memory, written by the one writer (never through a link)
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, png.getvalue())


def write_data(out_dir: Path, rows: list[dict[str, Any]], meta: dict[str, Any],
               targets: list[dict[str, Any]] | None = None) -> str:
    """``bench.json`` (rows with ``kind: "data"``, the sets, the worker targets), ``bench.md``
    and ``bench.png`` for a data suite, in the user's own ``out_dir`` (through the one writer:
    never through a link); returns the table."""
    table = data_markdown(rows, targets)
    write_text(out_dir / "bench.json", json.dumps(
        {"rows": rows, "targets": targets or [], "meta": meta}, indent=2) + "\n")
    s = meta["setting"]
    title = (f"{meta['device']} · {meta['machine'].get('cpus')} CPUs · torch {meta['torch']} · "
             f"T={s['num_frames']} frames at stride {s['sampling_rate']}, crop "
             f"{s['crop_size']}, test {s['val_clips']}x{s['val_crops']} views, "
             f"{s['rounds']} round(s)"
             + (" · " + " ".join(s["extra_overrides"]) if s["extra_overrides"] else ""))
    sets = "".join(f"- {name}-like: {i['count']} videos, {i['seconds']:g} s, {i['width']}x"
                   f"{i['height']}, {i['fps']} fps, {i['codec']} (keyframe every <= {i['gop']} "
                   f"frames), {i['mean_kbps']:.0f} kb/s\n" for name, i in s["sets"].items())
    write_text(out_dir / "bench.md", f"# videotrain bench: data loading\n\n{title}\n\n{sets}\n"
                                     f"{table}")
    plot_data(rows, out_dir / "bench.png", title)
    return table
