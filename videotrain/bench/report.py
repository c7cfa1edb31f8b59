"""Ratios against e2e, the markdown table, the JSON file and the plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from videotrain.bench.suites import ROW_FIELDS

# (column title, row key, format) of the markdown table
COLUMNS = [
    ("backbone", "backbone", "{}"),
    ("strategy", "strategy", "{}"),
    ("granularity", "granularity", "{}"),
    ("policy", "policy", "{}"),
    ("keep", "keep_ratio", "{:.2f}"),
    ("peak MB", "peak_mem_mb", "{:.1f}"),
    ("predicted MB", "step_predicted_mb", "{:.1f}"),
    ("pred/meas", "predicted_ratio", "{:.2f}"),
    ("eval MB", "eval_peak_mb", "{:.1f}"),
    ("mem ×e2e", "mem_ratio", "{:.2f}"),
    ("fwd+bwd MB", "fwd_bwd_peak_mb", "{:.1f}"),
    ("step s", "step_time_s", "{:.3f}"),
    ("time ×e2e", "time_ratio", "{:.2f}"),
    ("clips/s", "clips_per_s", "{:.2f}"),
    ("saved act MB", "saved_act_mb", "{:.1f}"),
    ("act ×e2e", "act_ratio", "{:.2f}"),
]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``mem_ratio``, ``time_ratio``, ``act_ratio`` against the e2e row of the same backbone
    (None where that row failed or is missing)."""
    refs = {r["backbone"]: r for r in rows
            if r["strategy"] == "e2e" and not r.get("policy") and not r.get("error")}
    for r in rows:
        ref = refs.get(r["backbone"])
        for ratio, key in (("mem_ratio", "peak_mem_mb"), ("time_ratio", "step_time_s"),
                           ("act_ratio", "saved_act_mb")):
            num, den = r.get(key), ref.get(key) if ref else None
            r[ratio] = num / den if num is not None and den else None
        pred, meas = r.get("step_predicted_mb"), r.get("peak_mem_mb")
        r["predicted_ratio"] = pred / meas if pred is not None and meas else None


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    columns = list(COLUMNS)
    if any(r.get("budget_frac") is not None for r in rows):
        columns.insert(5, ("budget", "budget_frac", "{:.3g}"))
    if any(r.get("predicted_peak_mb") is not None for r in rows):  # the plan's prediction
        columns.insert(columns.index(("peak MB", "peak_mem_mb", "{:.1f}")) + 1,
                       ("plan act MB", "predicted_peak_mb", "{:.1f}"))
    if any(r.get("launches_per_step") is not None for r in rows):  # host- or device-bound
        at = columns.index(("time ×e2e", "time_ratio", "{:.2f}")) + 1
        cuda = any(r.get("kernels_per_step") is not None for r in rows)
        columns.insert(at, ("kernels/step" if cuda else "aten ops/step", "launches_per_step", "{:.0f}"))
        if cuda:
            columns.insert(at + 1, ("GPU busy", "gpu_busy", "{:.0%}"))
    if any(r.get("max_allocated_mb") is not None for r in rows):  # CUDA, absolute
        columns.insert(columns.index(("mem ×e2e", "mem_ratio", "{:.2f}")) + 1,
                       ("max alloc MB", "max_allocated_mb", "{:.0f}"))
    lines = ["| " + " | ".join(c[0] for c in columns) + " | status |",
             "|" + "---|" * (len(columns) + 1)]
    for r in rows:
        status = "ok"
        if r.get("error"):
            status = "FAILED: " + r["error"].strip().splitlines()[-1][:160].replace("|", "\\|")
        lines.append("| " + " | ".join(_cell(r.get(k), f) for _, k, f in columns)
                     + f" | {status} |")
    return "\n".join(lines) + "\n"


def _series(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("error") or r.get("mem_ratio") is None:
            continue
        label = "/".join(str(r[k]) for k in ("backbone", "strategy", "granularity", "policy")
                         if r.get(k))
        if r.get("budget_frac") is not None:
            label += f"/b{r['budget_frac']:g}"
        groups.setdefault(label, []).append(r)
    return groups


def plot(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Three panels: memory ratio and time ratio against keep ratio (one line per
    backbone/strategy/granularity/policy), and time ratio against memory ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    groups = _series(rows)
    for i, (label, rs) in enumerate(sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["keep_ratio"])
        color = f"C{i % 10}"
        style = dict(color=color, label=label, marker="*" if rs[0]["strategy"] == "e2e" else "o",
                     markersize=11 if rs[0]["strategy"] == "e2e" else 6,
                     linestyle="--" if "vit" in rs[0]["backbone"] else "-")
        keeps = [r["keep_ratio"] for r in rs]
        axes[0].plot(keeps, [r["mem_ratio"] for r in rs], **style)
        if rs[0].get("time_ratio") is not None:
            axes[1].plot(keeps, [r["time_ratio"] for r in rs], **style)
            axes[2].plot([r["mem_ratio"] for r in rs], [r["time_ratio"] for r in rs], **style)
    for ax, (x, y) in zip(axes, [("keep ratio", "peak memory / e2e"),
                                 ("keep ratio", "step time / e2e"),
                                 ("peak memory / e2e", "step time / e2e")], strict=True):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(bottom=0)
    axes[2].axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes[0].set_title("memory")
    axes[1].set_title("time")
    axes[2].set_title("trade-off")
    if groups:
        axes[2].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def public_row(r: dict[str, Any]) -> dict[str, Any]:
    """The row as written to bench.json: reported fields first, then the details."""
    first = ["name", *ROW_FIELDS, "budget_frac", "peak_mem_mb", "step_time_s", "clips_per_s",
             "saved_act_mb", "mem_ratio", "time_ratio", "act_ratio", "fwd_bwd_peak_mb"]
    out = {k: r.get(k) for k in first}
    out.update({k: v for k, v in r.items() if k not in out})
    return out


def write(out_dir: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """``bench.json``, ``bench.md`` and ``bench.png`` in ``out_dir``; returns the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    (out_dir / "bench.json").write_text(
        json.dumps({"rows": [public_row(r) for r in rows], "meta": meta}, indent=2) + "\n")
    s = meta["setting"]
    gpu = meta.get("machine", {}).get("gpu")
    commit = meta.get("machine", {}).get("git")
    title = " · ".join(x for x in (
        f"{meta['device']} ({gpu})" if gpu else meta["device"], f"torch {meta['torch']}",
        f"commit {commit}" if commit else "",
        f"B={s['batch_size']} T={s['frames']} "
        f"{s['size']}px, {s['steps']} steps x {s.get('rounds', 1)} round(s)",
        " ".join([*s.get("suite_overrides", []), *s["extra_overrides"]])) if x)
    header = f"# videotrain bench\n\n{title}\n\n"
    (out_dir / "bench.md").write_text(header + table)
    plot(rows, out_dir / "bench.png", title)
    return table


# ---------------------------------------------------------------------- the data suite
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
    import statistics

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
                     f"{_cell(t['rate_2'], '{:.2f}')} | {t['efficiency']:.2f} | "
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
        lines.append("| " + " | ".join(_cell(r.get(k), f) for _, k, f in DATA_COLUMNS)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_data(out_dir: Path, rows: list[dict[str, Any]], meta: dict[str, Any],
               targets: list[dict[str, Any]] | None = None) -> str:
    """``bench.json`` (rows with ``kind: "data"``, the sets, the worker targets), ``bench.md``
    and ``bench.png`` for a data suite; returns the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = data_markdown(rows, targets)
    (out_dir / "bench.json").write_text(json.dumps(
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
    (out_dir / "bench.md").write_text(f"# videotrain bench: data loading\n\n{title}\n\n{sets}\n"
                                      f"{table}")
    plot_data(rows, out_dir / "bench.png", title)
    return table


# ---------------------------------------------------------------------- the annotation suite
def annotations_markdown(rows: list[dict[str, Any]]) -> str:
    """The annotation suite's table: each file's plain parse against what videotrain pays."""
    def s(v: Any) -> str:
        return "" if v is None else f"{v:.3f}"

    lines = ["| what a start reads | entries | plain parse s | videotrain s | × plain | target | "
             "met | paid under torchrun with N ranks |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        met = {True: "yes", False: "**no**", None: ""}[r["meets_target"]]
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['name']} | {r['entries']:,} | {s(r['plain_s'])} | {s(r['build_s'])} | "
                     f"{ratio} | {r['target']} | {met} | {r['paid']} |")
    return "\n".join(lines) + "\n"


def write_annotations(out_dir: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """``bench.json`` and ``bench.md`` of the annotation suite; returns the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = annotations_markdown(rows)
    (out_dir / "bench.json").write_text(json.dumps({"rows": rows, "meta": meta}, indent=2) + "\n")
    m = meta["machine"]
    title = (f"{m.get('cpus')} CPUs ({m.get('processor')}), python {m.get('python')}, torch "
             f"{meta['torch']}; x{meta['scale']:g} the official sizes, best of {meta['repeat']} "
             f"runs each; load average {meta['load_avg_start']} at the start (a shared machine)")
    (out_dir / "bench.md").write_text(f"# videotrain bench: annotation files at official sizes\n\n"
                                      f"{title}\n\n{table}")
    return table
