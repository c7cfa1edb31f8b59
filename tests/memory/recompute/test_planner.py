"""The recomputation planner on small random DAGs: exact DP == brute force over lower-set chains."""

from __future__ import annotations

import itertools
import random

import pytest

from videotrain.memory.recompute.graph import Graph, articulation_points, lower_sets
from videotrain.memory.recompute.planner import (
    InfeasibleBudget,
    approximate_family,
    chain_cost,
    dp,
    min_peak,
    plan,
    sqrt_plan,
)


def random_dag(n: int, seed: int, p: float = 0.3) -> Graph:
    rng = random.Random(seed)
    preds = []
    for v in range(n):
        ps = [u for u in range(v) if rng.random() < p]
        if v and not ps:
            ps = [v - 1]
        preds.append(ps)
    mem = [float(rng.randint(1, 6)) for _ in range(n)]
    cost = [float(rng.randint(1, 5)) for _ in range(n)]
    return Graph([f"v{i}" for i in range(n)], preds, mem, cost)


def chain(n: int) -> Graph:
    return Graph([f"v{i}" for i in range(n)], [[i - 1] if i else [] for i in range(n)], [1.0] * n, [1.0] * n)


def brute_force(g: Graph, budget: float) -> float | None:
    """Least overhead over *all* chains of lower sets with peak <= budget (small graphs only):
    the oracle of the planner's DP."""
    sets = [s for s in lower_sets(g) or [] if s]
    inner = [s for s in sets if s != g.full]
    best: float | None = None
    for r in range(len(inner) + 1):
        for combo in itertools.combinations(inner, r):
            if any(b & a != a for a, b in itertools.pairwise(combo)):
                continue
            peak, over = chain_cost(g, [*combo, g.full])
            if peak <= budget and (best is None or over < best):
                best = over
    return best


def is_lower(g: Graph, s: int) -> bool:
    return all(g.pred_mask[v] & ~s == 0 for v in g.members(s))


def brute_lower_sets(g: Graph) -> set[int]:
    return {s for s in range(1 << g.n) if is_lower(g, s)}


@pytest.mark.parametrize("seed", range(6))
def test_lower_sets_match_brute_force(seed: int) -> None:
    g = random_dag(8, seed)
    assert set(lower_sets(g)) == brute_lower_sets(g)
    assert all(is_lower(g, s) for s in approximate_family(g))


def test_chain_has_n_plus_1_lower_sets_and_cap() -> None:
    assert len(lower_sets(chain(10))) == 11
    assert lower_sets(random_dag(12, 0, p=0.05), cap=5) is None


@pytest.mark.parametrize("seed", range(8))
def test_exact_dp_equals_brute_force(seed: int) -> None:
    g = random_dag(6, seed)
    sets = lower_sets(g)
    top = chain_cost(g, [g.full])[0]
    smallest = min_peak(g, sets)
    # the smallest feasible budget is the least peak over all chains
    chains_peaks = [
        chain_cost(g, [*c, g.full])[0]
        for r in range(len(sets))
        for c in itertools.combinations([s for s in sets if s not in (0, g.full)], r)
        if all(b & a == a for a, b in itertools.pairwise(c))
    ]
    assert smallest == pytest.approx(min(chains_peaks))
    for budget in {smallest, (smallest + top) / 2, top, smallest - 0.5}:
        want = brute_force(g, budget)
        got = dp(g, budget, sets)
        if want is None:
            assert got is None
        else:
            assert got is not None and got.overhead == pytest.approx(want)
            assert got.peak <= budget + 1e-9
            assert chain_cost(g, got.chain) == (got.peak, got.overhead)


def test_no_budget_pressure_means_no_recompute() -> None:
    g = random_dag(7, 3)
    p, _, exact = plan(g, budget=1e12)
    assert exact and p.overhead == 0 and p.chain == [g.full]


def test_infeasible_budget_names_the_smallest() -> None:
    g = random_dag(7, 4)
    smallest = min_peak(g, lower_sets(g))
    with pytest.raises(InfeasibleBudget, match="smallest feasible budget") as err:
        plan(g, budget=smallest * 0.5)
    assert err.value.min_budget == pytest.approx(smallest)


def test_memory_objective_reaches_the_smallest_peak() -> None:
    g = random_dag(8, 5)
    p, smallest, _ = plan(g, budget=None, objective="memory")
    assert p.peak == pytest.approx(smallest)
    fast, _, _ = plan(g, budget=chain_cost(g, [g.full])[0], objective="time")
    assert fast.overhead <= p.overhead


def test_sqrt_plan_on_a_chain_cuts_about_sqrt_n_segments() -> None:
    g = chain(16)
    assert articulation_points(g) == list(range(15))
    p = sqrt_plan(g)
    assert len(p.chain) == 4 and p.chain[-1] == g.full
    assert p.peak < chain_cost(g, [g.full])[0]


def test_articulation_points_skip_parallel_branches() -> None:
    # 0 -> {1, 2} -> 3 -> 4: only 0 and 3 cut every path
    g = Graph(list("abcde"), [[], [0], [0], [1, 2], [3]], [1.0] * 5, [1.0] * 5)
    assert articulation_points(g) == [0, 3]


@pytest.mark.parametrize("seed", range(4))
def test_approximate_family_is_never_better_than_exact(seed: int) -> None:
    g = random_dag(9, seed, p=0.2)
    exact, approx = lower_sets(g), approximate_family(g)
    assert set(approx) <= set(exact)
    budget = (min_peak(g, exact) + chain_cost(g, [g.full])[0]) / 2
    best, rough = dp(g, budget, exact), dp(g, budget, approx)
    assert best is not None
    assert rough is None or rough.overhead >= best.overhead - 1e-9


def test_cap_switches_to_the_approximate_family() -> None:
    g = random_dag(10, 1, p=0.15)
    p, _, exact = plan(g, budget=None, cap=3)
    assert not exact and p.chain[-1] == g.full


def test_a_block_that_saves_nothing_is_never_recomputed() -> None:
    """Adds and views save nothing: a checkpointed block of them is never recomputed, so it
    costs no overhead and does not hold its input (which stays out of the live retained)."""
    names, preds = [f"v{i}" for i in range(5)], [[], [0], [1], [2], [3]]
    mem, cost = [4.0, 4.0, 4.0, 4.0, 1.0], [1.0, 2.0, 3.0, 5.0, 1.0]
    chain_ = [0b00011, 0b01111, 0b11111]  # {v0, v1} | {v2, v3} | {v4}
    saving = Graph(names, preds, mem, cost)
    silent = Graph(names, preds, mem, cost, saves=[True, True, False, False, True])
    assert chain_cost(saving, chain_)[1] == 1.0 + 3.0  # each block recomputes all but its boundary
    assert chain_cost(silent, chain_)[1] == 1.0  # the middle block is never recomputed
    assert chain_cost(silent, chain_)[0] <= chain_cost(saving, chain_)[0]


def random_chain(n: int, seed: int) -> Graph:
    rng = random.Random(seed)
    return Graph([f"v{i}" for i in range(n)], [[i - 1] if i else [] for i in range(n)],
                 [float(rng.randint(1, 64)) for _ in range(n)],
                 [float(rng.randint(1, 50)) for _ in range(n)])


def test_rounded_costs_make_a_plan_approximate_and_it_says_so() -> None:
    """Above 16 vertices ``plan`` rounds overheads into 5n buckets: its plan never beats the
    unrounded DP's, sometimes recomputes more, and is reported as not exact; up to 16 vertices
    it is the exact DP's and says so."""
    misses = 0
    for seed in range(32):
        g = random_chain(17 + seed % 14, seed)
        sets = lower_sets(g)
        smallest, top = min_peak(g, sets), chain_cost(g, [g.full])[0]
        budget = smallest + (top - smallest) * random.Random(seed).random() * 0.5
        best = dp(g, budget, sets)  # no rounding: the optimum over a chain's n+1 lower sets
        rounded, _, exact = plan(g, budget)
        assert not exact and rounded.overhead >= best.overhead - 1e-9
        misses += rounded.overhead > best.overhead + 1e-9
    assert misses > 0  # the flag is not idle: rounding does lose on some of these chains
    g = random_chain(16, 0)
    sets = lower_sets(g)
    budget = min_peak(g, sets) * 1.2
    small, _, exact = plan(g, budget)
    assert exact and small.overhead == pytest.approx(dp(g, budget, sets).overhead)


def test_planning_an_equal_graph_again_reuses_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """memory=auto plans one backbone graph at several budgets, then again per measured
    candidate: an equal graph (a new object, same content) reuses min_peak and the budgeted
    DP; the caller gets its own plan; a changed graph or budget is searched afresh."""
    import videotrain.memory.recompute.planner as planner

    g = random_dag(9, seed=3)
    budget = 1.2 * min_peak(g, lower_sets(g))  # some recomputation needed
    calls = {"min_peak": 0, "dp": 0}
    for name in calls:
        real = getattr(planner, name)

        def counted(*a, _name=name, _real=real, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(planner, name, counted)
    monkeypatch.setattr(planner, "_MEMO", type(planner._MEMO)())
    first, smallest, _ = plan(g, budget)
    first.chain.append(-1)  # a caller's edit must not reach the next caller
    again, smallest2, _ = plan(random_dag(9, seed=3), budget)
    assert calls == {"min_peak": 1, "dp": 1}
    assert (again.chain, again.peak, smallest2) == (first.chain[:-1], first.peak, smallest)
    plan(g, 1.5 * budget)  # another budget: the DP again, min_peak remembered
    assert calls == {"min_peak": 1, "dp": 2}
    changed = random_dag(9, seed=3)
    changed.cost[4] += 1.0
    plan(changed, 2 * budget)
    assert calls == {"min_peak": 2, "dp": 3}
