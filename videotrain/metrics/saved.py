"""What a forward keeps for backward, counted exactly: the saved-activation counter.

Peak memory depends on the device and its allocator; the bytes a training forward *stores*
do not. They are what a memory strategy controls, so tests and benchmarks compare strategies
by them. Two sources are counted:

- the tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``);
- inputs held outside autograd until a recompute: a checkpointed segment keeps its inputs in
  a holder, not as saved tensors (``videotrain.memory.recompute.execute``). Such holders
  report themselves through :func:`note_held`, and :func:`collect_held` lists what they
  still hold.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn


class Holder(Protocol):
    """Something that keeps tensors alive outside autograd until it lets them go."""

    def held_tensors(self) -> list[torch.Tensor]: ...


_watchers: list[list[weakref.ref]] = []


def note_held(holder: Holder) -> None:
    """Report a new holder to every :func:`collect_held` now watching (weakly referenced)."""
    for watcher in _watchers:
        watcher.append(weakref.ref(holder))


@contextmanager
def collect_held() -> Iterator[Callable[[], list[torch.Tensor]]]:
    """In the body, holders are noted; the yielded function lists the tensors they still hold
    (what a forward run there keeps beyond its saved tensors)."""
    seen: list[weakref.ref] = []
    _watchers.append(seen)

    def held() -> list[torch.Tensor]:
        return [t for h in (ref() for ref in seen) if h is not None for t in h.held_tensors()]

    try:
        yield held
    finally:
        _watchers.remove(seen)


@contextmanager
def saved_bytes(*exclude: torch.Tensor) -> Iterator[Callable[[], int]]:
    """Count what a forward run in the body keeps for backward: the unique storages autograd
    saves plus the inputs holders keep for a recompute. Storages of ``exclude`` (parameters,
    buffers, the inputs: they exist anyway) are not counted, nor are views counted twice. The
    yielded function gives the bytes so far; every counted tensor is held until the body ends,
    so a freed storage's address cannot be reused and confused with another."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    held: list[torch.Tensor] = []
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. sparse or wrapper tensors
            return t
        ptr = storage.data_ptr()
        if ptr and ptr not in skip:
            held.append(t)
            sizes[ptr] = max(sizes.get(ptr, 0), storage.nbytes())
        return t

    def total() -> int:
        for t in held_inputs():  # checkpoint boundaries, held outside autograd until recompute
            pack(t)
        return sum(sizes.values())

    with collect_held() as held_inputs, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        try:
            yield total
        finally:
            held.clear()


def saved_activation_bytes(model: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes one forward of ``model`` keeps for backward (see :func:`saved_bytes`).
    Deterministic, so good for tests; 0 under ``no_grad``. Run it in training mode to see what
    a training step keeps."""
    with saved_bytes(*model.parameters(), *model.buffers(), *inputs) as total:
        out = model(*inputs)
        nbytes = total()
        del out
    return nbytes
