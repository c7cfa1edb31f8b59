"""Record/apply: SBP's general path, where the lockstep code (``sbp/lockstep.py``) cannot run
(the kept path recomputed, a backbone ``torch.fx`` cannot trace, the dropped frames in
``nograd_chunk`` pieces).

``split_forward(fn, x, ...)`` computes ``fn(x)`` for all ``N = B*T`` rows of ``x`` with an
autograd graph for the kept rows only. With training-mode BatchNorm it runs in two phases:
**record** (``fn`` under ``no_grad`` over all rows, each BN recording its batch statistics; the
dropped rows' outputs come from here) and **apply** (``fn`` again on the kept rows with autograd,
each BN normalizing with the recorded statistics through ``KeptRowsBatchNorm``). Invariant:
values, running statistics and gradients are the lockstep code's. Details:
``docs/design/internals.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch._prims_common import suggest_memory_format  # the memory format torch's ops pick
from torch.nn.modules.batchnorm import _BatchNorm

from videotrain.memory.compiled import outside_compiler
from videotrain.memory.recompute.execute import replay_on_recompute
from videotrain.memory.sbp.kept_rows import BatchNormCoefficients, KeptRowsBatchNorm

BN_POLICIES = ("full_batch", "frozen")


class ScaleGrad(torch.autograd.Function):
    """Identity in the forward pass; multiplies the incoming gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class FullBatchNorm:
    """Owns the record/apply phases of the BN layers it patched (``bn_policy=full_batch``).

    ``patch`` replaces ``forward`` on each BN *instance* (the class, parameters and
    ``state_dict`` keys are unchanged, so e2e and SBP checkpoints are interchangeable).
    Outside a phase, or for a BN in eval mode, the patched forward is the original one.
    """

    def __init__(self) -> None:
        self.phase: str | None = None  # None | "record" | "apply"
        self.kept_rows = 0  # rows (frames) of the kept part, during "apply"
        self.coefs: BatchNormCoefficients | None = None  # the apply phase's BN backward factors
        self.stats: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}  # bn -> mean, rstd

    def patch(self, module: nn.Module) -> None:
        for bn in module.modules():
            if not isinstance(bn, _BatchNorm) or isinstance(bn.__dict__.get("forward"), PatchedBN):
                continue
            if isinstance(bn, nn.SyncBatchNorm):
                raise ValueError(
                    "memory.bn_policy=full_batch records per-process batch statistics and does "
                    "not support SyncBatchNorm; use memory.bn_policy=frozen or plain BatchNorm"
                )
            bn.forward = PatchedBN(self, bn)

    @contextmanager
    def record(self) -> Iterator[None]:
        """Training-mode BN layers record their full-batch statistics (call under no_grad)."""
        if self.phase is not None:
            raise RuntimeError(f"nested SBP BatchNorm phases ({self.phase!r} -> 'record')")
        self.phase = "record"
        try:
            yield
        finally:
            self.phase = None

    @contextmanager
    def apply(self, kept_rows: int, total_rows: int) -> Iterator[None]:
        """Training-mode BN layers normalize ``kept_rows`` of ``total_rows`` rows with the
        recorded statistics."""
        if self.phase is not None:
            raise RuntimeError(f"nested SBP BatchNorm phases ({self.phase!r} -> 'apply')")
        self.phase, self.kept_rows = "apply", kept_rows
        self.coefs = BatchNormCoefficients(kept_rows, total_rows)
        try:
            yield
        finally:
            self.phase = None

    def clear(self) -> None:
        self.stats, self.coefs = {}, None  # a fresh dict: replay snapshots keep theirs

    def snapshot(self) -> Callable[[], Any]:
        """The current phase and statistics, as a factory of a context that restores them
        (``recompute.replay_on_recompute``: a recomputed kept-frame path recomputes in
        backward, after the forward's phase has ended)."""
        state = (self.phase, dict(self.stats), self.kept_rows, self.coefs)

        @contextmanager
        def replay() -> Iterator[None]:
            before = (self.phase, self.stats, self.kept_rows, self.coefs)
            self.phase, self.stats, self.kept_rows, self.coefs = state[0], dict(state[1]), state[2], state[3]
            try:
                yield
            finally:
                self.phase, self.stats, self.kept_rows, self.coefs = before

        return replay

    def forward(self, bn: _BatchNorm, orig: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.phase is None or not bn.training:
            return orig(x)
        if self.phase == "record":
            if bn in self.stats:
                raise RuntimeError(
                    f"{type(bn).__name__} ran twice in one forward; bn_policy=full_batch needs "
                    "each BN layer called once per frame batch (use bn_policy=frozen)"
                )
            out, mean, rstd = _train_bn_with_stats(bn, orig, x)  # e2e's BN forward, running stats once
            self.stats[bn] = (mean, rstd)
            return out
        if bn not in self.stats:
            raise RuntimeError(f"no recorded full-batch statistics for {type(bn).__name__}")
        if x.shape[0] != self.kept_rows:
            raise RuntimeError(f"SBP record/apply: {type(bn).__name__} got {x.shape[0]} rows, not "
                               f"the step's {self.kept_rows} kept frames")
        assert self.coefs is not None
        mean, rstd = self.stats[bn]
        return KeptRowsBatchNorm.apply(x, bn.weight, bn.bias, None, mean, rstd, self.coefs, bn.eps)


def _train_bn_with_stats(
    bn: _BatchNorm, orig: Callable[..., torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BN's training forward over all rows, and the batch ``(mean, rstd)`` it normalized
    with, fp32 ``(C,)`` (fp64 for a float64 model: :func:`stats_dtype`).

    For the stock classes (whose forward is ``_BatchNorm.forward``) this is
    :func:`train_bn_forward`: the same output and running statistics, bit for bit (tested), and
    the statistics come with it. A subclass with a forward of its own runs that forward, and
    the statistics are computed beside it."""
    acc = stats_dtype(x)
    if getattr(orig, "__func__", None) is not _BatchNorm.forward:
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x.detach().to(acc), dim=dims, correction=0)  # (C,), (C,)
        return orig(x), mean, torch.rsqrt(var + bn.eps)
    out, mean, rstd = train_bn_forward(bn, x)
    return out, mean.to(acc), rstd.to(acc)


def train_bn_forward(bn: _BatchNorm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_BatchNorm.forward`` in training mode, as ``(out, mean, rstd)``: the kernel
    ``F.batch_norm`` runs (``aten._native_batch_norm_legit``) with the layer's running-statistics
    bookkeeping, so output, running statistics and ``num_batches_tracked`` are the layer's own,
    bit for bit, and the batch statistics come with them."""
    bn._check_input_dim(x)
    buffers = bn._buffers  # read once: a module attribute is a Python call per read
    tracked = buffers.get("num_batches_tracked")
    running_mean, running_var = buffers.get("running_mean"), buffers.get("running_var")
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.track_running_stats and tracked is not None:
        tracked.add_(1)
        if bn.momentum is None:  # cumulative moving average
            factor = 1.0 / float(tracked)
    if running_mean is not None and running_var is not None:
        return torch._native_batch_norm_legit(
            x, bn.weight, bn.bias, running_mean, running_var, True, factor, bn.eps)
    return torch._native_batch_norm_legit(  # track_running_stats=False: the no_stats overload
        x, bn.weight, bn.bias, True, factor, bn.eps)


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of recorded BN statistics and of the BN backward's arithmetic: fp32 for
    fp16/bf16/fp32 inputs (autocast), fp64 for a float64 model, whose BN weights are fp64 and
    whose backward kernel refuses fp32 statistics."""
    return torch.promote_types(x.dtype, torch.float32)


class PatchedBN:
    """Replaces ``forward`` on one BN instance; a plain object so the model still pickles.

    An instance-level ``forward`` set by someone else before us is kept and called through.
    """

    def __init__(self, owner: FullBatchNorm, bn: _BatchNorm) -> None:
        self.owner, self.bn = owner, bn
        self.orig = bn.__dict__.get("forward")  # None: the class's forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.owner.phase is not None and self.bn.training and torch.compiler.is_compiling():
            # trainer.compile: the phase writes the statistics and reads them back as Python
            # state, and its kept rows' backward is an autograd.Function
            return outside_compiler(self, x)
        if self.orig is None and self.owner.phase is None:
            return type(self.bn).forward(self.bn, x)  # no bound method made: the compiler traces it
        orig = self.orig or MethodType(type(self.bn).forward, self.bn)
        return self.owner.forward(self.bn, orig, x)


def is_patched_bn(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), PatchedBN)


def has_train_batchnorm(modules: Iterator[nn.Module] | list[nn.Module]) -> bool:
    return any(isinstance(m, _BatchNorm) and m.training for m in modules)


@contextmanager
def frozen_batchnorm(module: nn.Module) -> Iterator[None]:
    """``bn_policy=frozen``: BN layers in eval mode (running stats used, never updated)."""
    bns = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training]
    for m in bns:
        m.train(False)
    try:
        yield
    finally:
        for m in bns:
            m.train(True)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a fresh copy when it is a view. A view made under ``no_grad`` may not
    be written in place with grad on, and a view such as ViT's class token ``tokens[:, 0]``
    would keep its whole base alive."""
    if t._is_view() or t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.preserve_format)
    return t


def split_forward(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    keep_rows: torch.Tensor,
    drop_rows: torch.Tensor,
    norm: FullBatchNorm,
    needs_stats: bool,
    chunk: int | None,
    scale: float | None = None,
    kept_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``fn(x)`` for all rows of ``x (N, ...)``, with autograd only through ``keep_rows``.

    ``needs_stats``: ``fn`` contains training-mode BN patched by ``norm`` (record/apply, see
    the module docstring); otherwise dropped rows run under ``no_grad`` in ``chunk``-row
    pieces (``None``: one piece). ``scale`` multiplies the kept rows' gradient (``grad_scale=inverse_keep``).
    ``kept_fn`` (default ``fn``) computes the kept rows: the same function, recomputed when
    SBP composes with recomputation; its recomputes re-enter the apply phase.
    Returns ``(N, ...)``; dropped rows carry no graph, kept rows the graph of one pass.
    """
    out: torch.Tensor | None = None
    if needs_stats:
        try:
            with torch.no_grad(), norm.record():
                out = _compact(fn(x))  # (N, ...): e2e's forward; dropped rows are final
            with norm.apply(keep_rows.numel(), x.shape[0]), replay_on_recompute(norm.snapshot):
                kept = (kept_fn or fn)(x[keep_rows])  # (n, ...) with autograd
        finally:
            norm.clear()
    else:
        with torch.no_grad():  # dropped rows first: nothing is stored yet, transient only
            for rows in drop_rows.split(chunk or max(1, drop_rows.numel())):
                y = fn(x[rows])  # (chunk, ...); indexing keeps the memory format
                if out is None:
                    out = torch.empty((x.shape[0], *y.shape[1:]), dtype=y.dtype, device=y.device,
                                      memory_format=suggest_memory_format(y))
                out.index_copy_(0, rows, y)
        kept = (kept_fn or fn)(x[keep_rows])  # (n, ...) with autograd
    return merge_rows(kept, out, keep_rows, scale)


def merge_rows(
    kept: torch.Tensor, out: torch.Tensor | None, keep_rows: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """The kept rows ``(n, ...)`` written into ``out (N, ...)``, which holds the dropped rows
    and no graph; the result's graph holds only the kept rows. ``scale`` multiplies the kept
    rows' gradient. ``out=None``: nothing was dropped, the result is ``kept``."""
    if scale is not None and scale != 1.0:
        kept = ScaleGrad.apply(kept, scale)
    if out is None:
        return kept
    return out.index_copy_(0, keep_rows, kept.to(out.dtype))  # in place, into a graph-free tensor
