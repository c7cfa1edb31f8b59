"""Predict a training step's memory without running it: the step on fake tensors, counted.

The model, the optimizer and a batch are built under ``FakeTensorMode`` (shapes, dtypes and
autograd, no data) and the trainer's step runs on them, memory strategy included, while
:class:`~videotrain.metrics.live_bytes.LiveStorageBytes` counts every storage alive: the figures
are ``memory_allocated`` and ``max_memory_allocated`` as a caching allocator would report them
(no workspaces, rounding or fragmentation). Mixed precision runs under CPU autocast, whose
casting rules match CUDA's for the layers used here; fp16's GradScaler is left out (a few
scalars). Callers run this in a process of its own (``videotrain.config.estimate``):
garbage-collecting some fake-tensor graphs crashes torch 2.14.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from videotrain.memory.base import mixes_frames, set_clip_length
from videotrain.metrics.live_bytes import LiveStorageBytes

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5  # CUDA context and kernels' modules: device memory outside the allocator
UNSEEN_FRAC = 0.1  # workspaces, allocator rounding and fragmentation, as a share of the peak


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one steady-state training step (step 2 on; step 1 also allocates gradients
    and optimizer state), and of a validation forward in the same process."""

    held: int  # between steps: parameters, buffers, gradients, optimizer state, the batch
    batch: int  # of which the training batch (the input clips)
    fwd_bwd_peak: int  # the most alive at once up to the end of backward
    opt_peak: int  # the most alive during gradient clipping and the optimizer step
    eval_peak: int | None = None  # the most alive during a validation forward, training state held
    eval_batch: int = 0  # of which the validation batch

    @property
    def train_peak(self) -> int:
        """The most alive at once during the step: what ``max_memory_allocated`` reads."""
        return max(self.fwd_bwd_peak, self.opt_peak)

    @property
    def step_increase(self) -> int:
        """The step's peak over what is held between steps: the trainer's ``train_peak_mem_mb``
        scale (its meter starts each step at ``held``)."""
        return self.train_peak - self.held

    def scaled(self, factor: float, frames: bool = False) -> StepMemory:
        """The same step with ``factor`` times the clips per batch, or (``frames``) the frames
        per clip: the training batch and what the forward and backward keep and allocate scale
        with it; parameters, gradients and optimizer state do not, nor do the optimizer's
        temporaries. Longer clips scale the validation forward too; more clips do not (its
        batch is its own). An extrapolation: a transformer head's attention grows with the
        square of the frames per clip (small beside the backbone), and SBP rounds its kept
        frames per clip."""
        grow = round((factor - 1) * self.batch)
        held = self.held + grow

        def scale(peak: int) -> int:
            return held + round(factor * (peak - self.held))

        eval_peak = self.eval_peak
        if eval_peak is not None and frames:
            eval_peak = scale(eval_peak)
        return StepMemory(held, self.batch + grow, scale(self.fwd_bwd_peak), self.opt_peak + grow,
                          eval_peak, round(self.eval_batch * factor) if frames else self.eval_batch)


def device_need(mem: StepMemory) -> float:
    """Device bytes a run needs: its larger peak (training step or validation) and the share
    fake tensors cannot see."""
    return max(mem.train_peak, mem.eval_peak or 0) * (1 + UNSEEN_FRAC)


def usable_bytes(device_gb: float, target: str = "cuda") -> float:
    """What the allocator may use of a device with ``device_gb`` GiB: all of it but the CUDA
    context (on CUDA)."""
    return (device_gb - (CUDA_CONTEXT_GIB if target == "cuda" else 0.0)) * GIB


class OneDNNConvBackward(TorchDispatchMode):
    """The CPU target: oneDNN's convolution backward computes a weight gradient in its own
    blocked layout and reorders it into torch's, so one more weight-sized buffer is alive while
    the op runs. Counted as a tensor that lives for the op (enter inside the counting mode)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        reorder = None
        if func is torch.ops.aten.convolution_backward.default and args[-1][1]:  # grad_weight wanted
            reorder = torch.empty_like(args[2])  # the weight's size
        try:
            return func(*args, **kwargs)
        finally:
            del reorder


def onednn_target(target: str) -> bool:
    """Whether a step for ``target`` runs its convolutions through oneDNN (a CPU with it on)."""
    return target == "cpu" and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """``torch.nn.init``'s in-place initialisers do nothing in the body: values do not change
    memory, and some (``trunc_normal_``) read values back, which fake tensors cannot."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def _autocast(dtype: torch.dtype | None, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


def simulate_step(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    video_shape: tuple[int, int, int, int, int],
    num_classes: int,
    autocast_dtype: torch.dtype | None = None,
    grad_clip: float | None = None,
    label_smoothing: float = 0.0,
    eval_video_shape: tuple[int, int, int, int, int] | None = None,
    eval_frame_chunk: int | str | None = None,
    fake: bool = True,
    onednn: bool = False,
) -> StepMemory:
    """Count one training step of ``make_model()`` on a ``video_shape`` batch
    ``(B, T, C, H, W)``, as ``Trainer`` takes it, and (with ``eval_video_shape``, the
    validation batch flattened to clips) one validation forward. ``make_model`` and
    ``make_optimizer`` run inside the fake mode, so they must build, not load, their tensors.
    ``eval_frame_chunk`` is the evaluation's frames per backbone forward, as the model's
    (``"auto"``: sized from this step's peak, as the trainer does).
    ``fake=False`` runs the same steps on real CPU tensors, to check the simulation against.
    ``onednn``: count oneDNN's convolution backward as a CPU runs it (:class:`OneDNNConvBackward`)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    kernels = OneDNNConvBackward() if onednn else contextlib.nullcontext()
    with mode, LiveStorageBytes() as live, kernels:
        with _no_weight_init():
            model = make_model().train()
        optimizer = make_optimizer(model)
        video = torch.randn(*video_shape)  # (B, T, C, H, W)
        labels = torch.randint(0, num_classes, (video_shape[0],))
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # as between the trainer's steps: gradients kept, optimizer state made
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        # shape-dependent preparation (recompute plans, traced graphs) on a first forward,
        # not counted: on a device it leaves nothing behind, but on fake tensors the planner's
        # per-node trace leaves parameter-sized gradients cached by torch
        with live.paused(), _autocast(autocast_dtype):
            model(video)

        held = live.now()
        live.reset_peak()
        with _autocast(autocast_dtype):
            logits = model(video)  # (B, K)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
        del logits
        loss.backward()
        del loss
        fwd_bwd_peak = live.peak
        live.reset_peak()
        if grad_clip:
            nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        opt_peak = live.peak

        eval_peak, eval_batch = None, 0
        batch = video.untyped_storage().nbytes()
        del video, labels  # validation runs after the epoch, its training batches released
        if eval_video_shape is not None:
            model.eval()
            if eval_frame_chunk == "auto":  # the whole evaluation within the training peak
                budget = (max(fwd_bwd_peak, opt_peak) - (held - batch)
                          - 4 * torch.Size(eval_video_shape).numel())  # less the eval batch (fp32)
                with live.paused():
                    eval_frame_chunk = eval_chunk(model, eval_video_shape, budget, autocast_dtype,
                                                  in_fake_mode=fake)
            model.eval_frame_chunk = eval_frame_chunk
            clips = torch.randn(*eval_video_shape)  # (B*V, T, C, H, W)
            eval_batch = clips.untyped_storage().nbytes()
            live.reset_peak()
            with torch.no_grad(), _autocast(autocast_dtype):
                model(clips)
            eval_peak = live.peak
    return StepMemory(held, batch, fwd_bwd_peak, opt_peak, eval_peak, eval_batch)


@contextlib.contextmanager
def _fake_tensors(entered: bool = False) -> Iterator[None]:
    """A ``FakeTensorMode`` for a count made from real code (none where the caller ``entered``
    one). On exit it clears autocast's weight cache: a count inside a real autocast region
    (evaluation's ``frame_chunk="auto"``, searched in the model's forward) caches fake bf16
    copies of the real weights there, and the real forward after it would compute with them."""
    if entered:
        yield
        return
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        torch.clear_autocast_cache()


def no_grad_peak(backbone: nn.Module, frames: int, frame_shape: tuple[int, ...],
                 autocast_dtype: torch.dtype | None = None) -> int:
    """Peak bytes of a ``no_grad`` forward of ``backbone`` over ``frames`` frames of
    ``frame_shape (C, H, W)`` above what is held before it, its input included; counted on fake
    tensors (enter a ``FakeTensorMode`` first)."""
    device = next(backbone.parameters()).device  # fake frames where the weights are
    was_training = backbone.training
    backbone.eval()
    try:
        with LiveStorageBytes() as live:
            base = live.now()
            x = torch.randn(frames, *frame_shape, device=device)  # (N, C, H, W)
            with torch.no_grad(), _autocast(autocast_dtype, device.type):
                backbone(x)
            return live.peak - base
    finally:
        backbone.train(was_training)


def frames_within(backbone: nn.Module, frame_shape: tuple[int, ...], budget: float,
                  most: int, autocast_dtype: torch.dtype | None, per: int) -> int:
    """The most frames (1 to ``most``) a ``no_grad`` forward of ``backbone`` (fake, in the
    caller's ``FakeTensorMode``) may take at once to stay within ``budget`` bytes, by binary
    search over the peak counted on fake tensors, in units of ``per`` frames (whole clips, for a
    backbone that mixes frames). Searched, not extrapolated: the peak is the largest of the
    layers' (fixed + per-frame) costs, so which layer sets it changes with the number of frames
    (in bf16 autocast's weight copies set it for a few frames, the first activations for many)."""
    def fits(n: int) -> bool:
        return no_grad_peak(backbone, n * per, frame_shape, autocast_dtype) <= budget

    if fits(most):
        return most
    low, high = 1, most  # fits(low) is assumed (at least a frame), fits(high) is false
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def eval_chunk(model: nn.Module, video_shape: tuple[int, ...], budget: float,
               autocast_dtype: torch.dtype | None = None, in_fake_mode: bool = False) -> int:
    """Frames per backbone forward for an evaluation forward of ``model`` (a
    ``VideoClassifier``) over ``video_shape (B, T, C, H, W)`` to stay within ``budget`` bytes:
    what the frames cannot share (the features of all frames and the head over them, counted
    once on fake tensors) comes off the budget, and the backbone gets the rest
    (:func:`frames_within`). A backbone that mixes frames (temporal shift) gets whole clips."""
    b, t = video_shape[:2]
    per = t if mixes_frames(model.backbone) else 1
    set_clip_length(model.backbone, t)
    device = next(model.parameters()).device
    with _fake_tensors(in_fake_mode):
        with LiveStorageBytes() as live, torch.no_grad(), _autocast(autocast_dtype, device.type):
            base = live.now()
            feats = torch.randn(b, t, model.backbone.feature_dim, device=device)  # (B, T, D)
            positions = torch.arange(t, device=device).expand(b, t)  # (B, T)
            model.head(feats, positions)
            shared = live.peak - base
        return per * frames_within(model.backbone, tuple(video_shape[2:]), budget - shared,
                                   b * t // per, autocast_dtype, per)
