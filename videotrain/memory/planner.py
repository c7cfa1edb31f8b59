"""Recomputation planning on a tensor DAG (Chen et al. 2016; Kusumoto et al., NeurIPS 2019).

A plan is a chain of lower sets ``0 = L0 < L1 < ... < Lk = V`` (bitmasks over ``Graph``
vertices). Block ``Vi = Li \\ L(i-1)`` is computed in order; every block but the last keeps only
its boundary ``Wi`` (vertices with a successor outside ``Li``) and is recomputed in backward.

Cost model. The paper charges block ``i`` ``sum_{j<i} M(Wj) + 2 M(Vi)`` (every tensor of the
block and its gradient, pulled). Under PyTorch autograd that is both too low and too high: too
low because autograd *pushes* gradients into earlier blocks' tensors at once (they wait there
until their block runs), too high because autograd keeps only the tensors some backward needs
(``Graph.saved``: a BN output that feeds a ReLU is freed in forward) and frees each vertex's
saved tensors and gradient as soon as its backward has run. So we simulate the block instead:

    peak_i   = sum_{j<i} M(Wj) + block_peak(L(i-1), L(i))
    block_peak = max(recompute scan, backward scan)
      recompute (or forward) scan, p ascending in Vi:
          grads already pushed into L(i)  +  saved bytes of Vi up to p
          + outputs not kept by autograd that still have a consumer to run (boundary: all)
      backward scan, p descending in Vi:
          saved bytes of Vi up to p  +  live gradients: those pushed into L(i) from later
          blocks, those of Vi's vertices with a consumer already run, p's and p's inputs'
    overhead = sum_{i<k} T(Vi) - T(Wi)                          (the last block is never recomputed)

This is an upper bound of the measured peak of activations and activation gradients on the test
models (parameter gradients are not activations and are left out) and within 25% of it.

The exact DP keeps, per lower set, the Pareto front of (overhead, retained memory); a
transition is admissible only if its block's peak fits the budget, so pruning dominated pairs
is exact. With ``buckets`` the overhead is quantized to ~``buckets`` distinct values (the
paper's trick to bound the front). Above ``cap`` lower sets, the family of lower sets is the
approximate one: ancestor closures plus prefixes of several topological orders.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from videotrain.memory.graph import Graph, articulation_points, lower_sets

# Scalars the model does not track (the loss and its gradient, step counters): a few bytes that
# would otherwise let a measured peak exceed an exact prediction.
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
    peak: float  # predicted peak, bytes
    overhead: float  # predicted recompute cost, in the graph's cost units

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


def block_peak(g: Graph, lower: int, upper: int) -> float:
    """Peak of recomputing (or first computing) and back-propagating block ``upper \\ lower``,
    on top of the boundaries retained from earlier blocks; see the module docstring. Cached."""
    key = (lower, upper)
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
    transient: dict[int, float] = {}  # outputs autograd does not keep -> bytes, until last use
    last_use = {}
    for v in verts:
        later = g.succ_mask[v]
        if later & ~upper or not later:  # feeds a later block (or is the output): kept to the end
            last_use[v] = g.n
        else:
            last_use[v] = (later & block).bit_length() - 1
    for p in verts:  # recompute (or first forward) of the block, pushed gradients waiting
        saved += g.saved[p]
        if not g.keeps[p]:
            transient[p] = g.mem[p]
        peak = max(peak, grads.bytes + saved + sum(transient.values()) + g.work_fwd[p])
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
        peak = max(peak, saved + grads.bytes + g.work_bwd[p])
        grads.leave(p)
        saved -= g.saved[p]
    peak += SCALAR_SLACK
    g.peak_cache[key] = peak
    return peak


def evaluate(g: Graph, chain: list[int]) -> tuple[float, float]:
    """(predicted peak, overhead) of a chain of lower sets ending at V."""
    retained = peak = overhead = 0.0
    prev = 0
    for i, s in enumerate(chain):
        block = s & ~prev
        peak = max(peak, retained + block_peak(g, prev, s))
        w = g.boundary(block, s)
        if i < len(chain) - 1:
            overhead += g.cost_of(block) - g.cost_of(w)
        retained += g.mem_of(w)
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
    """Least-overhead chain within ``sets`` whose predicted peak fits ``budget`` (None: none)."""
    quantum = (sum(g.cost) / buckets) if buckets else 0.0
    # front[L]: {overhead key: (retained, overhead, previous L, previous key)}
    front: dict[int, dict[float, tuple[float, float, int, float]]] = {0: {0.0: (0.0, 0.0, -1, 0.0)}}
    for a in sets:
        if a not in front or a == g.full:
            continue
        _prune(front[a])  # every transition into `a` is done: sets are sorted by size
        pareto = list(front[a].items())
        for b in sets:
            if b & a != a or b == a:
                continue
            block = b & ~a
            bp = block_peak(g, a, b)
            w = g.boundary(block, b)
            extra = 0.0 if b == g.full else g.cost_of(block) - g.cost_of(w)
            m_w = g.mem_of(w)
            for key, (ret, over, _, _) in pareto:
                if ret + bp > budget:
                    continue
                o = over + extra
                k = round(o / quantum) * quantum if quantum else o
                cur = front.setdefault(b, {}).get(k)
                if cur is None or ret + m_w < cur[0] or (ret + m_w == cur[0] and o < cur[1]):
                    front[b][k] = (ret + m_w, o, a, key)
    if g.full not in front:
        return None
    key, (_, _, prev, pkey) = min(front[g.full].items(), key=lambda kv: (kv[1][1], kv[1][0]))
    chain, s, k = [g.full], prev, pkey
    while s > 0:
        chain.append(s)
        _, _, s, k = front[s][k]
    chain.reverse()
    peak, overhead = evaluate(g, chain)
    return Plan(chain, peak, overhead)


def _prune(states: dict[float, tuple[float, float, int, float]]) -> None:
    """Drop Pareto-dominated (overhead, retained) pairs: same or more overhead, no less retained."""
    best = float("inf")
    for key, val in sorted(states.items(), key=lambda kv: (kv[1][1], kv[1][0])):
        if val[0] >= best:
            del states[key]
        else:
            best = val[0]


def min_peak(g: Graph, sets: list[int]) -> float:
    """Smallest predicted peak of any chain in ``sets`` (the smallest feasible budget).

    Exact DP with Pareto pruning on (peak so far, retained): future block peaks depend on the
    past only through the retained memory, so a pair dominated in both is never needed.
    """
    front: dict[int, list[tuple[float, float]]] = {0: [(0.0, 0.0)]}
    for a in sets:
        if a not in front or a == g.full:
            continue
        pairs, kept, best = sorted(front[a]), [], float("inf")
        for peak, ret in pairs:
            if ret < best:
                kept.append((peak, ret))
                best = ret
        for b in sets:
            if b & a != a or b == a:
                continue
            bp, m_w = block_peak(g, a, b), g.mem_of(g.boundary(b & ~a, b))
            front.setdefault(b, []).extend((max(peak, ret + bp), ret + m_w) for peak, ret in kept)
    return min(peak for peak, _ in front[g.full])


def plan(g: Graph, budget: float | None, objective: str = "time", cap: int = 500,
         buckets: int | None = None) -> tuple[Plan, float, bool]:
    """(plan, smallest feasible budget, exact family?) for ``budget`` bytes (None: the smallest).

    ``time``: least overhead within the budget. ``memory``: least peak (the smallest feasible
    budget), then least overhead there.
    """
    sets, exact = family(g, cap)
    buckets = buckets if buckets is not None else (None if g.n <= 16 else 5 * g.n)
    smallest = min_peak(g, sets)
    target = smallest * (1 + 1e-9) if budget is None or objective == "memory" else budget
    best = dp(g, target, sets, buckets)
    if best is None:
        raise InfeasibleBudget(target, smallest)
    if objective not in ("time", "memory"):
        raise ValueError(f"memory.objective must be time or memory, got {objective!r}")
    return best, smallest, exact


def brute_force(g: Graph, budget: float) -> float | None:
    """Least overhead over *all* chains of lower sets with peak <= budget (small graphs only)."""
    sets = [s for s in lower_sets(g) or [] if s]
    inner = [s for s in sets if s != g.full]
    best: float | None = None
    for r in range(len(inner) + 1):
        for combo in itertools.combinations(inner, r):
            if any(b & a != a for a, b in itertools.pairwise(combo)):
                continue
            peak, over = evaluate(g, [*combo, g.full])
            if peak <= budget and (best is None or over < best):
                best = over
    return best


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
    peak, overhead = evaluate(g, chain)
    return Plan(chain, peak, overhead)
