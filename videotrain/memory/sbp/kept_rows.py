"""Autograd for the kept rows of an op that ran once over all rows (SBP).

The lockstep code runs a convolution that feeds a full-batch BN, the BN itself, and a residual
add with its ReLU once over all ``N`` rows (``[kept | dropped]`` order, no graph), as e2e's
forward does. Each function here takes the kept rows' inputs (with their graphs) and the
computed output, saves what the op's backward needs as ``n``-row tensors of their own (the
point of SBP), and in the backward runs ATen's kernel for the op on the kept rows: e2e's
gradient with the dropped rows held constant. :class:`KeptRowsBatchNorm` is record/apply's BN
backward too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class BatchNormCoefficients:
    """One step's kept-rows BN backwards (:class:`KeptRowsBatchNorm`): ``kept`` of ``total`` rows
    kept (``rho = kept / total``). On CPU, the per-channel factors ``rho * w`` and ``w * rstd``
    of every BN, computed for all of them by two ``_foreach`` ops at the first BN backward
    instead of two small ops per BN (and for the BNs added since, when a recomputed segment runs
    its BNs again in backward); on CUDA, the full batch's element counts the fused kernels take,
    one small tensor per count."""

    def __init__(self, kept: int, total: int) -> None:
        self.kept, self.total = kept, total
        self.rho = kept / total
        self.layers: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (weight, rstd) per BN
        self._coefs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._counts: dict[tuple[int, torch.device], torch.Tensor] = {}

    def add(self, weight: torch.Tensor | None, rstd: torch.Tensor) -> int:
        self.layers.append((weight, rstd))
        return len(self.layers) - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rho * w, w * rstd)`` of BN ``i`` (``w = 1`` without affine weights)."""
        if i >= len(self._coefs):
            grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)  # a backward's constants (no detach op per weight)
            try:
                layers = self.layers[len(self._coefs):]
                affine = [(w, r) for w, r in layers if w is not None]
                ws, rs = [w for w, _ in affine], [r for _, r in affine]
                w_rho = iter(torch._foreach_mul(ws, self.rho) if ws else [])
                w_r = iter(torch._foreach_mul(ws, rs) if ws else [])
                self._coefs += [(next(w_rho), next(w_r)) if w is not None
                                else (r.new_full(r.shape, self.rho), r) for w, r in layers]
            finally:
                torch._C._set_grad_enabled(grad)
        return self._coefs[i]

    def count(self, x: torch.Tensor) -> torch.Tensor:
        """``(1,)`` int32: the elements per channel of the full batch whose kept rows are
        ``x (kept, C, *)``, as ``batch_norm_backward_elemt`` takes them."""
        per_row = x.numel() // max(1, x.shape[0] * x.shape[1])
        key = (per_row, x.device)
        if key not in self._counts:
            self._counts[key] = torch.full((1,), per_row * self.total, dtype=torch.int32,
                                           device=x.device)
        return self._counts[key]


class KeptRowsBatchNorm(torch.autograd.Function):
    """The kept rows ``full[:n]`` of a full-batch BN output ``full``, with the graph of the
    kept input ``x (n, C, *)``: a view (``view_ok``) or rows of their own; ``full=None``:
    computed here from the statistics (record/apply's apply phase). ``mean``, ``rstd`` are the
    full batch's statistics (``N`` rows, ``rho = n / N`` of them kept).

    The backward is e2e's BN backward with the dropped rows held constant: SyncBatchNorm's two
    kernels on CUDA (:func:`fused_bn_backward`), ATen's training-mode BN backward with weight
    ``rho * w`` plus one ``addcmul_`` elsewhere (:func:`split_bn_backward`); the two forms are
    tested against each other, and derived in docs/memory.md#lockstep-or-recordapply. Only ``x``
    (and the per-channel statistics) is saved, like native BN.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                full: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
                coefs: BatchNormCoefficients, eps: float, view_ok: bool = True) -> torch.Tensor:
        ctx.save_for_backward(x, mean, rstd)
        ctx.coefs, ctx.index = coefs, coefs.add(weight, rstd)
        ctx.eps, ctx.has_weight, ctx.has_bias = eps, weight is not None, bias is not None
        if full is None:  # record/apply: normalize the kept rows with the recorded statistics
            var = rstd.pow(-2).sub_(eps).clamp_(min=0.0)  # (C,): rstd = 1 / sqrt(var + eps)
            return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)  # (n, C, *)
        y = full[: x.shape[0]]  # (n, C, *): the full-batch forward's kept rows
        return y if view_ok else y.clone(memory_format=torch.preserve_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.has_weight and ctx.needs_input_grad[1],
                ctx.has_bias and ctx.needs_input_grad[2]]
        bn_backward = fused_bn_backward if grad.is_cuda else split_bn_backward
        gx, gw, gb = bn_backward(grad, x, mean, rstd, ctx.coefs, ctx.index, ctx.eps, mask)
        return gx, gw if mask[1] else None, gb if mask[2] else None, None, None, None, None, None, None


BNGrads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def fused_bn_backward(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                      coefs: BatchNormCoefficients, index: int, eps: float, mask: list[bool]) -> BNGrads:
    """:class:`KeptRowsBatchNorm`'s backward in SyncBatchNorm's kernels (CUDA): the kept rows'
    sums, then the elementwise pass normalised by the full batch's count."""
    weight = coefs.layers[index][0]  # a constant here: the backward runs without grad mode
    if weight is not None and weight.dtype != mean.dtype:
        weight = weight.to(mean.dtype)  # as SyncBatchNorm
    sum_dy, sum_dy_xmu, gw, gb = torch.batch_norm_backward_reduce(
        grad, x, mean, rstd, weight, mask[0], mask[1], mask[2])
    gx = None
    if mask[0]:
        gx = torch.batch_norm_backward_elemt(grad, x, mean, rstd, weight, sum_dy, sum_dy_xmu,
                                             coefs.count(x))
    return gx, gw, gb


def split_bn_backward(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                      coefs: BatchNormCoefficients, index: int, eps: float, mask: list[bool]) -> BNGrads:
    """:class:`KeptRowsBatchNorm`'s backward in kernels every device has: the training-mode BN
    backward with weight ``rho * w``, plus ``(1 - rho) w rstd g``."""
    w_rho, w_rstd = coefs[index]  # (C,), (C,)
    gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
        grad, x, w_rho, None, None, mean, rstd, True, eps, mask)
    if gx is not None and coefs.rho < 1.0:
        shape = (1, -1) + (1,) * (x.dim() - 2)  # (C,) over (n, C, *)
        gx = gx.addcmul_(grad, w_rstd.view(shape), value=1.0 - coefs.rho)
    return gx, gw, gb


def plain_conv(module: nn.Module) -> bool:
    """A stock ``nn.Conv2d`` (its own ``forward``) with zero padding given as numbers: what
    :class:`KeptRowsConv`'s backward reproduces."""
    return (isinstance(module, nn.Conv2d) and type(module).forward is nn.Conv2d.forward
            and module.padding_mode == "zeros" and not isinstance(module.padding, str))


class KeptRowsConv(torch.autograd.Function):
    """The kept rows ``(n, C', H', W')`` of ``full``, ``conv`` over all rows, as rows of their
    own with the graph of the kept input ``x (n, C, H, W)``: the convolution's backward on the kept rows
    (``aten.convolution_backward``, the kernel e2e's backward runs). ``x`` is saved in the
    dtype the convolution ran in (an autocast cast, as autocast saves its cast input); the
    weight is cast in the backward, and its gradient goes back to the parameter's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                full: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
        ctx.save_for_backward(x if x.dtype == full.dtype else x.to(full.dtype), weight)
        ctx.conv, ctx.has_bias = conv, bias is not None
        return full[: x.shape[0]].clone(memory_format=torch.preserve_format)  # (n, C', H', W')

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        conv = ctx.conv
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], need_b]
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad, x, weight.to(grad.dtype), [weight.shape[0]] if need_b else None,
            list(conv.stride), list(conv.padding), list(conv.dilation), False, [0, 0],
            conv.groups, mask)
        return gx, gw, gb if need_b else None, None, None


class KeptRowsAddReLU(torch.autograd.Function):
    """``relu(a + b)``, the residual add and ReLU that end a ResNet block, on all rows: the
    full sum ``s (N, ...)`` (``s + add`` when ``add`` is given) is made ReLU'd in place, and its
    kept rows ``(n, ...)`` are returned as a tensor of their own that the backward saves, with
    the graphs of the kept inputs ``a``, ``b``. The in-place ops run inside the function, after
    autograd has taken the kept inputs' graphs: ``a`` may be a view of ``s`` (a BN's kept
    output), which autograd refuses to read once its base changed."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, s: torch.Tensor,
                add: torch.Tensor | None) -> torch.Tensor:
        if add is not None:
            s.add_(add)
        s.relu_()  # (N, ...)
        kept = s[: a.shape[0]].clone(memory_format=torch.preserve_format)  # (n, ...)
        ctx.save_for_backward(kept)
        ctx.shapes = (a.shape, b.shape)
        return kept

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (kept,) = ctx.saved_tensors
        g = torch.ops.aten.threshold_backward(grad, kept, 0)
        ga, gb = (g if g.shape == shape else g.sum_to_size(shape) for shape in ctx.shapes)
        return ga, gb, None, None


def sums_into(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a + b`` has ``a``'s shape and dtype, so it may be written into ``a``."""
    if a.dtype != b.dtype and a.dtype != torch.result_type(a, b):
        return False
    return a.shape == b.shape or a.shape == torch.broadcast_shapes(a.shape, b.shape)


def add_into(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b``, written into ``a`` where :func:`sums_into` (a dropped part's residual add,
    under ``no_grad``: no new block of rows)."""
    return a.add_(b) if sums_into(a, b) else a + b


def add_relu_parts(a: torch.Tensor, b: torch.Tensor, full_a: torch.Tensor, full_b: torch.Tensor,
                   in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept, full)`` of ``relu(a + b)`` (:class:`KeptRowsAddReLU`); ``in_place``: nothing
    else reads ``full_a``, so the sum is written into it, as e2e's ``out += identity`` does."""
    if in_place and sums_into(full_a, full_b):
        return KeptRowsAddReLU.apply(a, b, full_a, full_b), full_a
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        s = full_a + full_b  # (N, ...)
    finally:
        torch._C._set_grad_enabled(grad)
    return KeptRowsAddReLU.apply(a, b, s, None), s


def conv_parts(conv: nn.Conv2d, kept: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept, full)`` of ``conv`` over ``full (N, C, H, W)`` in ``[kept | dropped]`` order,
    run once (its module hooks fire once, on all rows), without a graph; the kept rows get
    :class:`KeptRowsConv`'s graph from ``kept (n, C, H, W)`` and storage of their own, which
    the BN after the convolution saves.

    Under autocast the weight is cast for this call alone (the cast cache off here): the kept
    rows' backward casts it again, so a cached copy would only be held to the end of the forward.
    Grad mode and the cache are switched by torch's C functions: a meet runs once per layer."""
    grad, cache = torch.is_grad_enabled(), torch.is_autocast_cache_enabled()
    torch._C._set_grad_enabled(False)
    torch.set_autocast_cache_enabled(False)
    try:
        out = conv(full)  # (N, C', H', W')
    finally:
        torch.set_autocast_cache_enabled(cache)
        torch._C._set_grad_enabled(grad)
    return KeptRowsConv.apply(kept, conv.weight, conv.bias, out, conv), out
