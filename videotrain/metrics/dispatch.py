"""How many aten ops a step dispatches, and the bytes they move: the CPU's estimate of a GPU
step's kernel launches and memory traffic.

On a GPU every aten op that computes is a kernel launch, and a step that launches several
thousand of them waits on the host; where it does not, BN and elementwise work are bound by the
bytes they read and write, not by FLOPs. Both figures are the same on CPU and GPU for the same
code (and on fake tensors, at any size), so a test on CPU can hold a strategy's launches and
bytes to a multiple of e2e's. Counted with one ``TorchDispatchMode``, below autograd, so the
backward's ops are counted too; views, metadata-only ops and bare allocations count for neither.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Ops that only make a new view or read metadata: no kernel runs for them on a GPU.
_VIEW_TAGS = (torch.Tag.view_copy,)
# Ops that only allocate (the caching allocator, no kernel); how many a step makes differs
# between torch releases (torch 2.11's checkpoint allocates two sentinels per segment, 2.14's none)
_ALLOCATIONS = frozenset({"aten.empty", "aten.empty_strided"})


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counter[str] | None, views: bool = False,
                 moved: Counter[str] | None = None) -> None:
        super().__init__()
        self.counts = counts
        self.views = views
        self.moved = moved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        out = func(*args, **kwargs)
        launches = not (_is_view(func) or name in _ALLOCATIONS)
        if self.counts is not None and (self.views or launches):
            self.counts[name] += 1
        if self.moved is not None and launches:
            self.moved[name] += _bytes_of(func, args, kwargs, out)
        return out


def _bytes_of(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> int:
    """An op's input bytes plus its output bytes: the tensors it returns or, for an op that
    returns nothing (in-place ``_foreach_*_``), the arguments it writes. An op that returns
    only non-tensors (``prim.device``, ``aten.size``) reads metadata: 0."""
    schema = func._schema
    if schema.returns:
        outs = tree_leaves(out)
        if not any(isinstance(t, torch.Tensor) for t in outs):
            return 0
    else:
        written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        by_name = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
        outs = tree_leaves([by_name.get(n) for n in written])
    return sum(map(_tensor_bytes, tree_leaves((args, kwargs)) + outs))


def _tensor_bytes(value: object) -> int:
    """The bytes of the elements ``value`` holds, if it is a tensor: a broadcast (stride-0)
    dimension counts once (its elements come from memory once, then from cache)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return 0
    elements = 1
    for size, stride in zip(value.shape, value.stride(), strict=True):
        if stride != 0:
            elements *= size
    return elements * value.element_size() if value.numel() else 0


def _is_view(func: torch._ops.OpOverload) -> bool:
    returns = func._schema.returns
    aliases_only = bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )
    return aliases_only or any(tag in func.tags for tag in _VIEW_TAGS)


@contextmanager
def aten_ops(views: bool = False) -> Iterator[Counter[str]]:
    """Count the aten ops dispatched in the body, by op name; views, metadata-only ops
    (``view``, ``t``, ``expand``, ...) and bare allocations (``empty``, ``empty_strided``) are
    left out unless ``views`` is true: what is counted is what launches a kernel on a GPU."""
    counts: Counter[str] = Counter()
    with _OpCounter(counts, views):
        yield counts


@contextmanager
def bytes_moved() -> Iterator[Counter[str]]:
    """The bytes the aten ops dispatched in the body move, by op name: each op's tensor inputs
    and outputs (an in-place op's tensor counts as read and as written), over the ops
    :func:`aten_ops` counts less those that return no tensor (``prim.device``, ``aten.size``):
    views, metadata and bare allocations move nothing.
    The sum is a step's memory traffic as a roofline prices it: every op reads its inputs from
    memory and writes its outputs, no fusion. Works on fake tensors (``FakeTensorMode``), so a
    full-size step can be measured without its memory."""
    moved: Counter[str] = Counter()
    with _OpCounter(None, moved=moved):
        yield moved
