"""How many aten ops a step dispatches: the CPU's estimate of a GPU step's kernel launches.

On a GPU every aten op that computes is a kernel launch, and a step that launches several
thousand of them waits on the host (docs/design: GPU busy 36-87% at 3,000-12,000 kernels a
step). The count is the same on CPU and GPU for the same code, so a test on CPU can hold a
strategy's launches to a multiple of e2e's. Counted with a ``TorchDispatchMode``, below
autograd, so the backward's ops are counted too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that only make a new view or read metadata: no kernel runs for them on a GPU.
_VIEW_TAGS = (torch.Tag.view_copy,)
# Ops that only allocate (the caching allocator, no kernel); how many a step makes differs
# between torch releases (torch 2.11's checkpoint allocates two sentinels per segment, 2.14's none)
_ALLOCATIONS = frozenset({"aten.empty", "aten.empty_strided"})


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counter[str], views: bool) -> None:
        super().__init__()
        self.counts = counts
        self.views = views

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = str(func.overloadpacket)
        if self.views or not (_is_view(func) or name in _ALLOCATIONS):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


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
