"""The recompute primitive shared by every recompute policy: a non-reentrant
``torch.utils.checkpoint`` call that does not update BatchNorm running statistics twice.

The first call of a segment is its forward; a later call is a recompute and runs with the BN
layers' running buffers swapped for spares (``StatShield``; swapped, not copied back, so the
saved buffers' version counters stay valid). RNG state is stashed only for segments that draw
random numbers (``RngProbe``), and boundary ops nothing in backward reads are not recomputed
(``BoundarySkips``). Strategies that hold forward-time state (SBP's recorded BN statistics)
register it with :func:`replay_on_recompute`, and each recompute re-enters it. Why:
docs/design/internals.md#the-recompute-primitive."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint

from videotrain.memory.compiled import outside_compiler
from videotrain.metrics.saved import note_held

_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def batchnorms(module: nn.Module) -> list[_BatchNorm]:
    """BN layers in ``module`` that track running statistics (the ones recompute could corrupt)."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


class StatShield:
    """Throw-away running-stat buffers for the BNs of one checkpointed segment, made once and
    reused at every recompute: a clone per buffer per recompute would be three more kernels per
    BN per step on the backward's critical path. A segment is recomputed at most once per
    forward, and its backward follows its recompute, so one set per segment is enough; the
    buffers are remade when a BN's buffers change device, dtype or shape (``model.to``)."""

    def __init__(self, bns: list[_BatchNorm]) -> None:
        self.bns = bns
        self.scratch: dict[tuple[int, str], torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.bns)

    def _spare(self, i: int, name: str, buf: torch.Tensor) -> torch.Tensor:
        spare = self.scratch.get((i, name))
        if spare is None or spare.shape != buf.shape or spare.dtype != buf.dtype or spare.device != buf.device:
            spare = self.scratch[(i, name)] = buf.detach().clone()
        return spare

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Run the body with each BN's running-stat buffers replaced by the spares."""
        saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        try:  # the buffer dicts directly: Module.__setattr__ is a dozen Python calls per buffer
            for i, bn in enumerate(self.bns):
                buffers = bn._buffers
                for name in _STAT_BUFFERS:
                    buf = buffers.get(name)
                    if isinstance(buf, torch.Tensor):
                        saved.append((buffers, name, buf))
                        buffers[name] = self._spare(i, name, buf)
            yield
        finally:
            for buffers, name, buf in saved:
                buffers[name] = buf


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


_ANCHORS: dict[torch.device, torch.Tensor] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    """A zero-size tensor on ``device``, made once per device (not one allocation per call)."""
    if device not in _ANCHORS:
        _ANCHORS[device] = torch.empty(0, device=device)
    return _ANCHORS[device]


def _rng_states(device: torch.device) -> list[bytes]:
    """The CPU generator's state and ``device``'s, as bytes (compared outside any dispatch mode:
    a fake-tensor step, ``memory/estimate.py``, must not see the comparison)."""
    with _disable_current_modes():
        states = [torch.random.get_rng_state()]
        if device.type == "cuda" and torch.cuda.is_available():
            states.append(torch.cuda.get_rng_state(device))
        return [bytes(s.numpy()) for s in states]


class RngProbe:
    """Whether a segment draws random numbers: its first checkpointed forward runs with the RNG
    state preserved and compares the generators' states before and after; later calls preserve
    the RNG state (a copy of the CPU and device generators per call, and a restore at recompute)
    only if that forward drew from them. Dropout, drop-path and random fills are seen whatever
    code draws them."""

    def __init__(self) -> None:
        self.draws: bool | None = None  # None: not yet seen


def recompute_call(fn: Callable[..., Any], bns: list[_BatchNorm] | StatShield, *args: Any,
                    rng: RngProbe | None = None, skips: BoundarySkips | None = None,
                    **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpoint; recomputes leave BN stats alone
    and re-enter the forward-time contexts registered with :func:`replay_on_recompute`.

    Unlike ``torch.utils.checkpoint``, the inputs are let go once the recompute is done (the
    planner counts on a boundary dying at its last reader's recompute): they are passed through
    a holder, and a zero-size anchor on their device is the checkpoint's argument, so that it
    still replays that device's autocast state and, where the segment draws random numbers
    (``rng``, a :class:`RngProbe`; without one always), its RNG state. ``skips``: boundary ops
    whose recompute runs no kernel (:class:`BoundarySkips`). An input changed in place after the
    forward is refused, and so is a second recompute (``retain_graph=True``).
    """
    calls = [0]
    replays = [provider() for provider in _replay_providers]  # snapshots, taken now
    held = _Held(args, kwargs)
    tensors = _tensors(args, kwargs)
    versions = [t._version for t in tensors]
    device = tensors[0].device if tensors else torch.device("cpu")
    # fake or meta tensors (a simulated step) draw nothing from the real generators: no verdict
    real = not any(is_fake(t) or t.device.type == "meta" for t in tensors)
    del tensors
    shield = bns if isinstance(bns, StatShield) else StatShield(bns)
    probe = rng is not None and rng.draws is None and real
    before = _rng_states(device) if probe else None

    def run(_anchor: torch.Tensor) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            if skips is None:
                out = fn(*held.args, **held.kwargs)
            else:
                with _phase(skips, recompute=False):
                    out = fn(*held.args, **held.kwargs)
            if probe:
                rng.draws = before != _rng_states(device)
            return out
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
            if not (shield or replays or skips):
                return fn(*a, **kw)
            with ExitStack() as stack:  # a recompute in backward
                for replay in replays:
                    stack.enter_context(replay())
                if shield:
                    stack.enter_context(shield.swapped())
                if skips is not None:
                    stack.enter_context(_phase(skips, recompute=True))
                return fn(*a, **kw)
        finally:
            del a, kw

    preserve = rng is None or rng.draws is None or rng.draws
    return checkpoint(run, _anchor(device), use_reentrant=False, preserve_rng_state=preserve)


# ---------------------------------------------------------------------- boundary ops skipped
class BoundarySkips:
    """The free boundary ops of one checkpointed fx segment (``planner.free_boundary``), whose
    recompute runs no kernel: the segment's generated code brackets each with
    :func:`boundary_begin` / :func:`boundary_end`; the first forward records which aten op made
    the node's output, and in the recompute that op returns an uninitialised tensor of its
    output's shape instead (autograd still saves its inputs, all the backward reads). Everything
    else in the bracket runs. Why: docs/memory.md#how-a-plan-runs."""

    def __init__(self, tags: list[str]) -> None:
        self.tags = set(tags)
        self.target: dict[str, Any] = {}  # tag -> the aten op to skip, or None (never skip)


class _State(threading.local):
    skips: BoundarySkips | None = None
    recompute: bool = False
    modes: list[tuple[str, TorchDispatchMode]]

    def __init__(self) -> None:
        self.modes = []


_STATE = _State()


@contextmanager
def _phase(skips: BoundarySkips | None, recompute: bool) -> Iterator[None]:
    """The brackets in the body act for ``skips``; modes a bracket left open (the recompute
    stops early with an exception, possibly inside one) are closed on the way out."""
    prev = (_STATE.skips, _STATE.recompute, _STATE.modes)
    _STATE.skips, _STATE.recompute, _STATE.modes = skips, recompute, []
    try:
        yield
    finally:
        while _STATE.modes:
            _STATE.modes.pop()[1].__exit__(None, None, None)
        _STATE.skips, _STATE.recompute, _STATE.modes = prev


class _Record(TorchDispatchMode):
    """Records the ops of one node's forward: (op, the storages of its outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, set[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        keys = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor)}
        self.ops.append((func, keys))
        return out


class _Skip(TorchDispatchMode):
    """The first call of ``func`` returns uninitialised tensors shaped like its output (from its
    meta kernel) instead of running; no kernel is launched for it."""

    def __init__(self, func: Any) -> None:
        super().__init__()
        self.func = func

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is self.func:
            self.func = None
            device = next((t.device for t in tree_flatten((args, kwargs))[0]
                           if isinstance(t, torch.Tensor)), None)
            nhwc = any(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous()
                       and t.is_contiguous(memory_format=torch.channels_last)
                       for t in tree_flatten((args, kwargs))[0])
            try:
                with _disable_current_modes():  # shapes only: not kernels the step launches
                    meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
                    return tree_map(lambda m: _placeholder(m, device, nhwc)
                                    if isinstance(m, torch.Tensor) else m, meta)
            except (NotImplementedError, RuntimeError):  # no meta kernel: run it
                pass
        return func(*args, **kwargs)


def _placeholder(meta: torch.Tensor, device: torch.device | None, nhwc: bool) -> torch.Tensor:
    """An uninitialised tensor like ``meta`` on ``device``; 4-D ones channels_last when the op's
    inputs are (what the real kernel would have returned)."""
    if nhwc and meta.dim() == 4:
        return torch.empty(meta.shape, dtype=meta.dtype, device=device, memory_format=torch.channels_last)
    return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=device)


def _to_meta(t: object) -> object:
    if isinstance(t, torch.Tensor):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t


def _is_plain(func: Any) -> bool:
    """An op whose outputs are new tensors (not views of, or writes to, its inputs)."""
    return not any(r.alias_info is not None for r in func._schema.returns)


def boundary_begin(tag: str) -> None:
    """Called by a checkpointed segment's code before a free boundary node (see
    :class:`BoundarySkips`)."""
    skips = _STATE.skips
    if skips is None or tag not in skips.tags:
        return
    if _STATE.recompute:
        func = skips.target.get(tag)
        if func is not None:
            mode = _Skip(func)
            mode.__enter__()
            _STATE.modes.append((tag, mode))
    elif tag not in skips.target:
        mode = _Record()
        mode.__enter__()
        _STATE.modes.append((tag, mode))


def boundary_end(tag: str, value: object) -> object:
    """Called after the node (``value``: its output); closes what :func:`boundary_begin`
    opened and, after the first forward's recording, names the op to skip."""
    if not _STATE.modes or _STATE.modes[-1][0] != tag:
        return value
    _, mode = _STATE.modes.pop()
    mode.__exit__(None, None, None)
    if isinstance(mode, _Record) and isinstance(value, torch.Tensor):
        key = StorageWeakRef(value.untyped_storage()).cdata
        # the op that made the output's storage (a linear on 3-D input: the addmm under its views)
        makers = [func for func, keys in mode.ops if key in keys and _is_plain(func)]
        func = makers[-1] if makers else None
        once = func is not None and sum(f is func for f, _ in mode.ops) == 1
        _STATE.skips.target[tag] = func if once else None
    return value


class RecomputedForward:
    """Replaces ``module.forward`` (instance attribute): checkpointed in training with grad on,
    the original forward otherwise (eval and ``no_grad`` are untouched).

    ``compiled`` (``Recompute.compile``): the original forward compiled, run in its place and
    inside the checkpoint; compiled code that calls the module reaches the checkpoint through a
    graph break, so the compiler never traces the checkpoint itself."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.original = module.forward
        self.compiled: Callable[..., Any] | None = None
        self.bns = StatShield(batchnorms(module))
        self.rng = RngProbe()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training and torch.is_grad_enabled():
            if torch.compiler.is_compiling():
                return outside_compiler(self, *args, **kwargs)  # the checkpoint, not traced
            return recompute_call(self.compiled or self.original, self.bns, *args, rng=self.rng,
                                  **kwargs)
        if self.compiled is None or torch.compiler.is_compiling():
            return self.original(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def wrap_forward(module: nn.Module) -> nn.Module:
    """Checkpoint ``module``'s forward in training, once (idempotent)."""
    if not isinstance(module.__dict__.get("forward"), RecomputedForward):
        module.forward = RecomputedForward(module)  # type: ignore[method-assign]
    return module


class RecomputedSegment(nn.Module):
    """A segment of a split fx graph, run under :func:`recompute_call` when grad is on.

    The split graph is private to the strategy and only runs from ``encode`` (training), so
    the segment's own ``training`` flag (which does not follow ``backbone.train()``) is ignored.
    """

    def __init__(self, segment: nn.Module, skips: BoundarySkips | None = None) -> None:
        super().__init__()
        self.segment = segment
        self.bns = StatShield(batchnorms(segment))
        self.rng = RngProbe()
        self.skips = skips

    def forward(self, *args: Any) -> Any:
        if torch.is_grad_enabled():
            return recompute_call(self.segment, self.bns, *args, rng=self.rng, skips=self.skips)
        return self.segment(*args)
