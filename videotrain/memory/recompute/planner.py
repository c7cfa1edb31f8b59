"""Recomputation planning on a tensor DAG (Chen et al. 2016; Kusumoto et al., NeurIPS 2019).

A plan is a chain of lower sets ``0 = L0 < L1 < ... < Lk = V`` (bitmasks over ``Graph``
vertices); block ``Vi = Li \\ L(i-1)`` keeps only its boundary and is recomputed in backward.
Each block's peak is simulated as PyTorch autograd runs it (gradients pushed into earlier
blocks at once, saved tensors freed after their backward, retained boundaries alive only until
their first consumer's recompute), not charged by the paper's formula. The exact DP keeps, per
state (lower set, dormant boundaries), the Pareto front of (overhead, live retained memory);
above ``cap`` lower sets the family is approximate. The estimate upper-bounds the measured peak
of activations and their gradients; the tests hold it within 25%. Derivation:
docs/design/internals.md#the-recompute-planners-cost-model."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from videotrain.memory.recompute.graph import Graph, articulation_points, lower_sets

# Scalars the model does not track (the loss and its gradient, step counters): a few bytes that
# would otherwise let a measured peak exceed an exact estimate.
SCALAR_SLACK = 4096.0


class InfeasibleBudget(ValueError):
    """No plan fits the budget; ``min_budget`` is the smallest budget with a plan."""

    def __init__(self, budget: float, min_budget: float) -> None:
        super().__init__(
            f"memory budget {budget / 2**20:.3f} MiB is infeasible; the smallest feasible budget "
            f"for this backbone and input shape is {min_budget / 2**20:.3f} MiB "
            f"(memory.budget_mb={min_budget / 2**20:.3f})"
        )
        self.budget, self.min_budget = budget, min_budget


@dataclass
class Plan:
    chain: list[int]  # lower sets L1..Lk (bitmasks), Lk = V
    peak: float  # estimated peak, bytes
    overhead: float  # estimated recompute cost, in the graph's cost units

    def blocks(self) -> list[int]:
        prev, out = 0, []
        for s in self.chain:
            out.append(s & ~prev)
            prev = s
        return out


class _Gradients:
    """Live activation gradients grouped by storage: add, cat and views hand their inputs views
    of their own gradient, so one storage can hold several vertices' gradients."""

    def __init__(self, g: Graph) -> None:
        self.group: dict[int, tuple[str, int]] = {}  # vertex -> storage key
        self.refs: dict[tuple[str, int], list[float]] = {}  # key -> [bytes, holders]
        self.bytes = 0.0

    def join(self, v: int, key: tuple[str, int], nbytes: float) -> None:
        entry = self.refs.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            entry[0] = max(entry[0], nbytes)
            self.bytes += entry[0]
        entry[1] += 1
        self.group[v] = key

    def leave(self, v: int) -> None:
        entry = self.refs[self.group.pop(v)]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]


def _last_use(g: Graph, verts: list[int], upper: int) -> dict[int, int]:
    """Per vertex of a block (and its inputs): the last block vertex that reads it; ``g.n``
    for outputs that feed a later block (or are the graph output): kept to the block's end."""
    block = sum(1 << v for v in verts)
    last: dict[int, int] = {}
    for v in verts:
        later = g.succ_mask[v]
        last[v] = g.n if later & ~upper or not later else (later & block).bit_length() - 1
    return last


def forward_scan(g: Graph, lower: int, upper: int) -> float:
    """Peak of a checkpointed block's first forward: outputs live until their last use (boundary
    outputs to the end), no saved tensors (checkpoint drops them), nothing pushed yet. Cached."""
    key = ("fwd", lower, upper)
    if key in g.peak_cache:
        return g.peak_cache[key]
    verts = list(g.members(upper & ~lower))
    last = _last_use(g, verts, upper)
    live: dict[int, float] = {}
    peak = 0.0
    for p in verts:
        live[p] = g.mem[p]
        peak = max(peak, sum(live.values()) + g.work_fwd[p])
        for u in [u for u in live if last[u] <= p]:
            del live[u]
    g.peak_cache[key] = peak
    return peak


def block_peak(g: Graph, lower: int, upper: int, dying: int = 0) -> float:
    """Peak of recomputing (or first computing) and back-propagating block ``upper \\ lower``,
    on top of the retained boundaries still live; ``dying``: earlier boundaries whose last
    consumer backward reaches is this block (live through the recompute, through the backward
    too if autograd keeps them). See the module docstring. Cached."""
    key = (lower, upper, dying)
    if key in g.peak_cache:
        return g.peak_cache[key]
    block = upper & ~lower
    verts = list(g.members(block))  # ascending = topological
    grads = _Gradients(g)
    for v in g.members(g.boundary(upper, upper)):  # pushed into L(upper) by later blocks
        later = g.succ_mask[v] & ~upper
        c = later.bit_length() - 1
        if later & (later - 1) == 0 and g.grad_alias[c]:
            grads.join(v, ("view", c), g.mem[c])  # a view of the consumer's gradient
        else:
            grads.join(v, ("own", v), g.mem[v])  # accumulated from several: its own storage
    peak, saved = 0.0, 0.0
    # dying inputs: the caller holds a segment's arguments for its whole (re)computation;
    # afterwards only the ones some consumer saved (``keeps``: conservatively, all backward)
    passed = g.mem_of(dying)
    held = sum(g.mem[w] for w in g.members(dying) if g.keeps[w])
    last_use = _last_use(g, verts, upper)
    transient: dict[int, float] = {}  # outputs autograd does not keep -> bytes, until last use
    for p in verts:  # recompute (or first forward) of the block, pushed gradients waiting
        saved += g.saved[p]
        if not g.keeps[p]:
            transient[p] = g.mem[p]
        peak = max(peak, grads.bytes + passed + saved + sum(transient.values()) + g.work_fwd[p])
        for u in [u for u in transient if last_use[u] <= p]:
            del transient[u]
    for p in reversed(verts):  # backward through the block
        if p not in grads.group:  # the output: its gradient comes from the head
            grads.join(p, ("own", p), g.mem[p])
        for u in g.members(g.pred_mask[p]):
            if u in grads.group:  # accumulated: a new tensor replaces the old one
                grads.leave(u)
                grads.join(u, ("own", u), g.mem[u])
            elif g.grad_alias[p]:
                grads.join(u, grads.group[p], 0.0)
            else:
                grads.join(u, ("own", u), g.mem[u])
        peak = max(peak, held + saved + grads.bytes + g.work_bwd[p])
        grads.leave(p)
        saved -= g.saved[p]
    peak += SCALAR_SLACK
    g.peak_cache[key] = peak
    return peak


def step(g: Graph, lower: int, upper: int, dormant: int) -> tuple[float, float, int, float]:
    """One block of a chain, given the dormant boundaries before it: (its peak on top of the
    live retained bytes, bytes that join the live retained, the dormant set after it, its
    recompute cost).

    A checkpointed block whose ops save nothing (views, adds, dropout with p=0) is never
    recomputed: nothing asks for its tensors in backward, so its inputs are not held for it and
    it costs no recompute."""
    key = ("step", lower, upper, dormant)
    if key in g.peak_cache:
        return g.peak_cache[key]  # type: ignore[return-value]
    block = upper & ~lower
    inputs = 0
    for v in g.members(block):
        inputs |= g.pred_mask[v]
    inputs &= ~block
    last = upper == g.full
    holds = last or any(g.saves[v] for v in g.members(block))
    dying = dormant & inputs if holds else 0
    peak = block_peak(g, lower, upper, dying)
    if not last:  # the checkpointed first forward holds every retained boundary
        peak = max(peak, g.mem_of(dormant) + forward_scan(g, lower, upper) + SCALAR_SLACK)
    cost = (g.cost_of(block) - g.cost_of(free_boundary(g, block, upper)) + g.segment_cost
            if holds and not last else 0.0)
    # still dormant: not yet held by a consumer, and with a consumer to come (a tensor whose
    # consumers all ran without holding it is gone once the forward has passed it)
    after = ((dormant & ~dying) | g.boundary(block, upper)) & g.boundary(upper, upper)
    out = (peak, g.mem_of(dying), after, cost)
    g.peak_cache[key] = out  # type: ignore[assignment]
    return out


def free_boundary(g: Graph, block: int, upper: int) -> int:
    """Boundary vertices of ``block`` its recompute runs no kernel for (``execute.py`` hands
    autograd a placeholder): no consumer inside the block, and the op saves neither its output
    nor internals (``Graph.free``: a conv, a linear, an add), so nothing in backward reads the
    recomputed value. Any other boundary op is recomputed like the block's inner ops, since
    ``torch.utils.checkpoint`` replays a segment up to its last saved tensor."""
    return sum(1 << v for v in g.members(g.boundary(block, upper))
               if g.free[v] and not g.succ_mask[v] & block)


def chain_cost(g: Graph, chain: list[int]) -> tuple[float, float]:
    """(estimated peak, overhead) of a chain of lower sets ending at V."""
    live = peak = overhead = 0.0
    prev = dormant = 0
    for s in chain:
        bp, joins, dormant, cost = step(g, prev, s, dormant)
        peak = max(peak, live + bp)
        overhead += cost
        live += joins
        prev = s
    return peak, overhead


def approximate_family(g: Graph, orders: int = 4, seed: int = 0) -> list[int]:
    """0, V, every ancestor closure, and the prefixes of ``orders`` topological orders."""
    fam = {0, g.full} | {g.ancestors(v) for v in range(g.n)}
    rng = random.Random(seed)
    for k in range(orders):
        done, order = 0, []
        while len(order) < g.n:
            ready = [v for v in range(g.n) if not done >> v & 1 and g.pred_mask[v] & ~done == 0]
            v = ready[0] if k == 0 else ready[-1] if k == 1 else rng.choice(ready)
            order.append(v)
            done |= 1 << v
            fam.add(done)
    return sorted(fam, key=lambda s: (s.bit_count(), s))


def family(g: Graph, cap: int = 500) -> tuple[list[int], bool]:
    """(lower sets, exact?): all lower sets if at most ``cap`` exist, else the approximate family."""
    sets = lower_sets(g, cap)
    return (sets, True) if sets is not None else (approximate_family(g), False)


def dp(g: Graph, budget: float, sets: list[int], buckets: int | None = None) -> Plan | None:
    """Least-overhead chain within ``sets`` whose estimated peak fits ``budget`` (None: none).

    States are (lower set, dormant boundaries); per state the Pareto front of (overhead, live
    retained bytes). A transition is admissible only if its block's peak fits the budget, and
    future peaks depend on the past only through the state and the retained bytes, so pruning
    dominated pairs is exact."""
    quantum = (sum(g.cost) / buckets) if buckets else 0.0
    # front[(L, D)]: {overhead key: (retained, overhead, previous state, previous key)}
    front: dict[tuple[int, int], dict[float, tuple[float, float, tuple[int, int] | None, float]]] = {
        (0, 0): {0.0: (0.0, 0.0, None, 0.0)}}
    dormants: dict[int, set[int]] = {0: {0}}
    for a in sets:
        if a == g.full:
            continue
        for d in sorted(dormants.get(a, ())):
            state = (a, d)
            _prune(front[state])  # every transition into `a` is done: sets are sorted by size
            pareto = list(front[state].items())
            for b in sets:
                if b & a != a or b == a:
                    continue
                bp, joins, nd, extra = step(g, a, b, d)
                for key, (ret, over, _, _) in pareto:
                    if ret + bp > budget:
                        continue
                    o = over + extra
                    k = round(o / quantum) * quantum if quantum else o
                    nxt = front.setdefault((b, nd), {})
                    dormants.setdefault(b, set()).add(nd)
                    cur = nxt.get(k)
                    if cur is None or ret + joins < cur[0] or (ret + joins == cur[0] and o < cur[1]):
                        nxt[k] = (ret + joins, o, state, key)
    ends = front.get((g.full, 0))
    if not ends:
        return None
    key, (_, _, prev, pkey) = min(ends.items(), key=lambda kv: (kv[1][1], kv[1][0]))
    chain = [g.full]
    while prev is not None and prev[0] > 0:
        chain.append(prev[0])
        _, _, prev, pkey = front[prev][pkey]
    chain.reverse()
    peak, overhead = chain_cost(g, chain)
    return Plan(chain, peak, overhead)


def _prune(states: dict[float, tuple]) -> None:
    """Drop Pareto-dominated (overhead, retained) pairs: same or more overhead, no less retained."""
    best = float("inf")
    for key, val in sorted(states.items(), key=lambda kv: (kv[1][1], kv[1][0])):
        if val[0] >= best:
            del states[key]
        else:
            best = val[0]


def min_peak(g: Graph, sets: list[int]) -> float:
    """Smallest estimated peak of any chain in ``sets`` (the smallest feasible budget).

    Exact DP over (lower set, dormant boundaries) with Pareto pruning on (peak so far, live
    retained): future block peaks depend on the past only through those, so a pair dominated in
    both is never needed.
    """
    front: dict[tuple[int, int], list[tuple[float, float]]] = {(0, 0): [(0.0, 0.0)]}
    dormants: dict[int, set[int]] = {0: {0}}
    for a in sets:
        if a == g.full:
            continue
        for d in sorted(dormants.get(a, ())):
            pairs, kept, best = sorted(front[(a, d)]), [], float("inf")
            for peak, ret in pairs:
                if ret < best:
                    kept.append((peak, ret))
                    best = ret
            for b in sets:
                if b & a != a or b == a:
                    continue
                bp, joins, nd, _ = step(g, a, b, d)
                dormants.setdefault(b, set()).add(nd)
                front.setdefault((b, nd), []).extend((max(peak, ret + bp), ret + joins) for peak, ret in kept)
    return min(peak for peak, _ in front[(g.full, 0)])


# Answers by graph content: memory=auto plans the same backbone graph at several budgets, then
# plans each recompute candidate again when it measures it, and each search takes seconds on a
# ResNet-50's graph (pure Python). Bounded; a key is a few thousand numbers.
_MEMO: OrderedDict[tuple, Any] = OrderedDict()
_MEMO_SIZE = 64


def graph_key(g: Graph) -> tuple:
    """Everything the planner reads of ``g``, as a hashable value (equal graphs, equal keys)."""
    return (tuple(g.names), tuple(tuple(p) for p in g.preds), tuple(g.mem), tuple(g.cost),
            tuple(g.saved or ()), tuple(g.keeps or ()), tuple(g.work_fwd or ()),
            tuple(g.work_bwd or ()), tuple(g.grad_alias or ()), tuple(g.saves or ()),
            tuple(g.free or ()), g.segment_cost)


def _memo(key: tuple, compute: Callable[[], Any]) -> Any:
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    value = _MEMO[key] = compute()
    if len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return value


def plan(g: Graph, budget: float | None, objective: str = "time", cap: int = 500,
         buckets: int | None = None) -> tuple[Plan, float, bool]:
    """(plan, smallest feasible budget, exact?) for ``budget`` bytes (None: the smallest).

    ``time``: least overhead within the budget. ``memory``: least peak (the smallest feasible
    budget), then least overhead there. Exact means optimal within the cost model: every lower
    set enumerated (at most ``cap``) and no cost rounding. Above 16 vertices (every real
    backbone) the overheads are rounded into ``5n`` buckets by default, which keeps planning
    fast but may choose a plan that recomputes slightly more than the optimum
    (docs/memory.md says by how much); such a plan is not exact.
    """
    sets, exact = family(g, cap)
    buckets = buckets if buckets is not None else (None if g.n <= 16 else 5 * g.n)
    exact = exact and buckets is None
    gk = graph_key(g)
    smallest = _memo(("min_peak", gk, cap), lambda: min_peak(g, sets))
    target = smallest * (1 + 1e-9) if budget is None or objective == "memory" else budget
    best = _memo(("dp", gk, cap, target, buckets), lambda: dp(g, target, sets, buckets))
    best = None if best is None else Plan(list(best.chain), best.peak, best.overhead)  # callers' own
    if best is None:
        raise InfeasibleBudget(target, smallest)
    return best, smallest, exact


def sqrt_plan(g: Graph, segments: int | None = None) -> Plan:
    """Chen et al.: ~sqrt(n) segments cut at articulation points, balanced by memory."""
    cuts = articulation_points(g)
    k = segments or max(1, round(g.n ** 0.5))
    cum, total, acc = {}, sum(g.mem), 0.0
    for v in range(g.n):
        acc += g.mem[v]
        cum[v] = acc
    chosen: list[int] = []
    for j in range(1, k):
        target = total * j / k
        options = [c for c in cuts if not chosen or c > chosen[-1]]
        if options:
            chosen.append(min(options, key=lambda c: abs(cum[c] - target)))
    chain = sorted({(1 << (c + 1)) - 1 for c in chosen} | {g.full})
    peak, overhead = chain_cost(g, chain)
    return Plan(chain, peak, overhead)
