"""``trainer.compile``: the backbone, or the code a strategy generates, run by ``torch.compile``.

Why: on a GPU a ResNet-class step is set by host time and by the bytes of BN and elementwise
work; the compiler fuses the one and, with static shapes, CUDA graphs remove the other. By
default the backbone module is compiled in place (evaluation calls it too); a strategy that runs
other code in training compiles it itself (``CompilesItself``, ``memory.base``).

Invariants: shapes are static (``dynamic=False``), so a run compiles once per shape and grad
mode; code that runs eagerly (an ``autograd.Function`` with Python state, a checkpoint wrapper)
is never traced, since a graph break inside a checkpointed region sends it back to eager, and a
graph that holds a no-grad pass and a grad pass over the same blocks raises the peak.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from videotrain.memory.base import CompilesItself, MemoryStrategy

log = logging.getLogger(__name__)

# trainer.compile_mode: None is the compiler's default
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def wants_compile(setting: bool | str, device_type: str) -> bool:
    """``trainer.compile``: true / false force it; ``auto`` compiles on CUDA only (on the CPU
    the compile costs more than the default job's steps win back; docs/configuration.md)."""
    check_compile(setting)
    return setting if isinstance(setting, bool) else device_type == "cuda"


def check_compile(setting: bool | str, mode: str | None = None) -> None:
    """``trainer.compile`` and ``trainer.compile_mode`` checked, with an error naming the key."""
    if not isinstance(setting, bool) and setting != "auto":
        raise ValueError(f"trainer.compile must be auto, true or false, got {setting!r}")
    if mode not in COMPILE_MODES:
        raise ValueError(f"trainer.compile_mode must be null or one of "
                         f"{', '.join(m for m in COMPILE_MODES if m)}, got {mode!r}")


@dataclass(frozen=True)
class Compiler:
    """``torch.compile`` with one run's options: ``mode`` (None: the compiler's default),
    ``backend`` (``inductor``; tests use ``aot_eager``), static shapes. Calling it on a module
    compiles that module in place; :meth:`function` compiles a callable."""

    mode: str | None = None
    backend: str = "inductor"
    dynamic: bool = False

    def __post_init__(self) -> None:
        check_compile(False, self.mode)

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"backend": self.backend, "dynamic": self.dynamic}
        if self.mode is not None:
            opts["mode"] = self.mode
        return opts

    def __call__(self, module: nn.Module) -> nn.Module:
        module.compile(**self.options())
        return module

    def function(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, **self.options())


def compile_strategy(strategy: MemoryStrategy, backbone: nn.Module, compiler: Compiler) -> None:
    """Compile what ``strategy`` runs on ``backbone``: its own hook, else the backbone."""
    if isinstance(strategy, CompilesItself):
        strategy.compile(backbone, compiler)
    else:
        compiler(backbone)


def compile_model(model: nn.Module, compiler: Compiler) -> nn.Module:
    """A ``VideoClassifier`` (``backbone``, ``strategy``) compiled in place; returns it."""
    compile_strategy(model.strategy, model.backbone, compiler)
    return model


def compiled_forward(module: nn.Module, forward: Callable[..., Any],
                     compiler: Compiler) -> Callable[..., Any]:
    """``forward`` (``module``'s own, bound) compiled as code of its own: an fx trace of the
    module where fx can trace it. Why: the compiler keeps one cache per code object, with a
    limit on its entries (shapes, grad modes), and the blocks of a deep network share their
    class's code; compiled as themselves, they would recompile past the limit and run eagerly."""
    if getattr(forward, "__func__", None) is type(module).forward:
        try:
            return compiler(fx.GraphModule(module, fx.Tracer().trace(module)))
        except Exception as err:  # noqa: BLE001 - untraceable: the forward itself, compiled
            # said, since blocks sharing one code object may recompile past the limit (eager)
            log.info("trainer.compile: %s is compiled as its forward, not as an fx trace of its "
                     "own (%s: %s)", type(module).__name__, type(err).__name__,
                     str(err).splitlines()[0][:200] if str(err) else "")
    return compiler.function(forward)


@torch.compiler.disable
def outside_compiler(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` called from compiled code through a graph break: code the
    compiler must not trace (Python state, an ``autograd.Function``, a checkpoint)."""
    return fn(*args, **kwargs)


def eagerly(module: nn.Module) -> Callable[..., Any]:
    """``module`` called with every compiled function it reaches run eagerly (no compile)."""

    def run(*args: Any) -> Any:
        with torch.compiler.set_stance("force_eager"):
            return module(*args)

    return run


class NoGrad(nn.Module):
    """Runs ``inner`` under ``no_grad``: a region of generated code that ran without autograd."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        with torch.no_grad():
            return self.inner(*args)


def split_regions(gm: fx.GraphModule, eager: Callable[[fx.Node], bool],
                  compiler: Compiler) -> fx.GraphModule:
    """``gm`` split into regions run one after another, each a graph of its own: a run of
    nodes ``eager`` keeps out of the compiler stays eager, every other run is compiled, and a
    region between ``torch._C._set_grad_enabled(False)`` and ``(True)`` runs under ``no_grad``
    (so a no-grad pass and a grad pass are never one graph). ``getitem`` of an eager node, and
    ``get_attr`` nodes read only by eager nodes, stay eager too. Returns a new module."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:  # a copy without the grad-mode switches, their modes recorded
        if not (node.op == "call_function" and node.target is torch._C._set_grad_enabled):
            env[node] = graph.node_copy(node, lambda n: env[n])
    copy = fx.GraphModule(gm, graph)
    grad, region, key = True, -1, None
    part: dict[str, int] = {}
    kind: dict[int, tuple[bool, bool]] = {}  # region -> (compiled, grad)
    stays_eager: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op == "get_attr" and node.users and all(u in stays_eager for u in node.users):
            stays_eager.add(node)
        elif node.op not in ("placeholder", "output", "get_attr") and eager(node):
            stays_eager.add(node)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            grad = bool(node.args[0])
            continue
        if node.op in ("placeholder", "output"):
            continue
        is_eager = node in stays_eager or (
            node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.args[0] in stays_eager)
        if is_eager:
            stays_eager.add(node)
        if node.op == "get_attr" and not is_eager:
            # a parameter or buffer read by compiled code: joins its first reader's region
            continue
        if (not is_eager, grad) != key:
            region, key = region + 1, (not is_eager, grad)
            kind[region] = key
        part[env[node].name] = region
    for node in gm.graph.nodes:
        if node.op == "get_attr" and env[node].name not in part:
            part[env[node].name] = min(part[env[u].name] for u in node.users)
    # the original order: an in-place write (a dropped part's ReLU) must not move before a read
    split = split_module(copy, copy, lambda n: part[n.name], keep_original_order=True)
    for name, sub in list(split.named_children()):
        if not name.startswith("submod_"):
            continue
        compiled, with_grad = kind[int(name.split("_")[1])]
        if compiled:
            compiler(sub)
        if not with_grad:
            setattr(split, name, NoGrad(sub))
    return split


def compile_counts() -> dict[str, int]:
    """Dynamo's counters for this process: frames compiled (each compile and recompile),
    graphs made, graph breaks. Recompiles over some steps are the growth of ``frames``."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["ok"]),
            "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}
