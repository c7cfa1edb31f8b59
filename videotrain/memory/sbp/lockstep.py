"""Frame-granularity SBP in one forward: the backbone's code with kept and dropped twins.

The backbone is traced with ``torch.fx`` once (per backbone object), made out of place, and
rewritten into a new ``GraphModule`` (:func:`lockstep_graph`) whose forward takes the frames
and the step's rows, gathers the kept frames ``(n, ...)`` and the dropped frames
``(N - n, ...)`` as two contiguous row blocks and returns both parts' features. Every per-frame
op becomes two ops, one per part: the dropped part's ops run under ``no_grad`` (their
activations are never stored), the kept part's with autograd. Per segment between two
*meeting points*, the dropped twins run in one ``no_grad`` region, where a ReLU or residual
add whose input nothing else reads runs in place (as e2e's own ``inplace=True`` ops do;
``_in_place_twin``), before the kept twins, or after them in a segment that starts at a BN
meet (``flush``). Nothing is interpreted per step: the generated code is plain Python that fx
compiled once, and the row bookkeeping of a step is a few index tensors (:class:`PartRows`).

Meeting points, where the two parts meet:

- **Training-mode BatchNorm** (``bn_policy=full_batch``; :func:`batchnorm_parts`): the two
  blocks are concatenated (:func:`join_rows`, one copy; the rows are already in
  ``[kept | dropped]`` order, so no gather or scatter), the layer's own training kernel
  (``_native_batch_norm_legit``) runs on all ``N`` rows: e2e's batch statistics and
  running-statistics update (once), and both parts' outputs as row blocks of its output. The
  kept block carries :class:`KeptRowsBatchNorm`'s graph, whose backward is e2e's BN backward
  with the dropped rows held constant, from ATen's own BN backward kernel (one kernel and one
  ``addcmul``; see the class). The SyncBatchNorm kernels that would do this on several parts
  (``batch_norm_stats`` and friends) have no CPU kernels (torch 2.11-2.14), so the fused
  formulation is the one that runs, and counts, the same on both devices.
- **A module with ``lockstep_parts(kept, dropped, rows)``**: TSM's temporal shift
  (``videotrain.models.temporal_shift``) reads each frame's neighbours from both parts, the
  dropped ones as constants.

What it computes: e2e's forward (BN statistics over all frames, running statistics updated
once; values equal up to rounding since the rows are reduced in another order), and the e2e
gradient with the dropped frames' activations held constant at every layer (the gradient paths
through dropped frames cut); the input gradient of a dropped frame is exactly zero.

A backbone that ``torch.fx`` cannot trace, one with a BN subclass that overrides ``forward``
or SyncBatchNorm, or a kept path that is recomputed (SBP composed with recomputation) uses
record/apply (``videotrain.memory.sbp.split``) instead; ``lockstep_graph`` returns ``None``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.node import map_arg
from torch.nn.modules.batchnorm import _BatchNorm

from videotrain.memory.recompute.graph import fx_tracer, make_out_of_place
from videotrain.memory.sbp.split import ScaleGrad, suggest_memory_format, train_bn_forward


class BatchNormCoefficients:
    """The per-channel factors of one step's kept-rows BN backwards (:class:`KeptRowsBatchNorm`),
    ``rho * w`` and ``w * rstd`` of every fused BN, computed for all of them by two ``_foreach``
    ops at the first BN backward instead of two small ops per BN."""

    def __init__(self, rho: float) -> None:
        self.rho = rho
        self.layers: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (weight, rstd) per BN
        self._coefs: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def add(self, weight: torch.Tensor | None, rstd: torch.Tensor) -> int:
        self.layers.append((weight, rstd))
        return len(self.layers) - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rho * w, w * rstd)`` of BN ``i`` (``w = 1`` without affine weights)."""
        if self._coefs is None:
            with torch.no_grad():
                affine = [(w, r) for w, r in self.layers if w is not None]
                ws, rs = [w.detach() for w, _ in affine], [r for _, r in affine]
                w_rho = iter(torch._foreach_mul(ws, self.rho) if ws else [])
                w_r = iter(torch._foreach_mul(ws, rs) if ws else [])
                self._coefs = [(next(w_rho), next(w_r)) if w is not None
                               else (r.new_full(r.shape, self.rho), r) for w, r in self.layers]
        return self._coefs[i]


class PartRows:
    """The rows of one step: which original rows (``B*T`` order) are kept and dropped, the
    ``[kept | dropped]`` order the twins run in, and its inverse; temporal neighbours on
    demand (a backbone that mixes frames)."""

    def __init__(self, keep_rows: torch.Tensor, drop_rows: torch.Tensor) -> None:
        self.keep_rows, self.drop_rows = keep_rows, drop_rows  # (n,), (N - n,)
        self.n_keep = int(keep_rows.numel())
        self.n_rows = self.n_keep + int(drop_rows.numel())
        self._neighbours: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bn = BatchNormCoefficients(self.n_keep / self.n_rows)

    def neighbours(self, num_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(next, prev)``, each ``(N,)``: for every part row, the part row of the same
        clip's next / previous frame, or ``N`` (a zero row) at the clip's end / start."""
        if num_frames not in self._neighbours:
            if self.n_rows % num_frames:
                raise ValueError(f"temporal shift: {self.n_rows} frames are not whole clips of "
                                 f"{num_frames} frames")
            order = torch.cat((self.keep_rows, self.drop_rows))  # (N,): part row -> original row
            pos = torch.empty(self.n_rows + 1, dtype=order.dtype, device=order.device)  # (N + 1,)
            pos[order] = torch.arange(self.n_rows, device=order.device)  # original row -> part row
            pos[-1] = self.n_rows  # the zero row
            frame = order % num_frames  # (N,) frame index of each part row
            last = torch.full_like(order, self.n_rows)
            nxt = torch.where(frame < num_frames - 1, order + 1, last)  # original rows, N: none
            prv = torch.where(frame > 0, order - 1, last)
            nxt, prv = pos[nxt], pos[prv]  # part rows
            self._neighbours[num_frames] = (nxt, prv)
        return self._neighbours[num_frames]


class KeptRowsBatchNorm(torch.autograd.Function):
    """The kept rows ``y`` of a full-batch BN output, with the graph of the kept input ``x``.

    ``mean``, ``rstd`` are the full batch's statistics (``N`` rows, ``rho = n / N`` of them
    kept). Backward, with ``xhat = (x - mean) * rstd``, ``g`` the output gradient and ``m_k``
    the mean over the kept rows (and positions)::

        dx = w rstd (g - rho m_k(g) - rho xhat m_k(g xhat))            (e2e's BN backward,
           = rho * bn_backward_train(g; weight w) + (1 - rho) w rstd g   dropped rows constant)

    ATen's training-mode BN backward with the saved statistics and weight ``rho * w`` gives the
    first term and, in the same kernel, the weight and bias gradients (``sum(g xhat)``,
    ``sum(g)``, independent of the weight passed); one ``addcmul_`` adds the second. The
    per-channel factors come from the step's :class:`BatchNormCoefficients`. Only ``x`` (and
    the per-channel statistics) is saved, like native BN."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                y: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                coefs: BatchNormCoefficients, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, mean, rstd)
        ctx.coefs, ctx.index = coefs, coefs.add(weight, rstd)
        ctx.eps, ctx.has_weight, ctx.has_bias = eps, weight is not None, bias is not None
        return y  # (n, C, *): returned as is (a view for autograd)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, rstd = ctx.saved_tensors
        rho = ctx.coefs.rho
        w_rho, w_rstd = ctx.coefs[ctx.index]  # (C,), (C,)
        need_w = ctx.has_weight and ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad, x, w_rho, None, None, mean, rstd, True, ctx.eps,
            [ctx.needs_input_grad[0], need_w, need_b])
        if gx is not None and rho < 1.0:
            shape = (1, -1) + (1,) * (x.dim() - 2)  # (C,) over (n, C, *)
            gx = gx.addcmul_(grad, w_rstd.view(shape), value=1.0 - rho)
        return gx, gw if need_w else None, gb if need_b else None, None, None, None, None, None


def take_rows(x: torch.Tensor, rows: PartRows, kept: bool) -> torch.Tensor:
    """The kept ``(n, ...)`` or dropped ``(N - n, ...)`` rows of ``x``, a new tensor each (the
    first layer saves the kept one; indexing keeps the memory format)."""
    return x[rows.keep_rows] if kept else x[rows.drop_rows]


def join_rows(kept: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """``[kept | dropped]`` as one ``(N, C, *)`` tensor without a graph: a BN's input. A node of
    its own in the lockstep code, so that the dropped block is freed as soon as it is joined,
    not held through the BN (at the stem, that block is the largest transient of the step)."""
    with torch.no_grad():
        return torch.cat((kept.detach(), dropped))


def batchnorm_parts(bn: _BatchNorm, kept: torch.Tensor, full: torch.Tensor, rows: PartRows,
                    view_ok: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``bn`` over ``full = join_rows(kept, dropped)``: e2e's training forward (statistics of all
    rows, running statistics once); the kept block carries :class:`KeptRowsBatchNorm`'s graph
    (from ``kept``, which it saves). ``view_ok``: every consumer of the kept output stores
    nothing of it (ReLU, add), so it may stay a view of the full output; otherwise it gets its
    own storage, so that what autograd saves holds only kept rows. A BN in eval mode normalises
    each part alone."""
    n = kept.shape[0]
    if not bn.training:
        with torch.no_grad():
            d_out = bn(full[n:])
        return bn(kept), d_out
    with torch.no_grad():
        out, mean, rstd = train_bn_forward(bn, full)  # (N, C, *) in [kept | dropped] order
    y = out[:n] if view_ok else out[:n].clone()
    if rows.n_rows != out.shape[0]:
        raise RuntimeError(f"lockstep SBP: {type(bn).__name__} got {out.shape[0]} rows, not the "
                           f"step's {rows.n_rows} frames")
    kept_out = KeptRowsBatchNorm.apply(kept, bn.weight, bn.bias, y, mean, rstd, rows.bn, bn.eps)
    return kept_out, out[n:]


def module_parts(module: nn.Module, kept: Any, dropped: Any, rows: PartRows) -> tuple[Any, Any]:
    """A module that meets both parts itself (``module.lockstep_parts``)."""
    return module.lockstep_parts(kept, dropped, rows)


_VIEW_SAFE_FUNCS = {F.relu, torch.relu, operator.add, torch.add}  # save nothing of their input


def _view_safe(node: fx.Node, root: nn.Module) -> bool:
    if not node.users:
        return False
    for user in node.users:
        if user.op == "call_function" and user.target in _VIEW_SAFE_FUNCS:
            continue
        if user.op == "call_module" and type(root.get_submodule(str(user.target))) is nn.ReLU:
            continue
        return False
    return True


def add_into(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b``, written into ``a`` when the sum has ``a``'s shape and dtype (a dropped
    part's residual add, under ``no_grad``: no new block of rows)."""
    if a.shape == torch.broadcast_shapes(a.shape, b.shape) and a.dtype == torch.result_type(a, b):
        return a.add_(b)
    return a + b


_RELU_FUNCS = {F.relu, torch.relu}
_ADD_FUNCS = {operator.add, torch.add}
# modules whose output is a new tensor that nothing else aliases
_FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, _BatchNorm, nn.ReLU)


def _in_place_twin(node: fx.Node, root: nn.Module, bn_source_ok: bool) -> Any:
    """The in-place op for ``node``'s dropped twin, or ``None``. A dropped part runs under
    ``no_grad`` and stores nothing, so a ReLU or residual add may overwrite its input, as e2e's
    own ``ReLU(inplace=True)`` and ``out += identity`` do, when that input is read by nothing
    else and is a tensor of its own (not a view of another value): one block of rows fewer in
    the step's peak (the stem's ReLU, after the BN meet, sets the peak at small keep ratios).
    A full-batch BN's dropped output shares its storage with the kept output, a view that
    autograd refuses to read once its base changed: ``bn_source_ok`` only where the kept twins
    run first."""
    if node.op == "call_module":
        is_relu = type(root.get_submodule(str(node.target))) is nn.ReLU
        is_add = False
    elif node.op == "call_function":
        is_relu = node.target in _RELU_FUNCS and set(node.kwargs) <= {"inplace"} and len(node.args) == 1
        is_add = node.target in _ADD_FUNCS and not node.kwargs and len(node.args) == 2
    else:
        return None
    if not (is_relu or is_add) or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    if len(src.users) != 1 or (is_add and src is node.args[1]):
        return None
    module = root.get_submodule(str(src.target)) if src.op == "call_module" else None
    if isinstance(module, _BatchNorm) and not bn_source_ok:
        return None
    fresh = isinstance(module, _FRESH_MODULES) or (
        src.op == "call_function" and src.target in _RELU_FUNCS | _ADD_FUNCS)
    if not fresh:
        return None
    return torch.relu_ if is_relu else add_into


def _fusable_bn(module: nn.Module) -> bool:
    return (isinstance(module, _BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
            and type(module).forward is _BatchNorm.forward)


class _Unsupported(Exception):
    pass


def lockstep_graph(backbone: nn.Module, full_batch: bool = True) -> fx.GraphModule | None:
    """``backbone``'s twin module: ``twin(frames, rows) -> (kept out, dropped out)``
    (module doc), or ``None`` when it cannot be built (untraceable backbone, a BN it cannot
    fuse). ``full_batch``: training-mode BN layers meet both parts (``bn_policy=full_batch``);
    otherwise BN runs per part like any layer (frozen BN, eval mode)."""
    try:
        tracer = fx_tracer(backbone)  # timm backbones bring their own tracer
        graph = tracer.trace(backbone)
        gm = make_out_of_place(fx.GraphModule(tracer.root, graph))
        return _twin_module(gm, full_batch)
    except Exception:  # noqa: BLE001 - any failure to trace or rewrite means "use the general path"
        return None


def _twin_module(gm: fx.GraphModule, full_batch: bool) -> fx.GraphModule:
    src = gm.graph
    if sum(n.op == "placeholder" for n in src.nodes) != 1:
        raise _Unsupported("forward(frames) only")
    g = fx.Graph()
    frames, rows = g.placeholder("frames"), g.placeholder("rows")
    # the parts are gathered here, not by the caller, so that the dropped frames' copy is freed
    # after its first op instead of living through the pass
    kept_in = g.call_function(take_rows, (frames, rows, True))
    dropped_in = g.call_function(take_rows, (frames, rows, False))
    env: dict[fx.Node, Any] = {}  # original node -> new node, or (kept node, dropped node)
    pending: list[fx.Node] = []  # per-frame nodes of the current segment, not yet emitted

    def part(value: Any, i: int) -> Any:
        return map_arg(value, lambda n: env[n][i] if isinstance(env[n], tuple) else env[n])

    def is_split(node: fx.Node) -> bool:
        return any(isinstance(env[a], tuple) for a in node.all_input_nodes)

    after_bn = False  # the current segment starts at a BN meet

    def flush() -> None:
        """Emit the segment's twins: the dropped ones under ``no_grad``, where a ReLU or add may
        run in place (``_in_place_twin``). After a BN meet the kept twins go first, since a
        kept input may be a view of the meet's output, whose dropped rows are then overwritten;
        elsewhere the dropped twins go first, so that their transient is gone before the kept
        twins store anything (a ViT's whole network is one segment)."""
        if not pending:
            return

        def kept() -> None:
            for node in pending:
                env[node] = (g.create_node(node.op, node.target, part(node.args, 0), part(node.kwargs, 0)),
                             env[node][1])

        def dropped() -> None:
            g.call_function(torch._C._set_grad_enabled, (False,))
            for node in pending:
                args = part(node.args, 1)
                op = _in_place_twin(node, gm, bn_source_ok=after_bn or not full_batch)
                twin = (g.call_function(op, args) if op is not None
                        else g.create_node(node.op, node.target, args, part(node.kwargs, 1)))
                env[node] = (env[node][0], twin)
            g.call_function(torch._C._set_grad_enabled, (True,))

        for emit in ((kept, dropped) if after_bn else (dropped, kept)):
            emit()
        pending.clear()

    def meet(fn: Any, target: str, args: tuple) -> tuple[fx.Node, fx.Node]:
        flush()
        both = g.call_function(fn, (g.get_attr(target), *args))
        return g.call_function(operator.getitem, (both, 0)), g.call_function(operator.getitem, (both, 1))

    for node in src.nodes:
        if node.op == "placeholder":
            env[node] = (kept_in, dropped_in)
        elif node.op == "output":
            flush()
            out = node.args[0]
            if not isinstance(out, fx.Node) or not isinstance(env[out], tuple):
                raise _Unsupported("the backbone must return one tensor computed from its input")
            g.output((env[out][0], env[out][1]))
        elif node.op == "get_attr" or not is_split(node):
            env[node] = g.node_copy(node, lambda n: env[n])
        else:
            module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
            if isinstance(module, _BatchNorm) and full_batch:
                if not _fusable_bn(module) or len(node.args) != 1 or node.kwargs:
                    raise _Unsupported(f"cannot fuse {type(module).__name__}")
                flush()
                x = env[node.args[0]]
                full = g.call_function(join_rows, (x[0], x[1]))  # the dropped block's last use
                env[node] = meet(batchnorm_parts, str(node.target), (x[0], full, rows, _view_safe(node, gm)))
                after_bn = True
            elif module is not None and callable(getattr(module, "lockstep_parts", None)):
                flush()
                x = env[node.args[0]]
                env[node] = meet(module_parts, str(node.target), (x[0], x[1], rows))
                after_bn = False
            else:
                pending.append(node)
                env[node] = (node, node)  # a marker: split, emitted at the next flush
    return fx.GraphModule(gm, g, "SBPLockstep")


def lockstep_forward(twin: fx.GraphModule, x: torch.Tensor, rows: PartRows,
                     scale: float | None = None) -> torch.Tensor:
    """``backbone(x)`` for all rows of ``x (N, ...)`` in one pass of ``twin``
    (``lockstep_graph(backbone)``), with autograd only through ``rows.keep_rows``; ``scale``
    multiplies the kept rows' gradient. Returns ``(N, ...)`` in ``x``'s row order."""
    with torch.enable_grad():  # restores grad mode if the dropped part fails under no_grad
        kept, dropped = twin(x, rows)  # (n, ...), (N - n, ...)
    if not isinstance(kept, torch.Tensor):
        raise TypeError(f"lockstep SBP: the backbone returned {type(kept).__name__}, not a tensor")
    if scale is not None and scale != 1.0:
        kept = ScaleGrad.apply(kept, scale)
    out = torch.empty((rows.n_rows, *kept.shape[1:]), dtype=kept.dtype, device=kept.device,
                      memory_format=suggest_memory_format(kept))  # (N, ...), no graph
    out[rows.drop_rows] = dropped.to(kept.dtype)
    out[rows.keep_rows] = kept  # the result's graph holds the kept rows only
    return out
