"""``memory=recompute``: recomputation (Chen et al. 2016; Kusumoto et al., NeurIPS 2019).

Every frame runs with autograd as in e2e but only some activations are kept; the rest are
recomputed in backward. Gradients, loss and BN running statistics equal e2e's. Policies
(``memory.policy``): ``blocks`` (each of ``backbone.blocks()`` under non-reentrant
checkpoint), ``sqrt`` (Chen: ~sqrt(n) segments at articulation points of the fx graph) and
``optimal`` (Kusumoto's lower-set plan for ``budget_mb`` / ``budget_frac``, ``objective`` time
or memory; an infeasible budget raises ``InfeasibleBudget`` naming the smallest feasible).
Graph plans split the out-of-place traced graph into segments, planned lazily per input shape,
dtype and device; BN running stats update once (``execute.py``). SBP composes with these
policies through ``kept_path``. Details: docs/design/internals.md#recompute-policies."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from videotrain.memory.base import FrameFeatures, StatelessStrategy, all_positions, set_clip_length
from videotrain.memory.compiled import compiled_forward
from videotrain.memory.recompute.costs import check_cost_model, check_profile_name, profile_for
from videotrain.memory.recompute.execute import (
    BoundarySkips,
    RecomputedForward,
    RecomputedSegment,
    boundary_begin,
    boundary_end,
    wrap_forward,
)
from videotrain.memory.recompute.graph import Graph, trace
from videotrain.memory.recompute.planner import (
    Plan,
    chain_cost,
    family,
    free_boundary,
    plan,
    sqrt_plan,
)

POLICIES = ("blocks", "sqrt", "optimal")
OBJECTIVES = ("time", "memory")


class Recompute(StatelessStrategy):
    """The recomputation strategy; see the module docstring for policies and guarantees.

    A config sets the policy, the budget, the objective and ``segments``. The planner's own
    switches are arguments set in code only (tests, the bench): ``lower_set_cap`` (exact DP up
    to this many lower sets), ``cost_model`` (``roofline``, ``measured`` or ``flops``),
    ``device_profile`` (``auto`` or a name of ``costs.PROFILES``) and ``segment_cost_us`` (host
    time per recomputed segment; ``None``: the profile's)."""

    name = "recompute"  # results.json's "strategy" (the bench's row names keep checkpoint-*)

    def __init__(
        self,
        policy: str = "blocks",
        budget_mb: float | None = None,
        budget_frac: float | None = None,
        objective: str = "time",
        lower_set_cap: int = 500,
        segments: int | None = None,
        cost_model: str = "roofline",
        device_profile: str = "auto",
        segment_cost_us: float | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"memory.policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if objective not in OBJECTIVES:
            raise ValueError(f"memory.objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
        if budget_mb is not None and budget_frac is not None:
            raise ValueError("set at most one of memory.budget_mb and memory.budget_frac")
        if budget_frac is not None and not 0 < budget_frac:
            raise ValueError(f"memory.budget_frac must be > 0, got {budget_frac}")
        if segment_cost_us is not None and segment_cost_us < 0:
            raise ValueError(f"segment_cost_us must be >= 0, got {segment_cost_us}")
        self.cost_model = check_cost_model(cost_model)
        self.device_profile = check_profile_name(device_profile)
        self.segment_cost_us = segment_cost_us
        self.policy = policy
        self.budget_mb = budget_mb
        self.budget_frac = budget_frac
        self.objective = objective
        self.lower_set_cap = int(lower_set_cap)
        self.segments = segments
        self._runners: dict[tuple, fx.GraphModule] = {}
        self._compiler: Any = None  # trainer.compile: segments compiled as they are built
        self.last_report: dict[str, Any] | None = None  # the plan of the last shape, for inspection

    # ------------------------------------------------------------------ setup
    def prepare(self, backbone: nn.Module) -> nn.Module:
        """``blocks``: wrap each block's forward once, in place; graph policies plan lazily.

        Graph policies refuse a backbone with active drop-path (stochastic depth): its random
        fills are traced as graph nodes, and their masks are not yet shown to match e2e's
        (docs/recipes.md); per-block recomputation replays them through torch.utils.checkpoint."""
        if self.policy != "blocks":
            drop = [n for n, m in backbone.named_modules() if float(getattr(m, "drop_prob", 0) or 0) > 0]
            if drop:
                raise ValueError(f"memory.policy={self.policy} does not support drop-path yet "
                                 f"({len(drop)} active modules, e.g. {drop[0]}); use "
                                 "memory.policy=blocks or model.backbone.drop_path_rate=0")
        if self.policy == "blocks":
            if not callable(getattr(backbone, "blocks", None)):
                raise TypeError("memory.policy=blocks needs a backbone with .blocks()")
            for block in backbone.blocks():
                wrap_forward(block)
        return backbone

    def compile(self, backbone: nn.Module, compiler: Any) -> None:
        """``trainer.compile``: what each checkpoint runs is compiled inside it, never the
        checkpoint call itself (a graph break there would run the region eagerly): ``blocks``
        each block's forward, which evaluation runs too (the stem between blocks stays eager);
        ``sqrt``/``optimal`` every segment of a plan as it is built, without the boundary-op
        skip (it watches dispatched ops, which compiled code does not show), and the backbone
        for evaluation."""
        self._compiler = compiler
        self._runners.clear()
        if self.policy == "blocks":
            for block in backbone.blocks():
                wrapped = block.__dict__.get("forward")
                if isinstance(wrapped, RecomputedForward):
                    wrapped.compiled = compiled_forward(block, wrapped.original, compiler)
        else:
            compiler(backbone)

    # ------------------------------------------------------------------ planning
    def make_plan(self, backbone: nn.Module, frames: torch.Tensor) -> tuple[fx.GraphModule, Graph, Plan, dict]:
        """Trace ``backbone`` for ``frames (N, C, H, W)`` and plan; returns the report too."""
        profile = profile_for(frames.device, self.device_profile)
        gm, g, index = trace(backbone, frames, self.cost_model, profile)
        if self.segment_cost_us is not None and self.cost_model != "flops":
            g.segment_cost = self.segment_cost_us * 1e-6
        e2e_peak = chain_cost(g, [g.full])[0]
        sets, exact_family = family(g, self.lower_set_cap)
        if self.policy == "sqrt":
            chosen = sqrt_plan(g, self.segments)
            smallest, exact = None, False  # a rule, not a search
        else:
            budget = self.budget_bytes(e2e_peak)
            chosen, smallest, exact = plan(g, budget, self.objective, cap=self.lower_set_cap)
        report = {
            "policy": self.policy,
            "input_shape": list(frames.shape),
            "vertices": g.n,
            "lower_sets": len(sets),
            "exact_family": exact_family,  # every lower set enumerated
            "exact": exact,  # optimal within the cost model (no cost rounding either)
            "e2e_peak_bytes": e2e_peak,
            "estimated_peak_bytes": chosen.peak,
            "estimated_overhead": chosen.overhead,
            "overhead_frac_of_forward": chosen.overhead / max(sum(g.cost), 1e-12),
            "cost_model": self.cost_model,
            "device_profile": profile.name if self.cost_model != "flops" else None,
            "segment_cost_s": g.segment_cost,
            "forward_cost": sum(g.cost),  # seconds (roofline, measured) or FLOPs
            "checkpointed_segments": len(chosen.chain) - 1,
            "smallest_feasible_bytes": smallest,
            "budget_bytes": None if self.policy == "sqrt" else self.budget_bytes(e2e_peak),
            "segments": [
                {
                    "nodes": [g.names[v] for v in g.members(block)],
                    "kept": [g.names[v] for v in g.members(g.boundary(block, s))] if s != g.full else "all",
                    "bytes": g.mem_of(block),
                }
                for block, s in zip(chosen.blocks(), chosen.chain, strict=True)
            ],
        }
        return gm, g, chosen, {**report, "_index": index}

    def budget_bytes(self, e2e_peak: float) -> float | None:
        if self.budget_mb is not None:
            return float(self.budget_mb) * 2**20
        if self.budget_frac is not None:
            return float(self.budget_frac) * e2e_peak
        return None

    def _runner(self, backbone: nn.Module, frames: torch.Tensor) -> fx.GraphModule:
        key = (tuple(frames.shape), tuple(frames.stride()), frames.dtype, frames.device, id(backbone))
        if key not in self._runners:
            with torch.no_grad():
                gm, g, chosen, report = self.make_plan(backbone, frames)
            index = report.pop("_index")
            self._runners[key] = build_runner(gm, g, chosen, index, self._compiler)
            self.last_report = report
        return self._runners[key]

    def kept_path(self, backbone: nn.Module, frames: torch.Tensor) -> Any:
        """The recomputed function for ``frames (N, C, H, W)`` of this shape (SBP's kept
        frames): the backbone itself for ``blocks`` (its blocks are wrapped), else the plan's
        split graph. Planned outside any SBP BN phase, on a detached copy of the rows."""
        if self.policy == "blocks":
            return backbone
        with torch.no_grad():
            return self._runner(backbone, frames.detach())

    # ------------------------------------------------------------------ training forward
    def encode(self, backbone: nn.Module, video: torch.Tensor) -> FrameFeatures:
        """``video (B, T, C, H, W) -> features (B, T, D)`` at positions ``(B, T)``."""
        b, t = video.shape[:2]
        frames = video.flatten(0, 1)  # (B*T, C, H, W)
        set_clip_length(backbone, t)  # kept until the recompute in backward (temporal shift)
        if self.policy == "blocks":
            feats = backbone(frames)
        else:
            feats = self._runner(backbone, frames)(frames)  # (B*T, D)
        return FrameFeatures(feats.view(b, t, -1), all_positions(video))

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "policy": self.policy,
            "budget_mb": self.budget_mb,
            "budget_frac": self.budget_frac,
            "objective": self.objective,
            "cost_model": self.cost_model,
        }


def build_runner(gm: fx.GraphModule, g: Graph, chosen: Plan, index: dict[str, int],
                 compiler: Any = None) -> fx.GraphModule:
    """Split ``gm`` into the plan's blocks and recompute every block but the last; with a
    ``compiler`` (``Recompute.compile``) every block is compiled, inside its checkpoint.

    Vertices go to their block; contracted non-tensor nodes (shapes, sizes) go to the latest
    block among their inputs, which every consumer's block is at or after.
    """
    block_of = {}
    for i, block in enumerate(chosen.blocks()):
        for v in g.members(block):
            block_of[v] = i
    part: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.name in index:
            part[node.name] = block_of[index[node.name]]
        else:
            part[node.name] = max((part.get(n.name, 0) for n in node.all_input_nodes), default=0)
    split = split_module(gm, gm, lambda node: part.get(node.name, 0))
    names = sorted(
        (n for n, _ in split.named_children() if n.startswith("submod_")), key=lambda n: int(n.split("_")[1])
    )
    blocks = chosen.blocks()
    for i, name in enumerate(names[:-1]):
        segment = getattr(split, name)
        if compiler is not None:
            setattr(split, name, RecomputedSegment(compiler(segment)))
            continue
        free = free_boundary(g, blocks[i], chosen.chain[i])
        tags = bracket_free_boundary(segment, {g.names[v] for v in g.members(free)})
        setattr(split, name, RecomputedSegment(segment, BoundarySkips(tags) if tags else None))
    if compiler is not None:
        compiler(getattr(split, names[-1]))
    return split


def bracket_free_boundary(segment: fx.GraphModule, names: set[str]) -> list[str]:
    """Bracket the segment's nodes named in ``names`` (free boundary ops, read only by the
    segment's output) with ``execute.boundary_begin``/``boundary_end``, so that their recompute
    runs no kernel; returns the bracketed names."""
    graph = segment.graph
    tags = []
    for node in list(graph.nodes):
        if node.name not in names or any(u.op != "output" for u in node.users):
            continue
        with graph.inserting_before(node):
            graph.call_function(boundary_begin, (node.name,))
        with graph.inserting_after(node):
            end = graph.call_function(boundary_end, (node.name, node))
        node.replace_all_uses_with(end, delete_user_cb=lambda user, end=end: user is not end)
        tags.append(node.name)
    if tags:
        graph.lint()
        segment.recompile()
    return tags
