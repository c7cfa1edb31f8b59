"""The backbone as a DAG of intermediate tensors, for recomputation planning.

Why a graph of its own: the planner (``planner.py``) reasons about sets of *tensors* (lower
sets, their boundaries, bytes and recompute cost), not fx nodes. Inputs, parameters and
non-tensor values (``x.shape``, sizes) are not vertices: they are contracted (edges pass
through them), so shape arithmetic does not multiply the lower sets. Sets of vertices are ints
used as bitmasks (bit ``i`` = vertex ``i``, in fx, i.e. topological, order). :func:`trace`
rewrites the traced graph out of place (``memory.fx.make_out_of_place``), so any cut is legal
(a cut between a BN and its in-place ReLU would fail in backward); the backbone is not modified.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from videotrain.memory.fx import make_out_of_place, symbolic_trace
from videotrain.memory.recompute.costs import (
    DeviceProfile,
    check_cost_model,
    profile_for,
    time_call,
)
from videotrain.metrics.live_bytes import LiveStorageBytes


@dataclass
class Graph:
    """A DAG in topological order: ``preds[i]`` are vertex indices ``< i``; sizes in bytes.

    ``mem[v]`` is the size of ``v``'s output (what a kept boundary and its gradient cost);
    ``saved[v]`` what autograd keeps for ``v`` until its backward: the output if some backward
    uses it (and it is not a view of a tensor already counted) plus internals such as BN
    statistics or dropout masks. ``saved`` defaults to ``mem`` (every output kept: conservative).
    """

    names: list[str]
    preds: list[list[int]]
    mem: list[float]
    cost: list[float]
    saved: list[float] | None = None
    keeps: list[bool] | None = None  # output held by autograd (counted in saved); default all
    work_fwd: list[float] | None = None  # bytes an op allocates and frees inside its forward
    work_bwd: list[float] | None = None  # ... inside its backward (beyond its input gradients)
    grad_alias: list[bool] | None = None  # backward hands its inputs views of its own gradient
    saves: list[bool] | None = None  # the op saves some activation for its backward; default all
    # skippable in a recompute: the op saves neither its output nor internals (a conv, a linear,
    # an add), so a boundary op of this kind needs no kernel when its segment is recomputed;
    # default all (the paper's model: a block's boundary is never recomputed); ``trace`` sets it
    free: list[bool] | None = None
    flops: list[float] | None = None  # the cost proxy ``cost`` was priced from (FLOPs)
    segment_cost: float = 0.0  # host cost of one recomputed segment, in ``cost``'s units
    succ_mask: list[int] = field(init=False)
    pred_mask: list[int] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.names)
        if self.saved is None:
            self.saved = list(self.mem)
        if self.keeps is None:
            self.keeps = [True] * n
        self.work_fwd = self.work_fwd or [0.0] * n
        self.work_bwd = self.work_bwd or [0.0] * n
        self.grad_alias = self.grad_alias or [False] * n
        self.saves = self.saves or [True] * n
        self.free = self.free or [True] * n
        self.peak_cache: dict[tuple, float] = {}
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
        if isinstance(mod, nn.MultiheadAttention) or (  # or a leaf timm Attention: qkv, proj
                isinstance(getattr(mod, "qkv", None), nn.Linear) and isinstance(getattr(mod, "proj", None), nn.Linear)):
            first = meta if isinstance(meta, TensorMetadata) else meta[0]  # MHA: (out, weights)
            shape = first.shape  # (N, L, E)
            n, seq, e = (int(s) for s in shape) if len(shape) == 3 else (1, int(shape[0]), int(shape[-1]))
            return 2.0 * n * seq * e * 4 * e + 4.0 * n * seq * seq * e
    return float(out_numel)


def _storage_key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


class _SavedProp(ShapeProp):
    """ShapeProp that also records what autograd saves at each node. Per node:
    ``extra_saved_bytes``, the saved bytes that are neither the node's inputs, parameters nor
    output (LayerNorm/BN statistics, attention internals of a leaf ``MultiheadAttention``,
    dropout masks), which live until the node's backward; ``output_saved``, set on a node when
    its own backward or a consumer's saves its output (a conv saves its input, a ReLU its
    result; a BN output feeding a ReLU is freed in forward); ``alias``, set when the output
    shares storage with an input (a view), so its bytes are not counted twice. Why: the planner
    charges a vertex only what autograd really keeps, or its peak is several times too high."""

    _lifted: list[torch.Tensor] | None = None
    _param_keys: set[int] = set()  # storages of parameters (also when lifted from get_attr)
    measure = False  # time each node's forward (cost_model=measured)

    def _bytes_in(self, n: fx.Node) -> float:
        """Bytes an op reads: its tensor inputs and its module's parameters (BatchNorm reads its
        input twice in training: statistics, then normalization)."""
        seen: dict[int, int] = {}
        for arg in tree_flatten((n.args, n.kwargs))[0]:
            value = self.env.get(arg) if isinstance(arg, fx.Node) else arg
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    seen[_storage_key(t)] = t.numel() * t.element_size()
        total = float(sum(seen.values()))
        if n.op == "call_module":
            mod = self.module.get_submodule(str(n.target))
            total += sum(p.numel() * p.element_size() for p in mod.parameters())
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
                total *= 2
        return total

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple:
        """Inputs as fresh leaves that require grad, so one node's backward can run alone."""
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        if self._lifted is None:
            return args, kwargs

        memo: dict[int, torch.Tensor] = {}

        def lift(t: object) -> object:  # one leaf per input value: MHA(x, x, x) must see q is k
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                if id(t) not in memo:
                    memo[id(t)] = t.detach().requires_grad_()
                    self._lifted.append(memo[id(t)])
                    if isinstance(t, nn.Parameter):
                        self._param_keys.add(_storage_key(t))
                return memo[id(t)]
            return t

        return tree_map(lift, (args, kwargs))

    def run_node(self, n: fx.Node) -> object:
        if not n.op.startswith("call_"):
            return super().run_node(n)
        packed: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(t)
            return t

        self._lifted = []
        self._param_keys = set()
        if n.op == "call_module":
            self._param_keys = {_storage_key(p) for p in self.module.get_submodule(str(n.target)).parameters()}
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    LiveStorageBytes() as fwd:
                result = super().run_node(n)
        finally:
            leaves, self._lifted = self._lifted, None
        # the op's temporaries: the peak of the storages created, less those alive at the end
        # (its saved internals and output, which the planner charges on their own)
        n.meta["work_fwd"] = float(fwd.peak - fwd.now())
        packed_keys = {_storage_key(t) for t in packed}
        arg_keys: dict[fx.Node, set[int]] = {}  # input node -> storages of its value
        input_keys: set[int] = set()
        for arg in tree_flatten((n.args, n.kwargs))[0]:
            t = self.env.get(arg) if isinstance(arg, fx.Node) else arg
            keys = {_storage_key(leaf) for leaf in tree_flatten(t)[0] if isinstance(leaf, torch.Tensor)}
            input_keys |= keys
            if isinstance(arg, fx.Node):
                arg_keys[arg] = keys
                if keys & packed_keys:
                    arg.meta["output_saved"] = True
        out_keys = {_storage_key(t) for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)}
        if out_keys & packed_keys:
            n.meta["output_saved"] = n.meta["self_saves_output"] = True
        n.meta["bytes_in"] = self._bytes_in(n)
        if self.measure:
            args, kwargs = super().fetch_args_kwargs_from_env(n)
            device = next((t.device for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)),
                          torch.device("cpu"))  # where the node runs
            n.meta["measured_s"] = time_call(lambda: getattr(self, n.op)(n.target, args, kwargs), device)
        n.meta["alias"] = bool(out_keys) and out_keys <= input_keys
        n.meta["alias_of"] = [a for a, keys in arg_keys.items() if keys & out_keys] if n.meta["alias"] else []
        known = input_keys | out_keys | self._param_keys
        # parameters are leaves that require grad: not activations
        internals = {  # storage key -> (weak ref, bytes)
            _storage_key(t): (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
            for t in packed
            if t.dim() > 0 and not (t.is_leaf and t.requires_grad) and _storage_key(t) not in known
        }
        n.meta["extra_saved_bytes"] = sum(b for _, b in internals.values())
        n.meta["saves"] = any(_storage_key(t) not in self._param_keys for t in packed)  # not params
        packed.clear()  # the autograd graph alone holds the internals now: backward frees them
        n.meta["work_bwd"], n.meta["grad_alias"] = self._backward_work(n, result, leaves, internals)
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, result)

    def _backward_work(self, n: fx.Node, result: object, leaves: list[torch.Tensor],
                       internals: dict[int, tuple[StorageWeakRef, int]]) -> tuple[float, bool]:
        """(bytes the node's backward allocates and frees again beyond what its saved internals
        release meanwhile, e.g. attention: the peak of those internals still alive plus the
        backward's own temporaries, less the internals' total, which ``Graph.saved`` already
        charges (so it can be negative); whether the input gradients it returns share storage
        with its output gradient, as for add, cat and views: that storage then lives as long as
        any of those gradients)."""
        outs = [t for t in tree_flatten(result)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        if not outs:
            return 0.0, False
        params = []
        if n.op == "call_module":
            params = [p for p in self.module.get_submodule(str(n.target)).parameters() if p.requires_grad]
        targets = [t for t in (*leaves, *params) if t.requires_grad]
        grad_outs = [torch.ones_like(o) for o in outs]
        with TransientBytes(watch=internals) as bwd:
            grads = torch.autograd.grad(outs, targets, grad_outs, allow_unused=True)
        # while the gradients are alive: they are not transient
        work = bwd.transient() - sum(b for _, b in internals.values())
        out_keys = {_storage_key(g) for g in grad_outs}
        alias = any(g is not None and _storage_key(g) in out_keys for g in grads[: len(leaves)])
        del grads
        return work, alias


class TransientBytes(TorchDispatchMode):
    """One op's backward temporaries: the storages created by the ops run under it, as a
    timeline per op; ``transient()`` is the peak of those that are freed again before the end
    (workspace, internals), i.e. what outputs do not account for, plus, at each moment, the
    ``watch``ed storages (created earlier) still alive. Not ``LiveStorageBytes``, which forgets
    a storage when it dies: which storages survive is known only at the end, so every weak
    reference is kept to it (a storage key is then never reused for another).
    Dispatch modes are thread-local: on CUDA the backward runs on the autograd device thread and
    is not seen (its internals are then not charged)."""

    def __init__(self, watch: dict[int, tuple[StorageWeakRef, int]] | None = None) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.timeline: list[list[int]] = []
        self.watch = dict(watch or {})
        self.watched: list[int] = []

    def __enter__(self) -> TransientBytes:
        self.watched.append(sum(b for r, b in self.watch.values() if not r.expired()))
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata in self.watch:  # a view of a watched storage: not a new one
                    continue
                if ref.cdata not in self.refs or self.refs[ref.cdata][0].expired():
                    self.refs[ref.cdata] = (ref, storage.nbytes())
        self.timeline.append([k for k, (r, _) in self.refs.items() if not r.expired()])
        self.watched.append(sum(b for r, b in self.watch.values() if not r.expired()))
        return out

    def transient(self) -> float:
        end = {k for k, (r, _) in self.refs.items() if not r.expired()}
        created = [sum(self.refs[k][1] for k in live if k not in end) for live in self.timeline]
        # watched[i] is the state before op i (watched[0]: on entry); the peak can be either side
        points = [self.watched[0]] + [c + max(w0, w1) for c, w0, w1 in
                                      zip(created, self.watched[:-1], self.watched[1:], strict=True)]
        return float(max(points, default=0))


def trace(backbone: nn.Module, example: torch.Tensor, cost_model: str = "roofline",
          profile: DeviceProfile | None = None) -> tuple[fx.GraphModule, Graph, dict[str, int]]:
    """fx-trace ``backbone`` (with its own tracer: ``memory.fx.symbolic_trace``), make it out of
    place, propagate shapes for ``example (N,C,H,W)``; returns the traced module (sharing
    parameters and buffers with ``backbone``), the tensor DAG, and a map from fx node name to
    vertex index. Each node's forward and backward run alone on the real kernels (outputs
    detached), so what autograd saves and what ops allocate are the training device's and dtype's;
    BN running statistics and the RNG are restored afterwards. ``cost_model`` (``costs.py``):
    ``roofline`` on ``profile`` (default: the example's device), ``measured`` (each node's forward
    timed), or ``flops`` (the FLOP proxy alone, no segment cost)."""
    check_cost_model(cost_model)
    profile = profile or profile_for(example.device)
    gm = make_out_of_place(symbolic_trace(backbone))
    buffers = {k: b.clone() for k, b in gm.named_buffers()}  # parameters are not changed
    devices = [example.device] if example.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():  # grad on per node inside
        prop = _SavedProp(gm)
        prop.measure = cost_model == "measured"
        prop.propagate(example.detach())
    gm.load_state_dict(buffers, strict=False)  # BN running statistics as they were; RNG: fork_rng
    for node in reversed(gm.graph.nodes):  # a saved view keeps its base's storage alive
        if node.meta.get("output_saved"):
            for base in node.meta.get("alias_of", []):
                base.meta["output_saved"] = True
    index: dict[str, int] = {}
    names, preds, mem, cost, saved, keeps = [], [], [], [], [], []
    work_fwd: list[float] = []
    work_bwd: list[float] = []
    grad_alias: list[bool] = []
    saves: list[bool] = []
    free: list[bool] = []
    flops: list[float] = []
    tensor_preds: dict[str, set[int]] = {}  # node -> vertex preds, through contracted non-tensor nodes
    # tensors computed from parameters alone (timm ConvNeXt's ``gamma.reshape(1, -1, 1, 1)``) are
    # not activations: contracted like non-tensor nodes. As vertices without predecessors each
    # could join any lower set, multiplying the lower sets past the exact DP's cap.
    from_input: set[str] = set()
    for node in gm.graph.nodes:
        ps: set[int] = set()
        for inp in node.all_input_nodes:
            ps |= {index[inp.name]} if inp.name in index else tensor_preds.get(inp.name, set())
        if node.op == "placeholder" or any(i.name in from_input for i in node.all_input_nodes):
            from_input.add(node.name)
        if _is_tensor_node(node) and node.name in from_input:
            index[node.name] = len(names)
            out_bytes = _meta_bytes(node.meta["tensor_meta"])
            names.append(node.name)
            preds.append(sorted(ps))
            mem.append(float(out_bytes))
            kept = node.meta.get("output_saved", False) and not node.meta.get("alias", False)
            saved.append(float(out_bytes * kept + node.meta.get("extra_saved_bytes", 0)))
            keeps.append(bool(kept))
            work_fwd.append(float(node.meta.get("work_fwd", 0.0)))
            work_bwd.append(float(node.meta.get("work_bwd", 0.0)))
            grad_alias.append(bool(node.meta.get("grad_alias", False)))
            saves.append(bool(node.meta.get("saves", True)))
            free.append(not node.meta.get("self_saves_output", False)
                        and not node.meta.get("extra_saved_bytes", 0))
            flops.append(_flops(node, gm, out_bytes))
            if cost_model == "flops":
                cost.append(flops[-1])
            else:
                half = _is_half(node.meta["tensor_meta"])
                moved = out_bytes + node.meta.get("bytes_in", 0.0)
                cost.append(profile.seconds(flops[-1], moved, half, node.meta.get("measured_s")))
        else:
            tensor_preds[node.name] = ps
    segment = profile.segment_s if cost_model != "flops" else 0.0
    return gm, Graph(names, preds, mem, cost, saved, keeps, work_fwd, work_bwd, grad_alias,
                     saves, free, flops, segment), index


def _is_half(meta: object) -> bool:
    first = meta if isinstance(meta, TensorMetadata) else next(iter(tree_flatten(meta)[0]), None)
    return isinstance(first, TensorMetadata) and first.dtype in (torch.bfloat16, torch.float16)
