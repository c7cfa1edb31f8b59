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

from videotrain.metrics.saved import note_held

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


class _Held:
    """A checkpointed call's inputs, from its forward until its recompute. Reported to the
    saved-activation counter (``videotrain.metrics.saved``), since saved-tensor hooks do not
    see them."""

    __slots__ = ("__weakref__", "args", "kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args: tuple[Any, ...] | None = args
        self.kwargs: dict[str, Any] | None = kwargs
        note_held(self)

    def held_tensors(self) -> list[torch.Tensor]:
        return [] if self.args is None else _tensors(self.args, self.kwargs)


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def checkpoint_call(fn: Callable[..., Any], bns: list[_BatchNorm], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpoint; recomputes leave BN stats alone
    and re-enter the forward-time contexts registered with :func:`replay_on_recompute`.

    The inputs are let go once the recompute is done. ``torch.utils.checkpoint`` would keep
    them until the whole segment's backward is over, although the recomputed ops already hold
    whatever they save; releasing them is what lets a boundary tensor die as soon as the last
    segment that reads it has been recomputed (the planner's cost model counts on it: a stem cut
    ``conv, BN | ReLU`` frees the BN output before the stem's backward). So the inputs are passed
    through a holder, not as checkpoint arguments; a zero-size anchor on their device stays an
    argument so checkpoint still stashes and replays that device's RNG and autocast state.
    In-place changes to an input between the forward and the recompute are refused (the check
    ``torch.utils.checkpoint`` would have made on its saved inputs), and so is a second
    recompute (a second backward through the segment with ``retain_graph=True``).
    """
    calls = [0]
    replays = [provider() for provider in _replay_providers]  # snapshots, taken now
    held = _Held(args, kwargs)
    tensors = _tensors(args, kwargs)
    versions = [t._version for t in tensors]
    anchor = torch.empty(0, device=tensors[0].device if tensors else "cpu")
    del tensors

    def run(_anchor: torch.Tensor) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return fn(*held.args, **held.kwargs)
        if held.args is None:
            raise RuntimeError(
                "a checkpointed segment was recomputed twice: its inputs are released after the "
                "first recompute, so backward through it once per forward (no retain_graph=True)")
        a, kw = held.args, held.kwargs
        held.args = held.kwargs = None
        try:
            if [t._version for t in _tensors(a, kw)] != versions:
                raise RuntimeError(
                    "an input of a checkpointed segment was modified in place after the forward; "
                    "its recompute would not reproduce the forward")
            if not (bns or replays):
                return fn(*a, **kw)
            with ExitStack() as stack:  # a recompute in backward
                for replay in replays:
                    stack.enter_context(replay())
                stack.enter_context(isolated_bn_stats(bns))
                return fn(*a, **kw)
        finally:
            del a, kw

    return checkpoint(run, anchor, use_reentrant=False)


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
