"""Recomputation planning on a tensor DAG (Chen et al. 2016; Kusumoto et al., NeurIPS 2019).

A plan is a chain of lower sets ``0 = L0 < L1 < ... < Lk = V`` (bitmasks over ``Graph``
vertices). Block ``Vi = Li \\ L(i-1)`` is computed in order; every block but the last keeps only
its boundary ``Wi`` (vertices with a successor outside ``Li``) and is recomputed in backward.

Cost model (why push-aware): PyTorch autograd *pushes* gradients into a block's earlier inputs
at once, so the paper's pull-style per-block peak can be exceeded; we use

    peak_i = sum_{j<i} M(Wj) + 2 M(Vi) + M(∂(L(i-1)))        (push-aware)
    overhead = sum_{i<k} T(Vi) - T(Wi)                          (the last block is never recomputed)

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
    peak: float  # predicted push-aware peak, bytes
    overhead: float  # predicted recompute cost, in the graph's cost units

    def blocks(self) -> list[int]:
        prev, out = 0, []
        for s in self.chain:
            out.append(s & ~prev)
            prev = s
        return out


def evaluate(g: Graph, chain: list[int]) -> tuple[float, float]:
    """(push-aware peak, overhead) of a chain of lower sets ending at V."""
    retained = peak = overhead = 0.0
    prev = 0
    for i, s in enumerate(chain):
        block = s & ~prev
        peak = max(peak, retained + 2 * g.mem_of(block) + g.mem_of(g.boundary(prev, prev)))
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
    """Least-overhead chain within ``sets`` whose push-aware peak fits ``budget`` (None: none)."""
    quantum = (sum(g.cost) / buckets) if buckets else 0.0
    # front[L]: {overhead key: (retained, overhead, previous L, previous key)}
    front: dict[int, dict[float, tuple[float, float, int, float]]] = {0: {0.0: (0.0, 0.0, -1, 0.0)}}
    bnd = {s: g.mem_of(g.boundary(s, s)) for s in sets}
    for a in sets:
        if a not in front or a == g.full:
            continue
        _prune(front[a])  # every transition into `a` is done: sets are sorted by size
        pareto = list(front[a].items())
        for b in sets:
            if b & a != a or b == a:
                continue
            block = b & ~a
            m_block = g.mem_of(block)
            w = g.boundary(block, b)
            extra = 0.0 if b == g.full else g.cost_of(block) - g.cost_of(w)
            m_w = g.mem_of(w)
            for key, (ret, over, _, _) in pareto:
                if ret + 2 * m_block + bnd[a] > budget:
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
    """Smallest push-aware peak of any chain in ``sets`` (the smallest feasible budget).

    Exact DP with Pareto pruning on (peak so far, retained): future block peaks depend on the
    past only through the retained memory, so a pair dominated in both is never needed.
    """
    bnd = {s: g.mem_of(g.boundary(s, s)) for s in sets}
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
            block = b & ~a
            m_block, m_w = g.mem_of(block), g.mem_of(g.boundary(block, b))
            front.setdefault(b, []).extend(
                (max(peak, ret + 2 * m_block + bnd[a]), ret + m_w) for peak, ret in kept
            )
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
