"""Will it fit? Predict a configured run's GPU memory for every memory strategy, on any machine.

``python -m videotrain.plan --fit GB`` calls :func:`fit_report`. For each strategy row (the
``memory=`` names) the configured model's training step and validation forward run on fake
tensors (``videotrain.memory.auto.predict``), at full size, with the configured precision
and optimizer. The model is built as training builds it (``build.build_model``:
``model.freeze_backbone``, SyncBatchNorm under ``trainer.sync_bn``), with no weights read
(``model.pretrained``, ``pretrained_path`` and ``init_from`` are ignored); nothing is allocated. Each simulation runs in a process of its own (two at a time, from a fork server).

What is predicted is ``torch.cuda.max_memory_allocated`` during a training step (parameters,
gradients, optimizer state, the batch, and what the strategy keeps and allocates), and during
a validation forward. A row fits when that peak plus the headroom below stays within the card:
the CUDA context (not in ``max_memory_allocated``) and a share for what fake tensors cannot
see (cuDNN/cuBLAS workspaces, the caching allocator's rounding and fragmentation).

The largest batch size and frame count are extrapolated from the same simulation
(``StepMemory.scaled``): what the forward and backward keep and allocate grows linearly with
the frames of a batch, while parameters, gradients, optimizer state and the optimizer's
temporaries do not.
"""

from __future__ import annotations

import gc
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from videotrain.build import (
    build_model,
    compose_cfg,
    eval_settings,
    group_choices,
    optimizer_from_cfg,
)
from videotrain.config_files import checked_config
from videotrain.engine.precision import PRECISIONS
from videotrain.memory.auto.predict import (
    CUDA_CONTEXT_GIB,
    GIB,
    UNSEEN_FRAC,
    StepMemory,
    device_need,
    simulate_step,
    usable_bytes,
)
from videotrain.models.video import VideoClassifier

# (strategy, keep_ratio, policy, overrides): the rows of the fit table, by memory= name
FIT_ROWS: list[tuple[str, float | None, str | None, list[str]]] = [
    ("e2e", None, None, ["memory=e2e"]),
    ("sbp", 0.5, None, ["memory=sbp", "memory.keep_ratio=0.5"]),
    ("sbp", 0.25, None, ["memory=sbp", "memory.keep_ratio=0.25"]),
    ("frame_dropout", 0.5, None, ["memory=frame_dropout", "memory.keep_ratio=0.5"]),
    ("checkpoint", None, "blocks", ["memory=checkpoint", "memory.policy=blocks"]),
    ("checkpoint", None, "sqrt", ["memory=checkpoint", "memory.policy=sqrt"]),
    ("checkpoint", None, "optimal", ["memory=checkpoint", "memory.policy=optimal",
                                     "memory.budget_mb=null", "memory.budget_frac=null"]),
    ("sbp", 0.5, "optimal", ["memory=sbp", "memory.keep_ratio=0.5", "memory.checkpoint=optimal"]),
]


def num_classes_of(cfg: DictConfig) -> int:
    """``data.num_classes`` when set; else 400 (Kinetics), which changes only the head's last
    layer: no dataset is read to plan."""
    return int(cfg.data.get("num_classes") or 400)


def simulate_cfg(cfg: DictConfig, target: str, with_eval: bool = True) -> StepMemory:
    """One training step (and validation forward) of ``cfg``'s model and batch, on fake
    tensors, for a ``target`` device type (``cuda``: AdamW/SGD take their foreach path)."""
    d = cfg.data
    b, t = int(d.batch_size), int(d.num_frames)
    size = int(d.crop_size)
    # the larger evaluation batch, in clips: validation, or the multi-view test after training
    val = int(d.get("val_batch_size") or b) * int(d.get("val_clips") or 1) * int(d.get("val_crops") or 1)
    test = int(cfg.eval.batch_size) * int(cfg.eval.clips) * int(cfg.eval.crops)
    eval_shape = (max(val, test if cfg.trainer.test_after_fit else 0), t, 3, size, size)
    classes = num_classes_of(cfg)
    # trainer.sync_bn converts BatchNorm on CUDA (with several processes, as the user intends
    # by setting it); on a single process SyncBatchNorm runs as BatchNorm, so it is simulated
    sync_bn = bool(cfg.trainer.sync_bn) and target == "cuda"

    def make_model() -> VideoClassifier:
        # training's own builder (model.freeze_backbone, SyncBatchNorm, the strategy), without
        # reading any weights: values do not change memory
        return build_model(cfg, classes, sync_bn=sync_bn, init=False)

    def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = optimizer_from_cfg(cfg, model)
        for group in optimizer.param_groups:  # CUDA tensors default to the foreach kernels
            group["foreach"] = target == "cuda"
        return optimizer

    return simulate_step(make_model, make_optimizer, (b, t, 3, size, size), classes,
                         autocast_dtype=PRECISIONS[str(cfg.trainer.precision)],
                         grad_clip=cfg.trainer.grad_clip,
                         label_smoothing=float(cfg.trainer.label_smoothing),
                         eval_video_shape=eval_shape if with_eval else None,
                         eval_frame_chunk=eval_settings(cfg).frame_chunk)


Job = tuple[list[str] | dict[str, Any], str]  # (overrides or a resolved config, target device type)


def _child(job: Job) -> dict[str, Any]:
    """Worker: one simulation in a fresh process. Automatic garbage collection stays off
    (see ``videotrain.memory.auto.predict``); the process ends with the task."""
    config, target = job
    gc.disable()
    t0 = time.perf_counter()
    try:
        # a resolved config from the parent is checked as one read from a file would be
        cfg = (checked_config(config, "the memory simulator's job") if isinstance(config, dict)
               else compose_cfg(config))
        return {"memory": simulate_cfg(cfg, target),
                "seconds": time.perf_counter() - t0}
    except Exception as err:  # reported per row, the other rows still run
        return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}


def run_isolated(jobs: list[Job], processes: int = 2) -> list[dict[str, Any]]:
    """Each job in a process of its own, results in the order of ``jobs``. Children come from
    a fork server that has imported this module (torch included) and run nothing else: a
    process that has run autograd cannot fork safely. Spawned where there is no fork server."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
    else:
        ctx = multiprocessing.get_context("spawn")
    # a process per task (Python >= 3.11); a worker that dies fails the call (BrokenProcessPool)
    # instead of hanging it, as multiprocessing.Pool would
    per_task = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}
    workers = max(min(processes, len(jobs)), 1)
    with ProcessPoolExecutor(workers, mp_context=ctx, **per_task) as pool:
        return list(pool.map(_child, jobs))


class ConfigPredictor:
    """``memory=auto``'s predictor: the configured run (``cfg``, with the dataset's real number
    of classes) with another ``memory:`` node, simulated in a process of its own."""

    def __init__(self, cfg: DictConfig, num_classes: int, target: str) -> None:
        base = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(base, dict)
        base["data"] = {**base["data"], "num_classes": num_classes}
        self.base, self.target = base, target

    def __call__(self, memory: dict[str, Any]) -> StepMemory:
        result = run_isolated([({**self.base, "memory": memory}, self.target)], processes=1)[0]
        if "error" in result:
            raise RuntimeError(result["error"])
        return result["memory"]


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
    predicted training and validation peaks (GiB), and with ``device_gb`` (GiB, as cards are
    sold: a "24 GB" card has 24 GiB) whether the row fits and the largest batch size and
    frame count that would."""
    base = compose_cfg(overrides)
    choices = group_choices(overrides)
    d = base.data
    b, t = int(d.batch_size), int(d.num_frames)
    rows = [(s, k, p, [*overrides, *row_ov]) for s, k, p, row_ov in FIT_ROWS]
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
            "predicted_train_peak_gb": mem.train_peak / GIB,
            "predicted_eval_peak_gb": (mem.eval_peak or 0) / GIB,
            "predicted_step_increase_mb": mem.step_increase / 2**20,
            "held_gb": mem.held / GIB,
            "seconds": res["seconds"],
        })
        if budget is not None:
            row.update({"fits": device_need(mem) <= budget,
                        "max_batch_size": _largest(mem, b, budget, frames=False),
                        "max_num_frames": _largest(mem, t, budget, frames=True)})
        out_rows.append(row)
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
        if "error" in r:
            lines.append(f"{name:<26}error: {r['error']}")
            continue
        line = f"{name:<26}{r['predicted_train_peak_gb']:>10.2f}{r['predicted_eval_peak_gb']:>10.2f}"
        if gb:
            line += f"{'yes' if r['fits'] else 'no':>6}{r['max_batch_size']:>11}{r['max_num_frames']:>12}"
        lines.append(line)
    lines.append(f"headroom: {report['headroom']['cuda_context_gb']} GiB CUDA context + "
                 f"{report['headroom']['unseen_frac']:.0%} for workspaces and fragmentation; "
                 f"{report['seconds']:.0f} s")
    return "\n".join(lines)
