"""Ratios against e2e, the markdown table, the JSON file and the plot."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from videotrain.bench.suites import ROW_FIELDS
from videotrain.untrusted.files import write_bytes, write_text

# (column title, row key, format) of the markdown table
COLUMNS = [
    ("backbone", "backbone", "{}"),
    ("strategy", "strategy", "{}"),
    ("granularity", "granularity", "{}"),
    ("policy", "policy", "{}"),
    ("keep", "keep_ratio", "{:.2f}"),
    ("peak MB", "peak_mem_mb", "{:.1f}"),
    ("estimated MB", "step_estimated_mb", "{:.1f}"),
    ("est/meas", "estimated_ratio", "{:.2f}"),
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
    """``mem_ratio``, ``time_ratio``, ``act_ratio`` against the eager e2e row of the same
    backbone (None where that row failed or is missing): a compiled row's ratios say what the
    strategy and the compiler together buy."""
    refs = {r["backbone"]: r for r in rows if r["strategy"] == "e2e" and not r.get("policy")
            and not r.get("compiled") and not r.get("error")}
    for r in rows:
        ref = refs.get(r["backbone"])
        for ratio, key in (("mem_ratio", "peak_mem_mb"), ("time_ratio", "step_time_s"),
                           ("act_ratio", "saved_act_mb")):
            num, den = r.get(key), ref.get(key) if ref else None
            r[ratio] = num / den if num is not None and den else None
        pred, meas = r.get("step_estimated_mb"), r.get("peak_mem_mb")
        r["estimated_ratio"] = pred / meas if pred is not None and meas else None


def cell(value: Any, fmt: str) -> str:
    """``value`` in ``fmt``, ``–`` for None, as text where ``fmt`` does not fit it."""
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
    if any(r.get("estimated_peak_mb") is not None for r in rows):  # the plan's estimate
        columns.insert(columns.index(("peak MB", "peak_mem_mb", "{:.1f}")) + 1,
                       ("plan act MB", "estimated_peak_mb", "{:.1f}"))
    if any(r.get("launches_per_step") is not None for r in rows):  # host- or device-bound
        at = columns.index(("time ×e2e", "time_ratio", "{:.2f}")) + 1
        cuda = any(r.get("kernels_per_step") is not None for r in rows)
        columns.insert(at, ("kernels/step" if cuda else "aten ops/step", "launches_per_step", "{:.0f}"))
        if cuda:
            columns.insert(at + 1, ("GPU busy", "gpu_busy", "{:.0%}"))
    if any(r.get("compiled") for r in rows):  # the compile axis: the mode, graphs, recompiles
        columns.insert(columns.index(("policy", "policy", "{}")) + 1, ("compile", "compile", "{}"))
        columns.insert(columns.index(("clips/s", "clips_per_s", "{:.2f}")) + 1,
                       ("graphs", "compiled_graphs", "{}"))
        columns.insert(columns.index(("graphs", "compiled_graphs", "{}")) + 1,
                       ("recompiles", "recompiles", "{}"))
        rows = [{**r, "compile": compile_label(r)} for r in rows]
    if len({(r.get("batch_size"), r.get("frames")) for r in rows}) > 1:  # rows of their own shape
        columns.insert(1, ("B×T", "shape", "{}"))
        rows = [{**r, "shape": f"{r.get('batch_size')}×{r.get('frames')}"} for r in rows]
    if any(r.get("max_allocated_mb") is not None for r in rows):  # CUDA, absolute
        columns.insert(columns.index(("mem ×e2e", "mem_ratio", "{:.2f}")) + 1,
                       ("max alloc MB", "max_allocated_mb", "{:.0f}"))
    lines = ["| " + " | ".join(c[0] for c in columns) + " | status |",
             "|" + "---|" * (len(columns) + 1)]
    for r in rows:
        status = "ok"
        if r.get("error"):
            status = "FAILED: " + r["error"].strip().splitlines()[-1][:160].replace("|", "\\|")
        lines.append("| " + " | ".join(cell(r.get(k), f) for _, k, f in columns)
                     + f" | {status} |")
    return "\n".join(lines) + "\n"


def compile_label(r: dict[str, Any]) -> str:
    """``eager``, ``compiled`` or ``compiled:MODE`` (``trainer.compile_mode``)."""
    if not r.get("compiled"):
        return "eager"
    return "compiled" + (f":{r['compile_mode']}" if r.get("compile_mode") else "")


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


def draw(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
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
    png = io.BytesIO()  # drawn in memory, written by the one writer (never through a link)
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, png.getvalue())


def public_row(r: dict[str, Any]) -> dict[str, Any]:
    """The row as written to bench.json: reported fields first, then the details."""
    first = ["name", *ROW_FIELDS, "budget_frac", "peak_mem_mb", "step_time_s", "clips_per_s",
             "saved_act_mb", "mem_ratio", "time_ratio", "act_ratio", "fwd_bwd_peak_mb"]
    out = {k: r.get(k) for k in first}
    out.update({k: v for k, v in r.items() if k not in out})
    return out


def write(out_dir: Path, rows: list[dict[str, Any]], meta: dict[str, Any], plot: bool = True) -> str:
    """``bench.json``, ``bench.md`` and (``plot``) ``bench.png`` in ``out_dir``; returns the
    table. A run writes after every row (``meta["complete"]`` false) and once more at its end.
    ``out_dir`` is the user's own (``--out`` or the default): followed as given, created where
    missing; each file is renamed into place, never written through a link."""
    table = markdown(rows)
    write_text(out_dir / "bench.json",
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
    write_text(out_dir / "bench.md", header + table)
    if plot:
        draw(rows, out_dir / "bench.png", title)
    return table
