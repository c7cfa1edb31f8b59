"""SBP in one forward: the backbone's code with kept and dropped twins.

The backbone is fx-traced once, made out of place and rewritten (:func:`lockstep_graph`) into
a ``GraphModule`` that takes the frames and the step's rows (:class:`PartRows`, rows in
``[kept | dropped]`` order) and returns the kept part's features with autograd and the dropped
part's without. A per-frame op becomes twins (the dropped one under ``no_grad``); where e2e's
kernel can run over all rows with the kept rows' graph beside it (``kept_rows``: a conv into a
full-batch BN, the ReLU or pool after it, a residual add with its ReLU) it runs once. The parts
meet at training-mode BN (e2e's statistics over all frames, running stats updated once) and at
modules with ``lockstep_parts`` (TSM's shift). It computes e2e's forward and e2e's gradient with
the dropped frames' activations held constant. Where it cannot be built, ``lockstep_graph``
says why and SBP uses record/apply (``sbp.split``). Details:
docs/design/internals.md#sbps-lockstep-code."""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.node import map_arg
from torch.nn.modules.batchnorm import _BatchNorm

from videotrain.memory.compiled import Compiler, split_regions
from videotrain.memory.fx import make_out_of_place, symbolic_trace
from videotrain.memory.sbp.kept_rows import (
    BatchNormCoefficients,
    KeptRowsBatchNorm,
    add_into,
    add_relu_parts,
    conv_parts,
    plain_conv,
)
from videotrain.memory.sbp.split import ScaleGrad, suggest_memory_format, train_bn_forward

log = logging.getLogger(__name__)


class PartRows:
    """The rows of one step: which original rows (``B*T`` order) are kept and dropped, the
    ``[kept | dropped]`` order the twins run in, and its inverse; temporal neighbours on
    demand (a backbone that mixes frames)."""

    def __init__(self, keep_rows: torch.Tensor, drop_rows: torch.Tensor) -> None:
        self.keep_rows, self.drop_rows = keep_rows, drop_rows  # (n,), (N - n,)
        self.n_keep = int(keep_rows.numel())
        self.n_rows = self.n_keep + int(drop_rows.numel())
        self._neighbours: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bn = BatchNormCoefficients(self.n_keep, self.n_rows)

    def neighbours(self, num_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(next, prev)``, each ``(N,)``: for every part row, the part row of the same
        clip's next / previous frame, or ``N`` (a zero row) at the clip's end / start."""
        if num_frames not in self._neighbours:
            if self.n_rows % num_frames:
                raise ValueError(f"temporal shift: {self.n_rows} frames are not whole clips of "
                                 f"{num_frames} frames")
            order = torch.cat((self.keep_rows, self.drop_rows))  # (N,): part row -> original row
            pos = torch.empty(self.n_rows + 1, dtype=order.dtype, device=order.device)  # (N + 1,)
            pos[order] = torch.arange(self.n_rows, device=order.device)  # original row -> part row
            pos[-1] = self.n_rows  # the zero row
            frame = order % num_frames  # (N,) frame index of each part row
            last = torch.full_like(order, self.n_rows)
            nxt = torch.where(frame < num_frames - 1, order + 1, last)  # original rows, N: none
            prv = torch.where(frame > 0, order - 1, last)
            nxt, prv = pos[nxt], pos[prv]  # part rows
            self._neighbours[num_frames] = (nxt, prv)
        return self._neighbours[num_frames]


def take_rows(x: torch.Tensor, rows: PartRows, kept: bool) -> torch.Tensor:
    """The kept ``(n, ...)`` or dropped ``(N - n, ...)`` rows of ``x``, a new tensor each (the
    first layer saves the kept one; indexing keeps the memory format)."""
    return x[rows.keep_rows] if kept else x[rows.drop_rows]


def dropped_rows(full: torch.Tensor, rows: PartRows) -> torch.Tensor:
    """The dropped block ``(N - n, ...)`` of ``full``, a view."""
    return full[rows.n_keep:]


def join_rows(kept: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """``[kept | dropped]`` as one ``(N, C, *)`` tensor without a graph: a BN's input. A node of
    its own in the lockstep code, so that the dropped block is freed as soon as it is joined,
    not held through the BN (at the stem, that block is the largest transient of the step)."""
    with torch.no_grad():
        return torch.cat((kept.detach(), dropped))


def batchnorm_parts(bn: _BatchNorm, kept: torch.Tensor, full: torch.Tensor, rows: PartRows,
                    view_ok: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``bn`` over ``full (N, C, *)``, all rows in ``[kept | dropped]`` order: e2e's training
    forward (statistics of all rows, running statistics once), returned whole, without a graph;
    the kept block carries :class:`KeptRowsBatchNorm`'s graph (from ``kept``, which it saves).
    ``view_ok``: every consumer of the kept output stores nothing of it (ReLU, add), so it may
    stay a view of the full output; otherwise it gets its own storage, so that what autograd
    saves holds only kept rows. A BN in eval mode normalises each row alone: the kept rows with
    a graph, all rows without. Returns ``(kept (n, C, *), full (N, C, *))``."""
    if rows.n_rows != full.shape[0]:
        raise RuntimeError(f"lockstep SBP: {type(bn).__name__} got {full.shape[0]} rows, not the "
                           f"step's {rows.n_rows} frames")
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch's C switch: a meet runs once per layer
    try:
        if not bn.training:
            out = bn(full)
        else:
            out, mean, rstd = train_bn_forward(bn, full)  # (N, C, *) in [kept | dropped] order
    finally:
        torch._C._set_grad_enabled(grad)
    if not bn.training:
        return bn(kept), out
    return KeptRowsBatchNorm.apply(kept, bn.weight, bn.bias, out, mean, rstd, rows.bn, bn.eps,
                                   view_ok), out


def module_parts(module: nn.Module, kept: Any, dropped: Any, rows: PartRows) -> tuple[Any, Any]:
    """A module that meets both parts itself (``module.lockstep_parts``)."""
    return module.lockstep_parts(kept, dropped, rows)


_VIEW_SAFE_FUNCS = {F.relu, torch.relu, operator.add, torch.add}  # save nothing of their input


def _view_safe(node: fx.Node, root: nn.Module) -> bool:
    if not node.users:
        return False
    for user in node.users:
        if user.op == "call_function" and user.target in _VIEW_SAFE_FUNCS:
            continue
        if user.op == "call_module" and type(root.get_submodule(str(user.target))) is nn.ReLU:
            continue
        return False
    return True


_RELU_FUNCS = {F.relu, torch.relu}
_ADD_FUNCS = {operator.add, torch.add}
# modules whose output is a new tensor that nothing else aliases
_FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, _BatchNorm, nn.ReLU)


def _is_relu(node: fx.Node, root: nn.Module) -> bool:
    """A ReLU of one value: an ``nn.ReLU`` module or ``relu`` (no other arguments)."""
    if node.op == "call_module":
        return type(root.get_submodule(str(node.target))) is nn.ReLU and len(node.args) == 1
    return (node.op == "call_function" and node.target in _RELU_FUNCS
            and set(node.kwargs) <= {"inplace"} and len(node.args) == 1)


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _ADD_FUNCS and not node.kwargs
            and len(node.args) == 2)


def _in_place_twin(node: fx.Node, root: nn.Module, bn_source_ok: bool) -> Any:
    """The in-place op for ``node``'s dropped twin, or ``None``. A dropped part runs under
    ``no_grad`` and stores nothing, so a ReLU or residual add may overwrite its input, as e2e's
    own ``ReLU(inplace=True)`` and ``out += identity`` do, when that input is read by nothing
    else and is a tensor of its own (not a view of another value): one block of rows fewer in
    the step's peak. A full-batch BN's dropped output shares its storage with the kept output,
    a view that autograd refuses to read once its base changed: ``bn_source_ok`` only where the
    kept twins run first."""
    is_relu, is_add = _is_relu(node, root), _is_add(node)
    if not (is_relu or is_add) or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    if len(src.users) != 1 or (is_add and src is node.args[1]):
        return None
    module = root.get_submodule(str(src.target)) if src.op == "call_module" else None
    if isinstance(module, _BatchNorm) and not bn_source_ok:
        return None
    fresh = isinstance(module, _FRESH_MODULES) or (
        src.op == "call_function" and src.target in _RELU_FUNCS | _ADD_FUNCS)
    if not fresh:
        return None
    return torch.relu_ if is_relu else add_into


def _fusable_bn(module: nn.Module) -> bool:
    return (isinstance(module, _BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
            and type(module).forward is _BatchNorm.forward)


class _Unsupported(Exception):
    pass


def lockstep_graph(backbone: nn.Module, full_batch: bool = True) -> fx.GraphModule | None:
    """``backbone``'s twin module: ``twin(frames, rows) -> (kept out, dropped out)``
    (module doc), or ``None`` when it cannot be built (untraceable backbone, a BN it cannot
    fuse). ``full_batch``: training-mode BN layers meet both parts (``bn_policy=full_batch``);
    otherwise BN runs per part like any layer (frozen BN, eval mode)."""
    try:
        return _twin_module(make_out_of_place(symbolic_trace(backbone)), full_batch)
    except Exception as err:  # noqa: BLE001 - any failure to trace or rewrite: record/apply
        reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        log.info("memory=sbp: record/apply, since the lockstep code of %s cannot be built (%s%s)",
                 type(backbone).__name__, type(err).__name__, f": {reason}" if reason else "")
        log.debug("lockstep_graph(%s) failed", type(backbone).__name__, exc_info=True)
        return None


def _twin_module(gm: fx.GraphModule, full_batch: bool) -> fx.GraphModule:
    """``gm`` rewritten into the twin module (module doc): each node copied where it reads no
    split value, else run once over all rows or queued as kept and dropped twins."""
    if sum(n.op == "placeholder" for n in gm.graph.nodes) != 1:
        raise _Unsupported("forward(frames) only")
    t = _Twins(gm, full_batch)
    for node in gm.graph.nodes:
        if node in t.env:  # emitted with the node before it (a residual add's ReLU)
            continue
        if node.op == "placeholder":
            t.env[node] = (t.kept_in, None)
        elif node.op == "output":
            t.output(node)
        elif node.op == "get_attr" or not t.is_split(node):
            t.env[node] = t.g.node_copy(node, lambda n: t.env[n])
        else:
            t.split(node)
    return _flat_module_names(fx.GraphModule(gm, t.g, "SBPLockstep"))


def _flat_module_names(twin: fx.GraphModule) -> fx.GraphModule:
    """``twin`` with each module it calls or passes to a meet registered once more under a
    flat name (``net_layer1_0_conv1``), the same module object: the generated code reads one
    attribute per call instead of one per level of ``net.layer1.0.conv1``."""
    for node in twin.graph.nodes:
        if node.op not in ("call_module", "get_attr") or "." not in str(node.target):
            continue
        module = twin.get_submodule(str(node.target)) if node.op == "call_module" else None
        if node.op == "get_attr":
            owner, _, leaf = str(node.target).rpartition(".")
            module = twin.get_submodule(owner)._modules.get(leaf)
        if module is None:  # a parameter or buffer
            continue
        flat = "_m_" + str(node.target).replace(".", "_")
        if flat not in twin._modules:
            twin.add_module(flat, module)
        node.target = flat
    twin.recompile()
    return twin


class _Twins:
    """The twin graph ``g`` being built from ``gm``, what each original node became, and the
    segment of per-frame nodes not yet emitted."""

    def __init__(self, gm: fx.GraphModule, full_batch: bool) -> None:
        self.gm, self.full_batch = gm, full_batch
        self.g = g = fx.Graph()
        self.frames, self.rows = g.placeholder("frames"), g.placeholder("rows")
        # the parts are gathered here, not by the caller, so that the dropped frames' copy is
        # freed after its first op instead of living through the pass
        self.kept_in = g.call_function(take_rows, (self.frames, self.rows, True))
        # original node -> new node, or (kept node, dropped node or None: a view of its full value)
        self.env: dict[fx.Node, Any] = {}
        self.full: dict[fx.Node, fx.Node] = {}  # original node -> its value on all N rows, no graph
        # full values that are a tensor of their own (may be overwritten)
        self.owned: set[fx.Node] = set()
        self.pending: list[fx.Node] = []  # per-frame nodes of the current segment, not yet emitted
        self.after_bn = False  # the current segment starts at a BN meet

    def dropped_of(self, n: fx.Node) -> fx.Node:
        """``n``'s dropped node, made where first needed: the dropped frames' copy lives from
        here."""
        kept, dropped = self.env[n]
        if dropped is None:
            g, rows = self.g, self.rows
            dropped = (g.call_function(dropped_rows, (self.full[n], rows)) if n in self.full
                       else g.call_function(take_rows, (self.frames, rows, False)))
            self.env[n] = (kept, dropped)
        return dropped

    def part(self, value: Any, i: int) -> Any:
        """``value`` (args or kwargs) with each split node replaced by its kept (``i == 0``) or
        dropped twin."""
        def pick(n: fx.Node) -> Any:
            if not isinstance(self.env[n], tuple):
                return self.env[n]
            return self.env[n][0] if i == 0 else self.dropped_of(n)
        return map_arg(value, pick)

    def is_split(self, node: fx.Node) -> bool:
        """Whether ``node`` reads a value that has kept and dropped parts."""
        return any(isinstance(self.env[a], tuple) for a in node.all_input_nodes)

    def set_full(self, node: fx.Node, kept: fx.Node, value: fx.Node) -> None:
        """Record ``node`` as known on all rows: ``kept`` with a graph, ``value`` (its own tensor)
        without."""
        self.env[node], self.full[node] = (kept, None), value
        self.owned.add(node)

    def call(self, fn: Any, args: tuple) -> tuple[fx.Node, fx.Node]:
        """A call of ``fn`` that returns a pair, as two nodes."""
        both = self.g.call_function(fn, args)
        return (self.g.call_function(operator.getitem, (both, 0)),
                self.g.call_function(operator.getitem, (both, 1)))

    def module(self, node: fx.Node) -> nn.Module | None:
        """The module ``node`` calls, or ``None``."""
        return self.gm.get_submodule(str(node.target)) if node.op == "call_module" else None

    def feeds_fused_bn(self, node: fx.Node) -> bool:
        """Whether ``node``'s one reader is a BN meet that reads it alone."""
        users = list(node.users)
        return (self.full_batch and len(users) == 1
                and isinstance(self.module(users[0]), _BatchNorm)
                and _fusable_bn(self.module(users[0]))
                and users[0].args == (node,) and not users[0].kwargs)

    def flush(self) -> None:
        """Emit the segment's twins: the dropped ones under ``no_grad``, where a ReLU or add may
        run in place (``_in_place_twin``). After a BN meet the kept twins go first, since a
        kept input may be a view of the meet's output, whose dropped rows are then overwritten;
        elsewhere the dropped twins go first, so that their transient is gone before the kept
        twins store anything (a ViT's whole network is one segment)."""
        if not self.pending:
            return
        for emit in ((self._kept, self._dropped) if self.after_bn else (self._dropped, self._kept)):
            emit()
        self.pending.clear()

    def _kept(self) -> None:
        """The segment's kept twins, with autograd."""
        for node in self.pending:
            self.env[node] = (self.g.create_node(node.op, node.target, self.part(node.args, 0),
                                                 self.part(node.kwargs, 0)), self.env[node][1])

    def _dropped(self) -> None:
        """The segment's dropped twins, under ``no_grad``; a ReLU or add in place where it may."""
        g = self.g
        g.call_function(torch._C._set_grad_enabled, (False,))
        for node in self.pending:
            args = self.part(node.args, 1)
            op = _in_place_twin(node, self.gm, bn_source_ok=self.after_bn or not self.full_batch)
            twin = (g.call_function(op, args) if op is not None
                    else g.create_node(node.op, node.target, args, self.part(node.kwargs, 1)))
            self.env[node] = (self.env[node][0], twin)
        g.call_function(torch._C._set_grad_enabled, (True,))

    def output(self, node: fx.Node) -> None:
        """The graph's output: the kept and the dropped part of the backbone's one tensor."""
        self.flush()
        out = node.args[0]
        if not isinstance(out, fx.Node) or not isinstance(self.env[out], tuple):
            raise _Unsupported("the backbone must return one tensor computed from its input")
        self.g.output((self.env[out][0], self.dropped_of(out)))

    def split(self, node: fx.Node) -> None:
        """A node that reads a split value: once over all rows where e2e's kernel can run so
        (the cases below), else queued as twins for the next flush."""
        mod, full = self.module(node), self.full
        arg = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if isinstance(mod, _BatchNorm) and self.full_batch:
            self._bn_meet(node, mod, arg)
        elif (plain_conv(mod) and len(node.args) == 1 and not node.kwargs
              and self.feeds_fused_bn(node) and arg in full):
            # a convolution into a BN meet: once over all rows, as the BN's input
            self.flush()
            kept, out = self.call(conv_parts, (self.g.get_attr(str(node.target)), self.env[arg][0],
                                               full[arg]))
            self.set_full(node, kept, out)
        elif type(mod) is nn.Identity and arg in full and len(node.args) == 1:
            # e.g. timm's disabled drop_block and anti-aliasing layers: the value itself
            self.env[node], full[node] = self.env[arg], full[arg]
            if arg in self.owned and len(arg.users) == 1:
                self.owned.add(node)
        elif (_is_relu(node, self.gm) and arg in full) or (
                type(mod) is nn.MaxPool2d and not mod.return_indices and arg in full
                and len(node.args) == 1 and not node.kwargs):
            self._per_row_on_all(node, mod, arg)
        elif (_is_add(node) and len(node.users) == 1 and _is_relu(next(iter(node.users)), self.gm)
              and all(isinstance(a, fx.Node) and a in full for a in node.args)
              and node.args[0] is not node.args[1]):
            # a residual add and its ReLU over all rows at once (KeptRowsAddReLU)
            self.flush()
            a, b = node.args
            in_place = a in self.owned and len(a.users) == 1
            kept, out = self.call(add_relu_parts, (self.env[a][0], self.env[b][0], full[a], full[b],
                                                   in_place))
            self.set_full(next(iter(node.users)), kept, out)
        elif mod is not None and callable(getattr(mod, "lockstep_parts", None)):
            self.flush()
            x = self.env[arg]
            self.env[node] = self.call(module_parts, (self.g.get_attr(str(node.target)), x[0],
                                                      self.dropped_of(arg), self.rows))
            self.after_bn = False
        else:
            self.pending.append(node)
            self.env[node] = (node, node)  # a marker: split, emitted at the next flush

    def _bn_meet(self, node: fx.Node, mod: nn.Module, arg: fx.Node | None) -> None:
        """The meet: BN's training kernel once over all rows (the kept rows' graph beside it)."""
        if not _fusable_bn(mod) or len(node.args) != 1 or node.kwargs:
            raise _Unsupported(f"cannot fuse {type(mod).__name__}")
        self.flush()
        x = self.env[arg]
        whole = self.full.get(arg)
        if whole is None:  # the dropped block's last use
            whole = self.g.call_function(join_rows, (x[0], self.dropped_of(arg)))
        kept, out = self.call(batchnorm_parts, (self.g.get_attr(str(node.target)), x[0], whole,
                                                self.rows, _view_safe(node, self.gm)))
        self.set_full(node, kept, out)
        self.after_bn = True

    def _per_row_on_all(self, node: fx.Node, mod: nn.Module | None, arg: fx.Node) -> None:
        """A cheap per-row op (ReLU, max pool) of a value known on all rows: its kept rows with a
        graph, then all rows (in place where nothing else reads them), for the layers after it."""
        self.flush()
        g = self.g
        kept = g.create_node(node.op, node.target, (self.env[arg][0],), dict(node.kwargs))
        g.call_function(torch._C._set_grad_enabled, (False,))
        if mod is not None:  # a max pool, or a ReLU module (its hooks see both calls)
            out = g.call_module(str(node.target), (self.full[arg],))
        else:  # the kept rows read their input first: it may be a view of full[arg]
            in_place = arg in self.owned and len(arg.users) == 1
            out = g.call_function(torch.relu_ if in_place else torch.relu, (self.full[arg],))
        g.call_function(torch._C._set_grad_enabled, (True,))
        self.set_full(node, kept, out)


def lockstep_forward(twin: fx.GraphModule, x: torch.Tensor, rows: PartRows,
                     scale: float | None = None) -> torch.Tensor:
    """``backbone(x)`` for all rows of ``x (N, ...)`` in one pass of ``twin``
    (``lockstep_graph(backbone)``), with autograd only through ``rows.keep_rows``; ``scale``
    multiplies the kept rows' gradient. Returns ``(N, ...)`` in ``x``'s row order."""
    with torch.enable_grad():  # restores grad mode if the dropped part fails under no_grad
        kept, dropped = twin(x, rows)  # (n, ...), (N - n, ...)
    if not isinstance(kept, torch.Tensor):
        raise TypeError(f"lockstep SBP: the backbone returned {type(kept).__name__}, not a tensor")
    if scale is not None and scale != 1.0:
        kept = ScaleGrad.apply(kept, scale)
    out = torch.empty((rows.n_rows, *kept.shape[1:]), dtype=kept.dtype, device=kept.device,
                      memory_format=suggest_memory_format(kept))  # (N, ...), no graph
    out[rows.drop_rows] = dropped.to(kept.dtype)
    out[rows.keep_rows] = kept  # the result's graph holds the kept rows only
    return out


# ---------------------------------------------------------------------- under trainer.compile
MEETS = {take_rows, dropped_rows, join_rows, batchnorm_parts, conv_parts, add_relu_parts, module_parts}


def compiled_lockstep(twin: fx.GraphModule, compiler: Compiler) -> fx.GraphModule:
    """``twin`` (:func:`lockstep_graph`) under ``trainer.compile``, called the same way: its
    meets (:data:`MEETS`, and anything reading the rows) stay eager, since they hold Python
    state (the step's ``PartRows``, BN coefficients, in-place writes into their inputs); every
    run of twins between two meets is one compiled graph, the no-grad and the grad ones apart
    (``memory.compiled.split_regions``). The rows reach compiled code only as tensors and the
    kept count is fixed per run, so a run compiles once."""
    def is_meet(node: fx.Node) -> bool:
        return (node.op == "call_function" and node.target in MEETS) or any(
            n.op == "placeholder" and n.name == "rows" for n in node.all_input_nodes)

    return split_regions(twin, is_meet, compiler)
