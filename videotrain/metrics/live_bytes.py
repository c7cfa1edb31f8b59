"""Live tensor bytes without a device: count the storages that ops create, and their peak.

Run a training step on fake tensors (``torch._subclasses.FakeTensorMode``: shapes, dtypes and
autograd, but no data) under :class:`LiveStorageBytes` and it reports the bytes of storage
alive at every moment, as a caching allocator's ``memory_allocated`` would, and their peak
(``max_memory_allocated``). Nothing is allocated, so a Kinetics-size step can be counted on a
laptop. What it cannot see: kernels' internal workspaces (cuDNN, cuBLAS, oneDNN), allocator
rounding and fragmentation, and the CUDA context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorageBytes(TorchDispatchMode):
    """Storages created under the mode (and any ``track``-ed before it), weakly referenced:
    ``now()`` is the bytes of those still alive, ``peak`` the most seen after any op since
    the last ``reset_peak()``. A view shares its base's storage and is not counted again."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._bound = 0  # >= the live bytes: what the last scan found, plus what came since
        self.peak = 0
        self.counting = True

    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            known = self._live.get(ref.cdata)
            if known is None or known[0].expired():
                self._live[ref.cdata] = (ref, storage.nbytes())
                self._bound += storage.nbytes()

    def now(self) -> int:
        """Bytes of the counted storages still alive (dead ones are forgotten)."""
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            del self._live[k]
        self._bound = sum(nbytes for _, nbytes in self._live.values())
        return self._bound

    def reset_peak(self) -> None:
        self.peak = self.now()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ops in the body run, but what they create is not counted (the storages already
        counted still are, until they die)."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.counting:
            return out
        self.track(*(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))
        # storages only die between scans, so the bound is an upper bound of the live bytes:
        # the peak can have moved only if the bound passed it (then scan, exactly)
        if self._bound > self.peak:
            self.peak = max(self.peak, self.now())
        return out
