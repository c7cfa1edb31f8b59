"""Plan before you queue: ``python -m videotrain.plan [--fit GB] [hydra overrides]``.

With ``--fit GB``: will this run fit a GPU with GB GiB of memory? For the configured model and
batch at full size, every memory strategy's training-step and validation peak is predicted on
fake tensors (``videotrain.fit``, no GPU, no dataset, no weights), with whether it fits and the
largest ``data.batch_size`` and ``data.num_frames`` that would; printed as a table and written
to ``--out`` as JSON.

Without ``--fit``, the recomputation plan viewer:

Builds the configured model (``videotrain.build.build_model``) and plans the backbone for the
training input ``(data.batch_size * data.num_frames, 3, data.crop_size, data.crop_size)``
without running any activations (shape propagation uses fake tensors). Prints the segments, the
predicted peak, the predicted recompute overhead, the e2e peak and the smallest
feasible budget, and writes ``plan.json`` (``--out``). Why a separate tool: choosing
``memory.budget_mb`` needs those numbers before a run, and an infeasible budget should be
found here rather than at the first training step.

With ``memory=auto`` it prints ``memory=auto``'s decision instead: it profiles the configured
model and batch on ``device`` (real training steps on a copy of the model, nothing is trained),
or with ``memory.budget_gb=G`` predicts each candidate it reaches at full size on fake tensors
(``device=cuda`` plans for a G GiB GPU from any machine), prints the table of candidates with
their peaks, predicted step times and the reason for the choice, and writes it to ``--out``; a
budget no plan fits exits with status 2 and the smallest budget that would work.

With any other ``memory`` than ``checkpoint`` the viewer plans ``memory.policy=optimal`` with no
budget (the smallest feasible), for reference. ``memory.policy=blocks`` is reported as the
graph's e2e figures only (block checkpointing is not a graph plan).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from videotrain.build import (
    build_model,
    build_precision,
    compose_cfg,
    plan_memory,
    resolve_device,
    seed_everything,
)
from videotrain.fit import fit_report, render_fit
from videotrain.memory.base import set_clip_length
from videotrain.memory.recompute import InfeasibleBudget, Recompute


def strategy_from(cfg: DictConfig) -> Recompute:
    mem = OmegaConf.to_container(cfg.memory, resolve=True)
    assert isinstance(mem, dict)
    if str(mem.get("_target_", "")).endswith("Recompute"):
        keys = ("policy", "budget_mb", "budget_frac", "objective", "lower_set_cap", "segments")
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
    """``memory=auto``'s decision for ``cfg`` (raises ``NoPlanFits`` when nothing fits). With
    ``memory.budget_gb`` it is made from predictions and nothing runs on a device, so
    ``device=cuda`` plans for a GPU on a machine without one."""
    seed_everything(cfg.seed)
    num_classes = int(cfg.data.get("num_classes") or 2)
    name = str(cfg.device)
    if OmegaConf.select(cfg, "memory.budget_gb") is not None:
        device = torch.device(name) if name.startswith("cuda") else resolve_device(name)
        model = build_model(cfg, num_classes, init=False)  # stays on the CPU: only its structure is read
        return plan_memory(cfg, model, None, device, num_classes) or {}
    device = resolve_device(name)
    precision = build_precision(cfg, device)
    model = build_model(cfg, num_classes, init=False).to(device)
    return plan_memory(cfg, model, precision, device, num_classes) or {}


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
        f"predicted peak      {report['predicted_peak_bytes'] / mib:10.2f} MiB",
        f"predicted overhead  {report['overhead_frac_of_forward']:10.1%} of a forward",
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


def fit_main(device_gb: float, overrides: list[str], out: Path, jobs: int) -> int:
    if device_gb <= 0:
        print(f"error: --fit takes the device's memory in GiB (> 0), got {device_gb:g}",
              file=sys.stderr)
        return 2
    report = fit_report(overrides, device_gb, target="cuda", processes=jobs)
    print(render_fit(report))
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 1 if any("error" in r for r in report["rows"]) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m videotrain.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="plan.json", help="where to write the JSON report")
    parser.add_argument("--fit", type=float, metavar="GB", default=None,
                        help="predict every strategy's peak for a CUDA device with GB GiB of memory")
    parser.add_argument("--jobs", type=int, default=2,
                        help="--fit: simulations run at once, one process each (default 2)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. memory=checkpoint")
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
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
