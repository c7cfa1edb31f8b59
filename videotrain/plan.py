"""Plan before you queue: ``python -m videotrain.plan [--fit GB] [hydra overrides]``.

``--fit GB``: every strategy's training-step and validation peak for the configured run at
full size, estimated on fake tensors (:func:`fit_report`, each row in a process of its own
through ``config.estimate``; no GPU, dataset or weights), whether it fits with the headroom
(CUDA context, workspaces, fragmentation), and the largest batch and frame count that would.
Without it: the recomputation plan of the configured backbone (segments, estimated peak and
overhead, the smallest feasible budget) in ``plan.json``; with ``memory=auto``, its decision
table, or exit 2 naming the smallest budget that works. Details:
docs/design/internals.md#planning-before-a-run."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from videotrain.config.build import (
    build_model,
    compose_cfg,
    config_mixes_frames,
    group_choices,
    plan_memory,
    resolve_device,
    seed_everything,
)
from videotrain.config.estimate import ConfigEstimator, num_classes_of, run_isolated
from videotrain.memory.base import set_clip_length
from videotrain.memory.estimate import (
    CUDA_CONTEXT_GIB,
    GIB,
    UNSEEN_FRAC,
    StepMemory,
    device_need,
    usable_bytes,
)
from videotrain.memory.recompute import InfeasibleBudget, Recompute
from videotrain.untrusted.files import write_text

# (strategy, keep_ratio, policy, overrides): the rows of the fit table, by memory= name
FIT_ROWS: list[tuple[str, float | None, str | None, list[str]]] = [
    ("e2e", None, None, ["memory=e2e"]),
    ("sbp", 0.5, None, ["memory=sbp", "memory.keep_ratio=0.5"]),
    ("sbp", 0.25, None, ["memory=sbp", "memory.keep_ratio=0.25"]),
    ("frame_dropout", 0.5, None, ["memory=frame_dropout", "memory.keep_ratio=0.5"]),
    ("recompute", None, "blocks", ["memory=recompute", "memory.policy=blocks"]),
    ("recompute", None, "sqrt", ["memory=recompute", "memory.policy=sqrt"]),
    ("recompute", None, "optimal", ["memory=recompute", "memory.policy=optimal",
                                    "memory.budget_mb=null", "memory.budget_frac=null"]),
    ("sbp", 0.5, "optimal", ["memory=sbp", "memory.keep_ratio=0.5", "memory.recompute=optimal"]),
]


def strategy_from(cfg: DictConfig) -> Recompute:
    mem = OmegaConf.to_container(cfg.memory, resolve=True)
    assert isinstance(mem, dict)
    if str(mem.get("_target_", "")).endswith("Recompute"):
        keys = ("policy", "budget_mb", "budget_frac", "objective", "segments")
        opts = {k: mem[k] for k in keys if k in mem}
        if opts.get("policy") == "blocks":
            opts["policy"] = "optimal"
            opts["budget_mb"] = opts["budget_frac"] = None
        return Recompute(**opts)
    return Recompute("optimal")


def make_report(cfg: DictConfig) -> dict[str, Any]:
    """The plan report for ``cfg`` (raises ``InfeasibleBudget`` with the smallest budget)."""
    num_classes = int(cfg.data.get("num_classes") or 2)
    model = build_model(cfg, num_classes, init=False).train()
    d = cfg.data
    frames = torch.zeros(int(d.batch_size) * int(d.num_frames), 3, int(d.crop_size), int(d.crop_size))
    strategy = strategy_from(cfg)
    set_clip_length(model.backbone, int(d.num_frames))  # a temporal shift needs T
    with torch.no_grad():
        _, _, _, report = strategy.make_plan(model.backbone, frames)  # (B*T, C, H, W)
    report.pop("_index")
    report["configured_policy"] = OmegaConf.select(cfg, "memory.policy")
    return report


def auto_report(cfg: DictConfig) -> dict[str, Any]:
    """``memory=auto``'s decision for ``cfg`` (raises ``NoPlanFits`` when nothing fits), made
    from estimates: nothing runs on a device, so ``device=cuda`` with ``memory.budget_gb``
    plans for a GPU on a machine without one."""
    seed_everything(cfg.seed)
    num_classes = int(cfg.data.get("num_classes") or 2)
    name = str(cfg.device)
    gpu_anywhere = name.startswith("cuda") and OmegaConf.select(cfg, "memory.budget_gb") is not None
    device = torch.device(name) if gpu_anywhere else resolve_device(name)
    model = build_model(cfg, num_classes, init=False)  # stays on the CPU: only its structure is read
    return plan_memory(cfg, model, device, num_classes, ConfigEstimator) or {}


def is_auto(cfg: DictConfig) -> bool:
    return str(OmegaConf.select(cfg, "memory._target_") or "").endswith("AutoStrategy")


def render(report: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        f"policy {report['policy']}  input {tuple(report['input_shape'])}  "
        f"{report['vertices']} tensors, {report['lower_sets']} lower sets"
        f"{'' if report['exact_family'] else ' (approximate family)'}",
        *([] if report["exact"] or report["policy"] != "optimal" else [
            "approximate plan: it may recompute more than the optimum (docs/memory.md)"]),
        f"e2e peak            {report['e2e_peak_bytes'] / mib:10.2f} MiB",
        f"estimated peak      {report['estimated_peak_bytes'] / mib:10.2f} MiB",
        f"estimated overhead  {report['overhead_frac_of_forward']:10.1%} of a forward",
    ]
    if report["smallest_feasible_bytes"] is not None:
        lines.append(f"smallest budget     {report['smallest_feasible_bytes'] / mib:10.2f} MiB")
    for i, seg in enumerate(report["segments"]):
        kept = seg["kept"] if isinstance(seg["kept"], str) else ", ".join(seg["kept"])
        lines.append(
            f"  segment {i:2d}: {len(seg['nodes']):3d} tensors {seg['bytes'] / mib:8.2f} MiB  "
            f"{seg['nodes'][0]} .. {seg['nodes'][-1]}  keeps: {kept}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- --fit: the fit table
def _largest(mem: StepMemory, current: int, budget: float, frames: bool, cap: int = 4096) -> int:
    """The largest clips per batch (or frames per clip) whose extrapolated need fits ``budget``."""
    best = 0
    for n in range(1, cap + 1):
        if device_need(mem.scaled(n / current, frames)) > budget:
            break
        best = n
    return best


def fit_report(overrides: list[str], device_gb: float | None, target: str = "cuda",
               processes: int = 2) -> dict[str, Any]:
    """The fit table for the config ``overrides``, each row's memory strategy substituted:
    estimated training and validation peaks (GiB), and with ``device_gb`` (GiB, as cards are
    sold: a "24 GB" card has 24 GiB) whether the row fits and the largest batch size and
    frame count that would."""
    base = compose_cfg(overrides)
    choices = group_choices(overrides)
    d = base.data
    b, t = int(d.batch_size), int(d.num_frames)
    # SBP + recompute is frame-level: a backbone that mixes frames (TSM's shift, on in the
    # default resnet10) cannot use it, which is not a failure of the estimate
    mixes = config_mixes_frames(base)
    not_here = [(s, k, p) for s, k, p, _ in FIT_ROWS if mixes and s == "sbp" and p is not None]
    rows = [(s, k, p, [*overrides, *row_ov]) for s, k, p, row_ov in FIT_ROWS
            if (s, k, p) not in not_here]
    # the optimal plans take longest (the planner's search): start them first
    order = sorted(range(len(rows)), key=lambda i: rows[i][2] != "optimal")
    t0 = time.perf_counter()
    done = run_isolated([(rows[i][3], target) for i in order], processes)
    results = [done[order.index(i)] for i in range(len(rows))]
    budget = None if device_gb is None else usable_bytes(device_gb, target)
    out_rows = []
    for (strategy, keep, policy, _), res in zip(rows, results, strict=True):
        row: dict[str, Any] = {"strategy": strategy, "keep_ratio": keep, "policy": policy}
        if "error" in res:
            out_rows.append({**row, "error": res["error"]})
            continue
        mem: StepMemory = res["memory"]
        row.update({
            "estimated_train_peak_gb": mem.train_peak / GIB,
            "estimated_eval_peak_gb": (mem.eval_peak or 0) / GIB,
            "estimated_step_increase_mb": mem.step_increase / 2**20,
            "held_gb": mem.held / GIB,
            "seconds": res["seconds"],
        })
        if budget is not None:
            row.update({"fits": device_need(mem) <= budget,
                        "max_batch_size": _largest(mem, b, budget, frames=False),
                        "max_num_frames": _largest(mem, t, budget, frames=True)})
        out_rows.append(row)
    out_rows += [{"strategy": s, "keep_ratio": k, "policy": p,
                  "skipped": "frame-level SBP + recompute; model.backbone.temporal_shift mixes frames"}
                 for s, k, p in not_here]
    return {
        "device": target, "device_memory_gb": device_gb,
        "precision": str(base.trainer.precision), "backbone": choices["model/backbone"],
        "head": choices["model/head"], "batch_size": b, "num_frames": t,
        "crop_size": int(d.crop_size), "optimizer": str(base.optim.name),
        "num_classes": num_classes_of(base),
        "headroom": {"cuda_context_gb": CUDA_CONTEXT_GIB, "unseen_frac": UNSEEN_FRAC},
        "rows": out_rows, "seconds": time.perf_counter() - t0, "processes": processes,
    }


def render_fit(report: dict[str, Any]) -> str:
    """The fit table as text."""
    gb = report["device_memory_gb"]
    head = (f"{report['backbone']} + {report['head']}, {report['batch_size']} clips x "
            f"{report['num_frames']} frames x {report['crop_size']} px, {report['precision']}, "
            f"{report['optimizer']}" + (f", on a {gb:g} GiB {report['device']} device" if gb else ""))
    lines = [head, f"{'strategy':<26}{'train GiB':>10}{'eval GiB':>10}"
             + (f"{'fits':>6}{'max batch':>11}{'max frames':>12}" if gb else "")]
    for r in report["rows"]:
        name = r["strategy"] + (f" {r['keep_ratio']:g}" if r["keep_ratio"] else "") + (
            f" +{r['policy']}" if r["policy"] and r["strategy"] == "sbp" else
            f" {r['policy']}" if r["policy"] else "")
        if "error" in r or "skipped" in r:  # a row without figures: say why
            why = f"error: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"{name:<26}{why}")
            continue
        line = f"{name:<26}{r['estimated_train_peak_gb']:>10.2f}{r['estimated_eval_peak_gb']:>10.2f}"
        if gb:
            line += f"{'yes' if r['fits'] else 'no':>6}{r['max_batch_size']:>11}{r['max_num_frames']:>12}"
        lines.append(line)
    lines.append(f"headroom: {report['headroom']['cuda_context_gb']} GiB CUDA context + "
                 f"{report['headroom']['unseen_frac']:.0%} for workspaces and fragmentation; "
                 f"{report['seconds']:.0f} s")
    return "\n".join(lines)


def fit_main(device_gb: float, overrides: list[str], out: Path, jobs: int) -> int:
    if device_gb <= 0:
        print(f"error: --fit takes the device's memory in GiB (> 0), got {device_gb:g}",
              file=sys.stderr)
        return 2
    report = fit_report(overrides, device_gb, target="cuda", processes=jobs)
    print(render_fit(report))
    write_text(out, json.dumps(report, indent=2))  # the user's --out, never through a link
    print(f"wrote {out}")
    return 1 if any("error" in r for r in report["rows"]) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m videotrain.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="plan.json", help="where to write the JSON report")
    parser.add_argument("--fit", type=float, metavar="GB", default=None,
                        help="estimate every strategy's peak for a CUDA device with GB GiB of memory")
    parser.add_argument("--jobs", type=int, default=2,
                        help="--fit: simulations run at once, one process each (default 2)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. memory=recompute")
    args = parser.parse_args(argv)
    if args.fit is not None:
        return fit_main(args.fit, list(args.overrides), Path(args.out), args.jobs)
    cfg = compose_cfg(list(args.overrides))
    try:
        report = auto_report(cfg) if is_auto(cfg) else make_report(cfg)
    except InfeasibleBudget as err:  # memory=auto's NoPlanFits is one too
        print(f"error: {err}", file=sys.stderr)
        return 2
    if is_auto(cfg):
        print(f"{report['table']}\nchosen: {report['reason']}")
    else:
        print(render(report))
    write_text(args.out, json.dumps(report, indent=2))  # the user's --out, never through a link
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
