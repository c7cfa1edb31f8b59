"""The backbone as a DAG of intermediate tensors, for recomputation planning.

Why a separate graph: the planner (``planner.py``) reasons about sets of *tensors* (lower sets,
their boundaries, bytes and recompute cost), not about fx nodes. Inputs, parameters
(``get_attr``) and non-tensor values (``x.shape``, sizes) are not vertices: non-tensor nodes are
contracted (edges pass through them), so shape arithmetic does not multiply the lower sets.

Sets of vertices are Python ints used as bitmasks (bit ``i`` = vertex ``i``); vertices are
numbered in fx (topological) order.

In-place ops: torchvision ResNets use ``ReLU(inplace=True)``. A segment cut between a BN and
its in-place ReLU would make the next segment modify a checkpoint input in place, which fails
in backward. :func:`trace` therefore rewrites the traced graph out of place (ReLU modules ->
``F.relu``; ``inplace=True`` kwargs -> False; ``x.relu_()``-style methods -> ``x.relu()``), so
any cut is legal. The original backbone is not modified.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.utils._pytree import tree_flatten

_INPLACE_FUNCS = {operator.iadd: operator.add, operator.imul: operator.mul, operator.isub: operator.sub}


@dataclass
class Graph:
    """A DAG in topological order: ``preds[i]`` are vertex indices ``< i``; sizes in bytes."""

    names: list[str]
    preds: list[list[int]]
    mem: list[float]
    cost: list[float]
    succ_mask: list[int] = field(init=False)
    pred_mask: list[int] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.names)
        self.pred_mask = [sum(1 << p for p in ps) for ps in self.preds]
        self.succ_mask = [0] * n
        for v, ps in enumerate(self.preds):
            for p in ps:
                self.succ_mask[p] |= 1 << v

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def full(self) -> int:
        return (1 << self.n) - 1

    def members(self, s: int) -> Iterator[int]:
        while s:
            low = s & -s
            yield low.bit_length() - 1
            s ^= low

    def mem_of(self, s: int) -> float:
        return sum(self.mem[v] for v in self.members(s))

    def cost_of(self, s: int) -> float:
        return sum(self.cost[v] for v in self.members(s))

    def boundary(self, inner: int, outer: int) -> int:
        """Vertices of ``inner`` with a successor outside ``outer`` (W_i when inner=V_i, outer=L_i;
        the push-aware ∂(L) when inner = outer = L)."""
        return sum(1 << v for v in self.members(inner) if self.succ_mask[v] & ~outer)

    def is_lower(self, s: int) -> bool:
        return all(self.pred_mask[v] & ~s == 0 for v in self.members(s))

    def ancestors(self, v: int) -> int:
        """Ancestor closure of ``v`` including ``v`` (a lower set)."""
        closure = 1 << v
        for u in range(v, -1, -1):  # preds have smaller indices: one reverse sweep suffices
            if closure >> u & 1:
                closure |= self.pred_mask[u]
        return closure


def lower_sets(g: Graph, cap: int | None = None) -> list[int] | None:
    """All lower sets (closed under predecessors), sorted by size; None if more than ``cap``."""
    seen = {0}
    frontier = [0]
    while frontier:
        nxt = []
        for s in frontier:
            for v in range(g.n):
                if not s >> v & 1 and g.pred_mask[v] & ~s == 0:
                    t = s | 1 << v
                    if t not in seen:
                        seen.add(t)
                        nxt.append(t)
                        if cap is not None and len(seen) > cap:
                            return None
        frontier = nxt
    return sorted(seen, key=lambda s: (s.bit_count(), s))


def articulation_points(g: Graph) -> list[int]:
    """Vertices ``v`` whose fx-order prefix ``{0..v}`` has ``{v}`` as its whole boundary: every
    path from the input to the output passes through ``v`` (a legal single-tensor cut)."""
    out, prefix = [], 0
    for v in range(g.n - 1):
        prefix |= 1 << v
        if g.boundary(prefix, prefix) == 1 << v:
            out.append(v)
    return out


# ---------------------------------------------------------------------------- fx tracing
def _meta_bytes(meta: object) -> int:
    if isinstance(meta, TensorMetadata):
        numel = 1
        for d in meta.shape:
            numel *= int(d)
        return numel * torch.empty((), dtype=meta.dtype).element_size()
    if isinstance(meta, list | tuple):
        return sum(_meta_bytes(m) for m in meta)
    if isinstance(meta, dict):
        return sum(_meta_bytes(m) for m in meta.values())
    return 0


def _is_tensor_node(node: fx.Node) -> bool:
    meta = node.meta.get("tensor_meta")
    return node.op.startswith("call_") and meta is not None and _meta_bytes(meta) > 0


def _flops(node: fx.Node, gm: fx.GraphModule, out_bytes: int) -> float:
    """Cost proxy: multiply-adds for conv/linear/attention, else the output element count."""
    meta = node.meta["tensor_meta"]
    out_numel = out_bytes / 4
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Conv2d | nn.Conv1d | nn.Conv3d):
            k = 1
            for d in mod.kernel_size:
                k *= d
            return 2.0 * out_numel * mod.in_channels // mod.groups * k
        if isinstance(mod, nn.Linear):
            return 2.0 * out_numel * mod.in_features
        if isinstance(mod, nn.MultiheadAttention):
            shape = (meta[0] if isinstance(meta, tuple | list) else meta).shape  # (N, L, E)
            n, seq, e = (int(s) for s in shape) if len(shape) == 3 else (1, int(shape[0]), int(shape[-1]))
            return 2.0 * n * seq * e * 4 * e + 4.0 * n * seq * seq * e
    return float(out_numel)


def _storage_key(t: torch.Tensor) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


class _SavedProp(ShapeProp):
    """ShapeProp that also records, per node, the bytes autograd saves that are neither the
    node's inputs, parameters nor output (LayerNorm/BN statistics, attention internals of a
    leaf ``MultiheadAttention``, dropout masks). Why: those live as long as the node's output
    does, so the planner must charge them to the node or its peak is not an upper bound."""

    def run_node(self, n: fx.Node) -> object:
        packed: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(t)
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = super().run_node(n)
        known = set()
        for obj in (*tree_flatten((n.args, n.kwargs))[0], result):
            for t in tree_flatten(obj)[0]:
                if isinstance(t, fx.Node):
                    t = self.env.get(t)
                if isinstance(t, torch.Tensor):
                    known.add(_storage_key(t))
        if n.op == "call_module":
            root = getattr(self, "fake_module", None) or self.module
            known |= {_storage_key(p) for p in root.get_submodule(str(n.target)).parameters()}
        # parameters (fake copies under a fake mode) are leaves that require grad: not activations
        extra = {
            _storage_key(t): t.untyped_storage().nbytes()
            for t in packed
            if t.dim() > 0 and not (t.is_leaf and t.requires_grad)
        }
        n.meta["extra_saved_bytes"] = sum(b for k, b in extra.items() if k not in known)
        return result


def make_out_of_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite in-place ops of the traced graph to their out-of-place forms (see module doc)."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.ReLU):
            if gm.get_submodule(str(node.target)).inplace:
                node.op, node.target = "call_function", F.relu
        elif node.op == "call_function" and node.target in _INPLACE_FUNCS:
            node.target = _INPLACE_FUNCS[node.target]
        elif node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).startswith("_"):
            node.target = str(node.target)[:-1]
        if node.op.startswith("call_") and node.kwargs.get("inplace") is True:
            node.kwargs = {**node.kwargs, "inplace": False}
    gm.graph.lint()
    gm.recompile()
    return gm


def trace(backbone: nn.Module, example: torch.Tensor) -> tuple[fx.GraphModule, Graph, dict[str, int]]:
    """fx-trace ``backbone``, make it out of place, propagate shapes for ``example (N,C,H,W)``.

    Returns the traced module (sharing parameters and buffers with ``backbone``), the tensor DAG,
    and a map from fx node name to vertex index. Shape propagation runs under a fake-tensor mode,
    so BN running statistics are not touched and no real activations are allocated.
    """
    gm = make_out_of_place(fx.symbolic_trace(backbone))
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        _SavedProp(gm, fake_mode=mode).propagate(mode.from_tensor(example))
    except Exception:  # fall back to a real forward on a copy of the BN state
        state = {k: v.clone() for k, v in gm.state_dict().items()}
        with torch.no_grad():  # _SavedProp re-enables grad per node
            _SavedProp(gm).propagate(example)
        gm.load_state_dict(state)
    index: dict[str, int] = {}
    names, preds, mem, cost = [], [], [], []
    tensor_preds: dict[str, set[int]] = {}  # node -> vertex preds, through contracted non-tensor nodes
    for node in gm.graph.nodes:
        ps: set[int] = set()
        for inp in node.all_input_nodes:
            ps |= {index[inp.name]} if inp.name in index else tensor_preds.get(inp.name, set())
        if _is_tensor_node(node):
            index[node.name] = len(names)
            out_bytes = _meta_bytes(node.meta["tensor_meta"])
            names.append(node.name)
            preds.append(sorted(ps))
            mem.append(float(out_bytes + node.meta.get("extra_saved_bytes", 0)))
            cost.append(_flops(node, gm, out_bytes))
        else:
            tensor_preds[node.name] = ps
    return gm, Graph(names, preds, mem, cost), index
