"""Measure training steps on the trainer's scale, for ``memory=auto``.

Why measure instead of model: the budget is what the trainer reports as ``train_peak_mem_mb``,
the per-step peak increase of :class:`~videotrain.metrics.memory.StepPeakMemory` (CUDA
``max_memory_allocated`` over the step minus what was allocated before it; CPU ``VmHWM`` minus
``VmRSS`` before). That figure holds more than stored activations: the backward pass's
activation gradients, the temporary of each parameter gradient being accumulated, the optimizer
update's temporaries. No static model gets all of that right on every backend, so a
:class:`StepProbe` runs real steps exactly as the trainer does (autocast forward, cross entropy,
backward, clipping, optimizer step, ``zero_grad(set_to_none=False)``), with the same meter.

Why on a copy: the probe deep-copies the backbone and head and builds its own optimizer, so the
run's weights, BatchNorm statistics, gradients, optimizer state and global RNG are exactly what
they would be without profiling. Every measured step is an increase over what the copy holds
between steps (weights, gradients, optimizer state), so holding the copy does not change the
figures. The price is one extra copy of those while planning.

The e2e profile (:meth:`StepProbe.profile`) is what estimates are built from: the step peak,
the bytes autograd saves for backward (whole model and backbone alone), the peak of a
``no_grad`` backbone forward over all frames (SBP's dropped-frame pass), and the step's phase
times. :meth:`StepProbe.measure` runs steps under any other strategy.

When e2e itself does not fit the device (on CUDA, the case ``memory=auto`` exists for), the
profile runs on half the clips, then a quarter, ... and extrapolates to the whole batch:
activations, the ``no_grad`` transient and compute times scale with the clips; the rest of the
step peak (parameter-gradient and optimizer temporaries) does not. ``Profile.measured_clips``
says how many clips were really measured.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from videotrain.memory.base import MemoryStrategy, mixes_frames
from videotrain.memory.e2e import EndToEnd
from videotrain.memory.recompute.execute import RecomputedForward
from videotrain.memory.sbp.lockstep import PartRows, lockstep_graph
from videotrain.memory.sbp.split import PatchedBN
from videotrain.metrics.memory import StepPeakMemory, _status_kb
from videotrain.metrics.saved import saved_activation_bytes, saved_bytes

MB = 2**20
log = logging.getLogger(__name__)


class StepPrecision(Protocol):
    """How a step's arithmetic runs, as the trainer runs it: what the probe needs of
    ``videotrain.engine.precision.Precision`` (the engine sits above ``memory/``, so the
    caller hands one in rather than this module importing it)."""

    key: str  # "32", "bf16" or "16" (fp16: the steps scale the loss)

    def autocast(self) -> AbstractContextManager: ...

    def backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler | None = None) -> None: ...


@dataclass
class Profile:
    """One e2e training step of the configured model and batch, measured (bytes, seconds)."""

    batch_size: int  # B
    num_frames: int  # T
    e2e_peak: float  # step peak (the trainer's train_peak_mem_mb scale)
    saved_total: float  # activations autograd saves in one forward of the whole model
    saved_backbone: float  # ... of the backbone alone over all B*T frames
    input_bytes: float  # the backbone input (B*T, C, H, W)
    nograd_peak: float  # peak of a no_grad backbone forward over all B*T frames
    fwd_s: float  # model forward
    bwd_s: float  # backward
    opt_s: float  # clipping + optimizer step + zero_grad
    backbone_fwd_s: float  # backbone forward with autograd (for the backbone/head time split)
    has_batchnorm: bool  # training-mode BatchNorm in the backbone (SBP's full_batch record pass)
    held_growth: float  # what the first step adds to what is held between steps (grads, optimizer state)
    measured_clips: int = 0  # clips of the batch really run (< batch_size: extrapolated); 0 = all
    lockstep: bool = False  # full-batch SBP runs one forward (the backbone traces; sbp/lockstep.py)
    mixes_frames: bool = False  # frames meet in the backbone (temporal shift): frame SBP runs lockstep
    # peak of SBP's one lockstep pass over frames that do not meet (frozen BN, no BN) under no_grad,
    # one frame of each clip kept: the dropped part's forward with its own input copy, live up
    # to its first op, and the kept input copy. None: frames meet, or the backbone does not trace
    twin_nograd_peak: float | None = None
    # the part of the overhead that grows with the frames that backpropagate (the backbone's
    # gradients in flight, a ViT's attention backward), from a second e2e step on half the
    # clips; 0 where one clip was measured. SBP and frame dropout hold r of it
    overhead_frames: float = 0.0

    @property
    def extrapolated(self) -> bool:
        return 0 < self.measured_clips < self.batch_size

    @property
    def frames(self) -> int:
        return self.batch_size * self.num_frames

    @property
    def overhead(self) -> float:
        """Peak minus saved activations: gradients in flight, optimizer temporaries, transients."""
        return max(self.e2e_peak - self.saved_total, 0.0)

    def overhead_at(self, r: float) -> float:
        """The overhead of a step whose backbone backpropagates through ``r`` of the frames."""
        return self.overhead - (1.0 - r) * min(self.overhead_frames, self.overhead)

    @property
    def head_saved(self) -> float:
        return max(self.saved_total - self.saved_backbone, 0.0)

    @property
    def step_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.opt_s

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("e2e_peak", "saved_total", "saved_backbone", "input_bytes", "nograd_peak",
                    "held_growth", "twin_nograd_peak", "overhead_frames"):
            value = out.pop(key)
            out[f"{key}_mb"] = None if value is None else value / MB
        out["overhead_mb"] = self.overhead / MB
        return out


@dataclass
class ProfiledStep:
    """One profiling step of a candidate plan (``StepProbe.measure``): what it measured."""

    peak: float  # bytes, the step's peak
    time_s: float  # seconds, one step (noisy on a CPU)


def unprepare(backbone: nn.Module) -> nn.Module:
    """Undo, in place, what the strategies' ``prepare`` did to ``backbone`` so that another
    strategy can be prepared on it: SBP's BatchNorm patches (``PatchedBN``) and per-block
    recompute wrappers (``RecomputedForward``). Why: a second SBP's ``prepare`` would keep the
    first one's patches, whose owner it does not control, and a leftover recompute wrapper would
    change what another plan computes."""
    for module in backbone.modules():
        while True:
            fwd = module.__dict__.get("forward")
            if isinstance(fwd, PatchedBN):
                _restore(module, fwd.orig)
            elif isinstance(fwd, RecomputedForward):
                _restore(module, fwd.original)
            else:
                break
    return backbone


def _restore(module: nn.Module, original: Callable | None) -> None:
    is_class_forward = original is None or (
        getattr(original, "__self__", None) is module
        and getattr(original, "__func__", None) is type(module).forward
    )
    if is_class_forward:
        del module.forward  # the class's forward again
    else:
        module.forward = original  # an instance-level forward someone set before us


def device_free_bytes(device: torch.device) -> float:
    """Memory a step could still take: CUDA free + cached-but-unallocated; CPU MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(free + cached)
    text = Path("/proc/meminfo").read_text()
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    if not m:
        raise RuntimeError("memory=auto: cannot read MemAvailable; set memory.budget_mb")
    return float(m.group(1)) * 1024


def _held_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    return float(_status_kb("VmRSS") * 1024)


class StepProbe:
    """Runs training steps of a copy of ``model`` on a fixed random batch, as the trainer does.

    ``make_optimizer(model)`` builds the run's optimizer for a model (same type and settings);
    ``precision`` is the run's ``Precision``; ``video_shape`` is ``(B, T, C, H, W)``. The copies
    are built with ``model``'s own class (``VideoClassifier(backbone, head, strategy)``), so this
    module never imports the model package above it. Plain arguments only: ``videotrain.config.build``
    reads the config and builds this.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        precision: StepPrecision,
        device: torch.device,
        video_shape: tuple[int, int, int, int, int],
        num_classes: int,
        grad_clip: float | None = None,
        label_smoothing: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.source, self.make_optimizer = model, make_optimizer
        self.precision, self.device = precision, device
        self.video_shape, self.num_classes = tuple(int(s) for s in video_shape), int(num_classes)
        self.grad_clip, self.label_smoothing = grad_clip, label_smoothing
        g = torch.Generator().manual_seed(seed)
        self.video = torch.randn(*self.video_shape, generator=g)  # (B, T, C, H, W), on the host
        self.labels = torch.randint(0, self.num_classes, (self.video_shape[0],), generator=g)
        self.meter = StepPeakMemory(device)
        self.clips = self.video_shape[0]  # clips per step (fewer only while profiling after an OOM)
        self.model: nn.Module | None = None  # the shared copy, built by profile()
        self.optimizer: torch.optim.Optimizer | None = None
        self.profiled: Profile | None = None
        self.steps_run = 0

    # ------------------------------------------------------------------ copies and steps
    def _fresh_copy(self) -> tuple[nn.Module, torch.optim.Optimizer, float]:
        """A copy of the model under e2e with one warm-up step taken (gradient buffers and
        optimizer state allocated, as between the trainer's steps); returns the bytes that
        warm-up added to what is held."""
        backbone = unprepare(copy.deepcopy(self.source.backbone))  # pristine, whatever src had
        # the model's own class (VideoClassifier): models/ sits above memory/, so no import
        model = type(self.source)(backbone, copy.deepcopy(self.source.head), EndToEnd())
        model.to(self.device).train()
        optimizer = self.make_optimizer(model)
        before = _held_bytes(self.device)
        self._step(model, optimizer)
        return model, optimizer, max(_held_bytes(self.device) - before, 0.0)

    def frames(self) -> torch.Tensor:
        """The batch as backbone input ``(B*T, C, H, W)`` on the device."""
        return self.video.flatten(0, 1).to(self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              times: list[float] | None = None, kept: list[int] | None = None) -> None:
        """One step as ``Trainer`` takes it (one micro-batch); ``times`` gets fwd, bwd, opt;
        ``kept`` the bytes the forward kept for backward (a lower bound of the step's peak)."""
        scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.key == "16")
        t0 = time.perf_counter()
        video = self.video[: self.clips].to(self.device)  # (B, T, C, H, W): inside the step, as in the trainer
        labels = self.labels[: self.clips].to(self.device)
        counting = nullcontext() if kept is None else saved_bytes(*model.parameters(), *model.buffers(), video)
        with counting as count:
            with self.precision.autocast():
                logits = model(video)  # (B, K)
            if count is not None:
                kept[:] = [count()]
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        self._sync()
        t1 = time.perf_counter()
        self.precision.backward(loss, scaler)
        self._sync()
        t2 = time.perf_counter()
        if self.grad_clip:
            scaler.unscale_(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=False)
        self._sync()
        if times is not None:
            times[:] = [t1 - t0, t2 - t1, time.perf_counter() - t2]
        self.steps_run += 1

    def _metered(self, fn: Callable[[], None]) -> float:
        self.meter.start()
        try:
            fn()
        finally:
            peak = self.meter.stop()  # also when the step raised (it resumes the collector)
        if peak is None:
            raise RuntimeError(
                "memory=auto needs per-step peak memory, but it cannot be measured here "
                "(/proc/self/clear_refs is not writable); use an explicit memory strategy"
            )
        return peak * MB

    # ------------------------------------------------------------------ public
    def profile(self) -> Profile:
        """Warm up a copy under e2e, then measure one e2e step and its parts (see module doc);
        on CUDA out-of-memory, on fewer clips, extrapolated to the batch."""
        clips = self.video_shape[0]
        while True:
            try:
                return self._profile(clips)
            except torch.cuda.OutOfMemoryError:
                if clips == 1:
                    raise
            self.close()  # outside the except block: its traceback no longer holds the tensors
            clips //= 2
            log.warning("memory=auto: the e2e profile ran out of memory; profiling %d of %d clips "
                        "and extrapolating", clips, self.video_shape[0])

    def _profile(self, clips: int) -> Profile:
        self.clips = clips
        try:
            with torch.random.fork_rng(devices=self._rng_devices()):
                got = self._measure_e2e()
        finally:
            self.clips = self.video_shape[0]
        b, t = self.video_shape[:2]
        scale = b / clips  # activations, transients and compute grow with the clips; the rest not
        (peak, saved_total, saved_bb, nograd, twin_nograd, overhead_frames, times, bb_fwd, held, has_bn,
         lockstep, mixes) = got
        frames = self.video.flatten(0, 1)
        self.profiled = Profile(
            batch_size=b, num_frames=t, e2e_peak=peak + (scale - 1) * (saved_total + overhead_frames),
            saved_total=saved_total * scale, saved_backbone=saved_bb * scale,
            input_bytes=float(frames.numel() * frames.element_size()), nograd_peak=nograd * scale,
            fwd_s=times[0] * scale, bwd_s=times[1] * scale, opt_s=times[2],
            backbone_fwd_s=bb_fwd * scale, has_batchnorm=has_bn, held_growth=held, measured_clips=clips,
            lockstep=lockstep, mixes_frames=mixes,
            twin_nograd_peak=None if twin_nograd is None else twin_nograd * scale,
            overhead_frames=overhead_frames * scale,
        )
        return self.profiled

    def _measure_e2e(self) -> tuple:
        """(peak, saved total, saved backbone, no_grad peak, lockstep no_grad peak, overhead that
        grows with the frames, [fwd, bwd, opt] s, backbone fwd s, held growth, has BN,
        lockstep-traceable, mixes frames) of ``self.clips`` clips, on a fresh warmed-up copy."""
        self.model, self.optimizer, held = self._fresh_copy()
        model = self.model
        times: list[float] = []
        peak = self._metered(lambda: self._step(model, self.optimizer, times))
        video = self.video[: self.clips].to(self.device)  # (b, T, C, H, W)
        frames = video.flatten(0, 1)  # (b*T, C, H, W)
        with self.precision.autocast():
            saved_total = saved_activation_bytes(model, video)
            t0 = time.perf_counter()
            saved_bb = saved_activation_bytes(model.backbone, frames)
            self._sync()
            bb_fwd = time.perf_counter() - t0

        def nograd_forward() -> None:
            with torch.no_grad(), self.precision.autocast():
                model.backbone(frames)  # (b*T, D), dropped at once

        nograd = self._metered(nograd_forward)
        mixes = mixes_frames(model.backbone)
        twin_nograd = None if mixes else self._twin_nograd_peak(model.backbone, frames)
        has_bn = any(isinstance(m, _BatchNorm) and m.training for m in model.backbone.modules())
        lockstep = has_bn and lockstep_graph(model.backbone) is not None
        overhead_frames = self._overhead_frames(model, peak, float(saved_total))
        return (peak, float(saved_total), float(saved_bb), nograd, twin_nograd, overhead_frames, times,
                bb_fwd, held, has_bn, lockstep, mixes)

    def _overhead_frames(self, model: nn.Module, peak: float, saved_total: float) -> float:
        """The part of the e2e step's overhead (peak minus saved activations) that grows with the
        clips, from the step on half of them: ``peak - peak_half = (1 - f) (A + O_frames)``, ``f``
        the fraction of clips run. The half step runs twice and the second is metered (a new
        shape's first step pays one-off work). 0 with one clip."""
        clips = self.clips
        if clips < 2:
            return 0.0
        self.clips = clips // 2
        try:
            self._step(model, self.optimizer)
            half = self._metered(lambda: self._step(model, self.optimizer))
        finally:
            self.clips = clips
        f = (clips // 2) / clips
        grows = (peak - half) / (1.0 - f) - saved_total
        return min(max(grows, 0.0), max(peak - saved_total, 0.0))

    def _twin_nograd_peak(self, backbone: nn.Module, frames: torch.Tensor) -> float | None:
        """Peak of the lockstep code's pass as frozen-BN or BN-free frame SBP runs it (one pass,
        frames that do not meet; ``lockstep_graph(full_batch=False)``) under ``no_grad``, keeping
        the first frame of each clip; ``None`` where it does not trace or a clip has one frame.
        Unlike ``nograd_peak`` it counts the input copies the pass makes: a ResNet's no_grad
        peak is at its first conv, where the dropped frames' copy is still live."""
        b, t = self.clips, self.video_shape[1]
        twin = lockstep_graph(backbone, full_batch=False) if t > 1 else None
        if twin is None:
            return None
        rows = torch.arange(b * t, device=frames.device).view(b, t)  # (b, T)
        part_rows = PartRows(rows[:, 0].contiguous(), rows[:, 1:].flatten())  # (b,), (b*(T-1),)

        def twin_pass() -> None:
            with torch.no_grad(), self.precision.autocast():
                twin(frames, part_rows)

        return self._metered(twin_pass)

    def measure(self, strategy: MemoryStrategy, isolated: bool = False) -> ProfiledStep:
        """The second of two steps under ``strategy``. ``isolated``: on a fresh warmed-up copy
        (for strategies whose ``prepare`` changes the backbone in ways :func:`unprepare` may not
        undo)."""
        if self.model is None:
            self.profile()
        with torch.random.fork_rng(devices=self._rng_devices()):
            if isolated:
                model, optimizer, _ = self._fresh_copy()
            else:
                model, optimizer = self.model, self.optimizer
            model.strategy = strategy
            strategy.prepare(unprepare(model.backbone))
            times: list[float] = []
            try:
                # the first step after a switch pays for one-off work (a recompute plan is traced
                # and split, allocator state settles): measure the second, as the trainer's
                # reported peak leaves out the first step
                self._step(model, optimizer)
                kept: list[int] = []
                peak = self._metered(lambda: self._step(model, optimizer, times, kept))
                # what the forward kept was allocated in the step: a floor under the meter, whose
                # CPU reading can miss a small model's tensors (reused heap memory reads as 0)
                peak = max(peak, float(kept[0]) if kept else 0.0)
            finally:
                unprepare(model.backbone)
                model.strategy = EndToEnd()
        return ProfiledStep(peak=peak, time_s=sum(times))

    def close(self) -> None:
        """Drop the copies (and, on CUDA, give their cached blocks back)."""
        self.model = self.optimizer = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _rng_devices(self) -> list[int]:
        if self.device.type == "cuda":
            return [self.device.index if self.device.index is not None else torch.cuda.current_device()]
        return []
