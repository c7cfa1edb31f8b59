"""The recompute primitive shared by every checkpoint policy: a non-reentrant
``torch.utils.checkpoint`` call that does not update BatchNorm running statistics twice.

Why this exists: non-reentrant checkpoint recomputes the wrapped function in backward with the
module in the same (train) mode, so every BatchNorm inside it would run its training forward a
second time and move ``running_mean``/``running_var``/``num_batches_tracked`` again. e2e updates
them once per step; so must we.

How: every checkpointed call gets its own closure that counts its invocations. The first call
is the real forward. Any later call is a recompute (torch.utils.checkpoint calls the function
again, possibly stopping early with an internal exception), and it runs with the BN layers'
running-stat buffers swapped for throw-away clones, restored in ``finally``. Swapping (rather
than saving values and copying them back) matters: the recomputed ``batch_norm`` op saves the
running buffers for its backward, and an in-place copy back would bump their version counter
and fail the backward's version check. In train mode BN normalizes with the batch statistics,
so the clones never change the recomputed values. RNG (dropout) and autocast state are
replayed by torch.utils.checkpoint itself (``preserve_rng_state=True``).

Other forward-time state must be replayed too when a strategy composes with recomputation: SBP
normalizes its kept frames with recorded full-batch BN statistics (or freezes BN) only while
its forward runs, and a recompute in backward happens after that. Such a strategy registers a
provider with :func:`replay_on_recompute` around its forward; every checkpointed call made
meanwhile snapshots the state then and re-enters it around its recompute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def batchnorms(module: nn.Module) -> list[_BatchNorm]:
    """BN layers in ``module`` that track running statistics (the ones recompute could corrupt)."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


@contextmanager
def isolated_bn_stats(bns: list[_BatchNorm]) -> Iterator[None]:
    """Run the body with each BN's running-stat buffers replaced by clones; put originals back."""
    saved: list[tuple[_BatchNorm, str, torch.Tensor]] = []
    try:
        for bn in bns:
            for name in _STAT_BUFFERS:
                buf = getattr(bn, name, None)
                if isinstance(buf, torch.Tensor):
                    saved.append((bn, name, buf))
                    setattr(bn, name, buf.clone())
        yield
    finally:
        for bn, name, buf in saved:
            setattr(bn, name, buf)


# A provider is called at forward time and returns a factory of the context to re-enter on
# recompute (a snapshot of the state it needs).
ReplayProvider = Callable[[], Callable[[], AbstractContextManager[Any]]]
_replay_providers: list[ReplayProvider] = []


@contextmanager
def replay_on_recompute(provider: ReplayProvider) -> Iterator[None]:
    """Checkpointed calls made in the body re-enter ``provider()``'s context on recompute."""
    _replay_providers.append(provider)
    try:
        yield
    finally:
        _replay_providers.remove(provider)


def checkpoint_call(fn: Callable[..., Any], bns: list[_BatchNorm], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpoint; recomputes leave BN stats alone
    and re-enter the forward-time contexts registered with :func:`replay_on_recompute`."""
    calls = [0]
    replays = [provider() for provider in _replay_providers]  # snapshots, taken now

    def run(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1 or not (bns or replays):
            return fn(*a, **kw)
        with ExitStack() as stack:  # a recompute in backward
            for replay in replays:
                stack.enter_context(replay())
            stack.enter_context(isolated_bn_stats(bns))
            return fn(*a, **kw)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


class CheckpointedForward:
    """Replaces ``module.forward`` (instance attribute): checkpointed in training with grad on,
    the original forward otherwise (eval and ``no_grad`` are untouched)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.original = module.forward
        self.bns = batchnorms(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training and torch.is_grad_enabled():
            return checkpoint_call(self.original, self.bns, *args, **kwargs)
        return self.original(*args, **kwargs)


def wrap_forward(module: nn.Module) -> nn.Module:
    """Checkpoint ``module``'s forward in training, once (idempotent)."""
    if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
        module.forward = CheckpointedForward(module)  # type: ignore[method-assign]
    return module


def is_wrapped(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


class CheckpointedSegment(nn.Module):
    """A segment of a split fx graph, run under :func:`checkpoint_call` when grad is on.

    The split graph is private to the strategy and only runs from ``encode`` (training), so
    the segment's own ``training`` flag (which does not follow ``backbone.train()``) is ignored.
    """

    def __init__(self, segment: nn.Module) -> None:
        super().__init__()
        self.segment = segment
        self.bns = batchnorms(segment)

    def forward(self, *args: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint_call(self.segment, self.bns, *args)
        return self.segment(*args)
