"""One benchmark row, measured in its own process (``python -m videotrain.bench --child SPEC``).

The parent starts every row in a fresh interpreter so that one row's allocator state, caches
and high-water mark never leak into the next. On CPU it sets ``MALLOC_MMAP_THRESHOLD_=65536``
so large freed blocks go back to the OS and ``VmHWM`` tracks tensor memory (see
``videotrain.metrics.memory``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from videotrain.bench.row_setup import prepare_row
from videotrain.memory.compiled import compile_counts
from videotrain.metrics.saved import saved_activation_bytes


def synthetic_batch(batch_size: int, frames: int, size: int, num_classes: int,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random clip batch in every row: video ``(B, T, 3, H, W)``, labels ``(B,)``."""
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(batch_size, frames, 3, size, size, generator=g)
    labels = torch.randint(0, num_classes, (batch_size,), generator=g)
    return video, labels


def step_stats(times: list[float], peaks: list[float], fwd_bwd: list[float],
               batch_size: int, metered_times: list[float] | None = None) -> dict[str, Any]:
    """Per-step measurements -> the reported figures (median time, max peak)."""
    step_time = statistics.median(times) if times else None
    metered = metered_times or []
    return {
        "metered_step_time_s": statistics.median(metered) if metered else None,
        "metered_step_times_s": metered,
        "peak_mem_mb": max(peaks) if peaks else None,
        "peak_mem_mb_median": statistics.median(peaks) if peaks else None,
        "fwd_bwd_peak_mb": max(fwd_bwd) if fwd_bwd else None,
        "step_time_s": step_time,
        "clips_per_s": batch_size / step_time if step_time else None,
        "step_times_s": times,
        "peak_mems_mb": peaks,
        "fwd_bwd_mems_mb": fwd_bwd,
    }


def plan_figures(strategy: object) -> dict[str, Any]:
    """A recomputation plan's estimates next to the measurement: estimated peak of the
    backbone's activations and their gradients, the plan's e2e figure, the smallest feasible
    budget and its fraction of e2e (what ``budget="min"`` rows report as ``budget_frac``)."""
    recompute = getattr(strategy, "recompute", None) or strategy
    report = getattr(recompute, "last_report", None)
    if not report:
        return {}
    out = {"estimated_peak_mb": report["estimated_peak_bytes"] / 2**20,
           "plan_e2e_peak_mb": report["e2e_peak_bytes"] / 2**20,
           "estimated_overhead_frac": report["overhead_frac_of_forward"],
           "plan_segments": len(report["segments"]), "plan_cost_model": report.get("cost_model")}
    if report.get("smallest_feasible_bytes"):
        out["smallest_feasible_mb"] = report["smallest_feasible_bytes"] / 2**20
        out["min_budget_frac"] = report["smallest_feasible_bytes"] / report["e2e_peak_bytes"]
    return out


def compile_figures(spec: dict[str, Any], warm: dict[str, int], recompiles: int) -> dict[str, Any]:
    """For compiled rows: the graphs and frames compiled by the end of the warm-up (0 graphs
    would mean the row silently ran eager), its graph breaks, the frames compiled again over the
    measured training steps (``recompiles``; evaluation's own compile left out), and the min-cut
    peer's activation budget."""
    if not warm["frames"]:
        return {}
    budget = spec.get("compile_budget")
    return {"compiled_graphs": warm["graphs"], "compiled_frames": warm["frames"],
            "graph_breaks": warm["graph_breaks"], "recompiles": recompiles,
            **({"activation_memory_budget": float(budget)} if budget is not None else {})}


def eval_peak_mb(model: torch.nn.Module, video: torch.Tensor, precision: Any, meter: Any,
                 budget_mb: float, clips_per_clip: int = 4) -> float | None:
    """Peak of a validation forward over ``clips_per_clip`` times the training batch's clips
    (a validation batch of several clips per video), with ``eval.frame_chunk=auto`` and the
    row's measured step peak as its budget, as the trainer runs validation. On the CPU it must
    run while the meter's allocator setting is on (before ``keep_freed_memory``)."""
    clips = video.repeat(clips_per_clip, 1, 1, 1, 1)  # (k*B, T, C, H, W), allocated before
    model.eval()
    model.eval_frame_chunk, model.eval_memory_budget = "auto", budget_mb * 2**20
    try:
        with torch.no_grad(), precision.autocast():
            model.frame_chunk(clips)  # the chunk is searched once, on fake tensors, unmetered
            meter.start()
            model(clips)
            return meter.stop()
    finally:
        model.train()


PROFILE_STEPS = 3  # steps torch.profiler watches on CUDA (after the timed ones)


def device_activity(spans: list[tuple[str, float, float]], wall_us: float, steps: int) -> dict[str, Any]:
    """GPU figures from the device activity of ``steps`` profiled steps that took ``wall_us``:
    ``spans`` are (name, start, end) in microseconds (kernels, memcpy, memset). Busy is the
    union of all spans over the wall time (overlapping streams counted once); kernels exclude
    copies and fills. A row that keeps the GPU busy is device-bound; a low busy fraction with
    many kernels per step is host-bound (docs/design §9)."""
    kernels = [(a, b) for name, a, b in spans if not name.startswith(("Memcpy", "Memset"))]
    busy, end = 0.0, float("-inf")
    for a, b in sorted((a, b) for _, a, b in spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"kernels_per_step": len(kernels) / steps,
            "kernel_ms_per_step": sum(b - a for a, b in kernels) / steps / 1e3,
            "gpu_busy": busy / wall_us if wall_us > 0 else None,
            "profiled_step_s": wall_us / 1e6 / steps}


def launch_figures(step: Callable[[], Any], device: torch.device, steps: int = PROFILE_STEPS) -> dict[str, Any]:
    """What a step launches: the aten ops it dispatches (one step, any device: the CPU's
    stand-in for kernel launches, ``metrics.dispatch``) and on CUDA, from ``torch.profiler``
    over ``steps`` steps, kernels per step, kernel time per step and the GPU busy fraction.
    ``launches_per_step`` is the kernels on CUDA, the aten ops elsewhere (one table column)."""
    from videotrain.metrics.dispatch import aten_ops

    with aten_ops() as ops:
        step()
    out: dict[str, Any] = {"ops_per_step": sum(ops.values()), "launches_per_step": sum(ops.values())}
    if device.type != "cuda" or steps < 1:
        return out
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
            wall = time.perf_counter() - t0
        spans = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
                 if e.device_type == DeviceType.CUDA]
    except Exception as err:  # noqa: BLE001 (a profiler failure must not lose the row's figures)
        return {**out, "profile_error": f"{type(err).__name__}: {err}"}
    out.update(device_activity(spans, wall * 1e6, steps))
    out["launches_per_step"] = out["kernels_per_step"]
    return out


@dataclass
class Row:
    """One row's model, AdamW, precision, batch and step-peak meter on its device, and the
    figures its setup reported (``prepare_row``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    precision: Any
    device: torch.device
    video: torch.Tensor  # (B, T, C, H, W)
    labels: torch.Tensor  # (B,)
    meter: Any
    figures: dict[str, Any]
    free_grads: bool

    def step(self, measured: bool = False) -> float | None:
        """One training step; ``measured``: returns the meter's high-water mark read before the
        optimizer step (forward and backward), not reset."""
        with self.precision.autocast():
            logits = self.model(self.video)  # (B, K)
        self.precision.backward(F.cross_entropy(logits.float(), self.labels))
        fwd_bwd = self.meter.read() if measured else None
        self.precision.scaler.step(self.optimizer)
        self.precision.scaler.update()
        self.optimizer.zero_grad(set_to_none=self.free_grads)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return fwd_bwd


# what a row does to the built model besides its strategy: (model, cfg, spec, device, precision)
# -> the figures to report (``row_setup.prepare_row``, or a suite's own beside the package)
Prepare = Callable[[torch.nn.Module, Any, dict[str, Any], torch.device, Any], dict[str, Any]]


def build_row(spec: dict[str, Any], prepare: Prepare = prepare_row) -> Row:
    """Compose the row's config and build its model (with the row's extras, ``prepare``), AdamW
    and the synthetic batch, as training would."""
    from omegaconf import OmegaConf

    from videotrain.config.build import (
        build_model,
        build_precision,
        compose_cfg,
        resolve_device,
        seed_everything,
    )
    from videotrain.engine.optim import build_optimizer
    from videotrain.metrics.memory import StepPeakMemory

    cfg = compose_cfg(list(spec["overrides"]))
    device = resolve_device(cfg.device)
    precision = build_precision(cfg, device)
    seed_everything(cfg.seed)
    if device.type == "cuda" and not cfg.deterministic:
        torch.backends.cudnn.benchmark = True  # autotuned conv kernels, as training would use
    model = build_model(cfg, num_classes=spec["num_classes"]).to(device).train()
    figures = prepare(model, cfg, spec, device, precision)
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    optimizer = build_optimizer(model, "adamw", lr=optim.get("lr", 1e-3),
                                weight_decay=optim.get("weight_decay", 0.0))
    video, labels = synthetic_batch(spec["batch_size"], spec["frames"], spec["size"],
                                    spec["num_classes"], spec.get("seed", 0))
    return Row(model, optimizer, precision, device, video.to(device), labels.to(device),
               StepPeakMemory(device), figures, bool(spec.get("free_grads", False)))


def meter_steps(row: Row, steps: int) -> tuple[list[float], list[float], list[float]]:
    """``steps`` steps under the meter: their times, whole-step peaks and forward-backward
    peaks (a step the meter could not read is left out of the peaks)."""
    times: list[float] = []
    peaks: list[float] = []
    fwd_bwd: list[float] = []
    for _ in range(steps):
        row.meter.start()
        t0 = time.perf_counter()
        fb = row.step(measured=True)
        times.append(time.perf_counter() - t0)
        peak = row.meter.stop()
        if peak is not None and fb is not None:
            peaks.append(peak)
            fwd_bwd.append(fb)
    return times, peaks, fwd_bwd


def time_steps(row: Row, steps: int) -> list[float]:
    """``steps`` steps' times, unmetered; on the CPU after ``keep_freed_memory()`` and one step
    that grows the heap to the step's working set."""
    from videotrain.metrics.memory import keep_freed_memory

    if row.device.type == "cpu":
        keep_freed_memory()
        row.step()
    times: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        row.step()
        times.append(time.perf_counter() - t0)
    return times


def measure(spec: dict[str, Any], prepare: Prepare = prepare_row) -> dict[str, Any]:
    """Compose the row's config, build model + AdamW (the row's extras: ``prepare``), run
    warm-up steps, metered steps (memory), then timed steps.

    Memory and time come from different steps because the CPU meter distorts time: it makes
    glibc hand every large freed tensor back to the OS (so the resident set tracks tensors), and
    each allocation then costs a fresh mapping and page faults, more for strategies that
    allocate more often (docs/benchmarks.md). The timed
    steps run after ``keep_freed_memory()``, one warm-up step later; the metered steps' times
    are kept as ``metered_step_time_s``. On CUDA the caching allocator is unaffected, and the
    split costs only the extra steps.

    ``peak_mem_mb`` is the whole step's peak (forward, backward, AdamW update);
    ``fwd_bwd_peak_mb`` the peak up to the end of backward (the same high-water mark read
    before the optimizer step). Both are increases over the memory held between steps:
    parameters, optimizer state, the input batch and, unless ``free_grads``, the parameter
    gradients (zeroed in place, as the trainer does). What remains is what
    a memory strategy controls: stored activations and the transients of the step."""
    row = build_row(spec, prepare)
    model, device, figures = row.model, row.device, row.figures
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    for _ in range(spec["warmup"]):
        row.step()
    warm = compile_counts()  # trainer.compile: compiled in the first step, never again
    metered_times, peaks, fwd_bwd = meter_steps(row, spec["steps"])
    recompiles = compile_counts()["frames"] - warm["frames"]  # over the metered steps
    if spec.get("eval_peak") and peaks:
        figures["eval_peak_mb"] = eval_peak_mb(model, row.video, row.precision, row.meter,
                                               max(peaks))
    after_eval = compile_counts()["frames"]  # evaluation compiles graphs of its own, once
    times = time_steps(row, spec["steps"])
    recompiles += compile_counts()["frames"] - after_eval  # over the timed steps
    if device.type == "cuda":  # absolute: weights, optimizer state and batch included
        figures["max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    figures.update(launch_figures(row.step, device, int(spec.get("profile_steps", PROFILE_STEPS))))
    with row.precision.autocast():
        saved = saved_activation_bytes(model, row.video)
    return {
        **step_stats(times, peaks, fwd_bwd, spec["batch_size"], metered_times),
        **plan_figures(model.strategy),
        **compile_figures(spec, warm, recompiles),
        **figures,
        "saved_act_mb": saved / 2**20,
        "memory": model.strategy.describe(),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "device": str(device),
        "precision": row.precision.key,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
