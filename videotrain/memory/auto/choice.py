"""``memory=auto``'s choice: one walk down the ranked candidates, each peak a fake-tensor estimate.

:func:`choose` takes the first candidate in ``ranked`` order whose need fits the budget, or
raises ``NoPlanFits`` with the smallest need estimated. Why bisect: an estimate is a full-size
step on fake tensors in a process of its own (seconds); along a *family* the need falls with the
rank, so its first member that fits is found in ``log2(n)`` estimates and the members before it
are over budget by inference. Invariant: a note in the table is never a guess presented as an
estimate (inferred notes say "inferred").
"""

from __future__ import annotations

from collections.abc import Callable

from videotrain.memory.auto.candidates import Candidate, NoPlanFits, ranked, render_table

INFEASIBLE = "its plan is infeasible"  # how a recomputation plan below the planner's least is skipped
MAX_ESTIMATES = 16  # estimates per walk: the family bisections need far fewer
CAPPED = "not estimated (the walk's cap)"


class Estimates:
    """``estimate(c)`` sets ``c.estimated_peak`` (or ``c.skip``), at most ``max_estimates``
    times; ``advice`` words the budget that would hold a need in the user's key."""

    def __init__(self, budget: float, estimate: Callable[[Candidate], object], max_estimates: int = MAX_ESTIMATES,
                 advice: Callable[[float], str] | None = None) -> None:
        self.budget, self.estimate, self.max_estimates, self.advice = budget, estimate, max_estimates, advice
        self.calls = 0
        self.searched: set[tuple] = set()

    def _fits(self, c: Candidate) -> bool:
        if c.estimated_peak is None and not c.skip:
            if self.calls >= self.max_estimates:
                c.note = CAPPED
                return False
            self.calls += 1
            self.estimate(c)
        if c.skip or c.need is None:
            c.note = c.note or f"skipped: {c.skip}"
            return False
        if c.need > self.budget:
            c.note = "over budget (estimated)"
            return False
        return True

    def fits(self, c: Candidate, rest: list[Candidate]) -> bool:
        """Whether ``c`` fits; on reaching a family not searched yet, bisect the rest of it
        (``rest``: ``c`` and the candidates ranked after it)."""
        key = family_key(c)
        if key not in self.searched:
            self.searched.add(key)
            _bisect([m for m in rest if family_key(m) == key], self._fits)
        return not c.note and self._fits(c)  # the bisection noted (or estimated) all before it

    def no_plan_fits(self, cands: list[Candidate]) -> NoPlanFits:
        known = [c for c in cands if not c.skip and c.need is not None]
        best = min(known, key=lambda c: c.need, default=None)
        table = render_table(cands, self.budget)
        if best is None or best.need is None:
            return NoPlanFits(self.budget, None, None, table)
        return NoPlanFits(self.budget, best.need, best.name, table,
                          advice=None if self.advice is None else self.advice(best.need))


def walk(cands: list[Candidate], estimates: Estimates) -> Candidate:
    """The first plan in :func:`ranked` order that fits, noted ``chosen`` (the plans after it:
    not needed). Raises :class:`NoPlanFits` otherwise."""
    order = [c for c in ranked(cands) if not c.skip]
    for i, c in enumerate(order):
        if not estimates.fits(c, order[i:]):
            continue
        c.note = "chosen"
        for later in order[i + 1:]:
            later.note = later.note or "not needed: a preferred plan fits"
        return c
    raise estimates.no_plan_fits(cands)


def choose(cands: list[Candidate], budget: float, estimate: Callable[[Candidate], object],
           max_estimates: int = MAX_ESTIMATES, advice: Callable[[float], str] | None = None) -> Candidate:
    """The first plan in :func:`ranked` order whose need fits ``budget`` (bytes), each family
    bisected. Raises :class:`NoPlanFits` with the smallest need estimated."""
    return walk(cands, Estimates(budget, estimate, max_estimates, advice))


def family_key(c: Candidate) -> tuple:
    """Candidates that differ only in keep ratio (or recomputation budget) share a family."""
    fixed = {k: v for k, v in c.params.items() if k not in ("keep_ratio", "budget_frac", "objective")}
    return (c.kind, c.tier, tuple(sorted((k, str(v)) for k, v in fixed.items())))


def _bisect(family: list[Candidate], fits: Callable[[Candidate], bool]) -> None:
    """Find the first member of ``family`` (peaks falling along it) that fits, by bisection;
    note the members before it that were not estimated as over budget by inference. A member
    that yields no figure (skipped, e.g. a recomputation budget below the planner's least, or
    past the estimate cap) says nothing about its neighbours: it leaves the search."""
    fam = list(family)
    lo, hi = 0, len(fam)  # fam[:lo] are over budget; fam[hi] fits (or hi is the end)
    while lo < hi:
        mid = (lo + hi) // 2
        ok = fits(fam[mid])
        if not ok and fam[mid].estimated_peak is None:
            gone = [fam[mid]]
            if (fam[mid].skip or "").startswith(INFEASIBLE):  # smaller planner budgets are too
                gone += [m for m in fam[mid + 1:hi] if "budget_frac" in m.params]
                for m in gone[1:]:
                    m.skip = f"{INFEASIBLE} (inferred: {fam[mid].name}'s is)"
            fam = [m for m in fam if m not in gone]
            hi -= len(gone)
        elif ok:
            hi = mid
        else:
            lo = mid + 1
    for j, m in enumerate(fam[:lo]):
        if m.estimated_peak is None and not m.note:
            # fam[lo - 1] was estimated over budget, and needs less than every member before it
            over = next(x for x in fam[j + 1:lo] if x.estimated_peak is not None)
            m.note = f"over budget (inferred: {over.name} is over and needs less)"
