"""One forward for SBP with full-batch BatchNorm: kept and dropped frames in lockstep.

``split_forward``'s ``full_batch`` record/apply scheme (``videotrain.memory.sbp.split``) runs
the kept frames' convolutions twice, once without grad inside the all-frames statistics pass
and once with autograd: a forward of ``(1 + r) F`` instead of ``F``, which keeps an SBP step
from scaling with ``r``.

This module runs the backbone once. It traces the backbone's forward into a ``torch.fx`` graph
(once per backbone, at its first SBP step) and interprets it node by node, carrying every activation as a
``Split``: the kept rows (computed with autograd) and the dropped rows (computed under
``no_grad``). Every operation runs twice, on the two row sets, except training-mode BatchNorm,
where the two meet:

1. the kept and dropped rows are copied, in the original row order, into one ``(N, ...)``
   tensor, and the layer's own training forward runs on it (``FullBatchNorm``'s record phase):
   e2e's output, the batch statistics, and running statistics updated once, bit for bit;
2. the dropped rows take their rows of that output;
3. the kept rows go through ``_FullBatchStatsBN`` with the recorded statistics, which returns
   their rows of the same output and has record/apply's backward (dropped rows are constants).

So the forward values, the running statistics and the gradients are those of the
record/apply scheme (tested against it), the convolutions run once per frame, and what is
stored for backward is unchanged: the kept rows' activations only. The price is a transient at
each BN of the full input plus the full output, like the record pass's own.

Like the record/apply scheme, it assumes every operation other than BN acts on each frame
independently. A backbone that ``torch.fx`` cannot trace, or that is checkpointed (SBP composed
with recomputation), uses record/apply instead; ``lockstep_graph`` returns ``None`` for it.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch
from torch import fx, nn
from torch.fx.node import map_aggregate
from torch.nn.modules.batchnorm import _BatchNorm

from videotrain.memory.recompute.graph import fx_tracer
from videotrain.memory.sbp.split import FullBatchNorm, full_batch_stats_bn, merge_rows


class Split:
    """One activation of the lockstep pass: its kept rows and its dropped rows.

    Deliberately not a tuple: ``map_aggregate`` recurses into tuples, and an argument such as
    ``(x, y)`` must stay distinguishable from a split value."""

    __slots__ = ("kept", "dropped")

    def __init__(self, kept: Any, dropped: Any) -> None:
        self.kept, self.dropped = kept, dropped


def lockstep_graph(backbone: nn.Module) -> fx.Graph | None:
    """The backbone's forward as an fx graph, or ``None`` when it cannot be traced (data-
    dependent control flow, say); the caller then falls back to record/apply."""
    try:
        graph = fx_tracer(backbone).trace(backbone)  # timm backbones bring their own tracer
    except Exception:  # noqa: BLE001 - any tracing failure means "use the general path"
        return None
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    return graph if len(inputs) == 1 else None  # forward(frames) only


def _last_uses(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """node -> the values whose last use is that node (freed right after it runs)."""
    seen: set[fx.Node] = set()
    frees: dict[fx.Node, list[fx.Node]] = {n: [] for n in graph.nodes}
    for node in reversed(graph.nodes):
        for inp in node.all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                frees[node].append(inp)
    return frees


def _part(value: Any, which: str) -> Any:
    return map_aggregate(value, lambda v: getattr(v, which) if isinstance(v, Split) else v)


def _has_split(value: Any) -> bool:
    found = []
    map_aggregate(value, lambda v: found.append(v) if isinstance(v, Split) else v)
    return bool(found)


def _like(t: torch.Tensor, rows: int) -> torch.Tensor:
    """An empty ``(rows, *t.shape[1:])`` tensor in ``t``'s dtype, device and memory format."""
    fmt = torch.contiguous_format
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        fmt = torch.channels_last
    return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device, memory_format=fmt)


def lockstep_forward(
    graph: fx.Graph,
    root: nn.Module,
    x: torch.Tensor,
    keep_rows: torch.Tensor,
    drop_rows: torch.Tensor,
    norm: FullBatchNorm,
    scale: float | None = None,
) -> torch.Tensor:
    """``root(x)`` for all rows of ``x (N, ...)`` in one pass, with autograd only through
    ``keep_rows``: ``split_forward``'s contract and result. ``root``'s BN layers must be patched
    by ``norm`` (``FullBatchNorm.patch``); ``graph`` is ``lockstep_graph(root)``; ``scale``
    multiplies the kept rows' gradient."""
    n_rows = x.shape[0]
    frees = _last_uses(graph)
    env: dict[fx.Node, Any] = {}
    result: Any = None
    try:
        with norm.record():
            for node in graph.nodes:
                if node.op == "placeholder":
                    env[node] = Split(x.index_select(0, keep_rows), x.index_select(0, drop_rows))
                elif node.op == "get_attr":
                    env[node] = attrgetter(str(node.target))(root)  # a parameter or buffer
                elif node.op == "output":
                    result = map_aggregate(node.args[0], lambda n: env[n] if isinstance(n, fx.Node) else n)
                else:
                    env[node] = _run(node, root, env, n_rows, keep_rows, drop_rows, norm, frees)
                for dead in frees[node]:
                    env.pop(dead, None)
    finally:
        norm.clear()
    if not isinstance(result, Split) or not isinstance(result.kept, torch.Tensor):
        raise TypeError(f"lockstep SBP: the backbone returned {type(result).__name__}, not a tensor")
    dropped = result.dropped  # (N - n, ...)
    out = dropped.new_empty((n_rows, *dropped.shape[1:]))  # (N, ...), no graph
    out.index_copy_(0, drop_rows, dropped)
    return merge_rows(result.kept, out, keep_rows, scale)


def _run(
    node: fx.Node, root: nn.Module, env: dict[fx.Node, Any], n_rows: int,
    keep_rows: torch.Tensor, drop_rows: torch.Tensor, norm: FullBatchNorm,
    frees: dict[fx.Node, list[fx.Node]],
) -> Any:
    args = map_aggregate(node.args, lambda n: env[n] if isinstance(n, fx.Node) else n)
    kwargs = map_aggregate(node.kwargs, lambda n: env[n] if isinstance(n, fx.Node) else n)
    if node.op == "call_module":
        fn: Any = root.get_submodule(str(node.target))
        if isinstance(fn, _BatchNorm) and fn.training and len(args) == 1 and isinstance(args[0], Split):
            # the input's last use is this BN (the usual case): its dropped rows can go as soon
            # as they are copied into the full batch
            owned = node.args[0] in frees[node]
            return _batchnorm(fn, args[0], n_rows, keep_rows, drop_rows, norm, owned)
    elif node.op == "call_method":
        def fn(obj: Any, *a: Any, **k: Any) -> Any:
            return getattr(obj, str(node.target))(*a, **k)
    else:  # call_function
        fn = node.target
    if not (_has_split(args) or _has_split(kwargs)):
        return fn(*args, **kwargs)
    kept = fn(*_part(args, "kept"), **_part(kwargs, "kept"))  # with autograd
    with torch.no_grad():
        dropped = fn(*_part(args, "dropped"), **_part(kwargs, "dropped"))
    return Split(kept, dropped)


def _batchnorm(
    bn: _BatchNorm, value: Split, n_rows: int, keep_rows: torch.Tensor, drop_rows: torch.Tensor,
    norm: FullBatchNorm, owned: bool,
) -> Split:
    """BN over all ``n_rows`` rows: e2e's output and statistics (running stats once); the kept
    rows carry ``_FullBatchStatsBN``'s graph."""
    kept = value.kept  # (n, C, *) with autograd
    with torch.no_grad():
        full = _like(kept, n_rows)  # (N, C, *) in the original row order
        full.index_copy_(0, keep_rows, kept.detach())
        full.index_copy_(0, drop_rows, value.dropped.to(full.dtype))
        if owned:
            value.dropped = None  # its only reference: freed now, before BN allocates its output
        out = bn(full)  # patched: the layer's own training forward, statistics recorded
        del full
        kept_out = out.index_select(0, keep_rows)  # (n, C, *)
        dropped_out = out.index_select(0, drop_rows)  # (N - n, C, *)
        del out
    mean, var = norm.stats[bn]
    return Split(full_batch_stats_bn(bn, kept, mean, var, n_rows, kept_out), dropped_out)
