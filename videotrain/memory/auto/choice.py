"""``memory=auto``'s choice: one walk down the ranked candidates, with two ways to know a peak.

:func:`walk` takes the candidates in :func:`~videotrain.memory.auto.candidates.ranked` order
(expected accuracy, then estimated step time) and chooses the first whose peak fits the budget;
when none does it raises :class:`~videotrain.memory.auto.candidates.NoPlanFits` with the
smallest peak known. What tells a candidate's peak is the evaluator:

- :class:`MeasuredPeaks` (:func:`choose`; ``AutoStrategy.plan``): the peaks estimated from the e2e
  profile (``candidates.build_candidates``), and one profiling step for a plan that has no
  estimate when the walk reaches it, and (``verify``) for the plan about to be chosen.
- :class:`SimulatedPeaks` (:func:`choose_estimated`; ``AutoStrategy.plan_estimated``, with
  ``memory.budget_gb`` or on CUDA with no budget set): a real profiling step at full size can
  itself run out of memory, so each candidate reached is simulated on fake tensors instead
  (:func:`videotrain.memory.estimate.simulate_step`, in a process of its own, through
  ``videotrain.config.estimate``), its training step and validation forward together, as
  ``python -m videotrain.plan --fit GB`` estimates its rows. The first steps of training then
  verify the choice, as for a profiled plan (``AutoStrategy.observe_step``).

Simulated candidates (``candidates.estimated_candidates``) have no timings: nothing is timed,
so the ranking is expected accuracy (tier, then keep ratio), then the structural order of cost
(e2e before recomputation, recomputation plans from the largest planner budget down, plain SBP
before SBP with recomputation). Simulating all of them at full size would take minutes, so each
*family* (the same plan at falling keep ratios, or the recomputation plans at falling budgets)
is searched by bisection: its peak falls along the family, so the first member that fits is
found in ``log2(n)`` simulations, and the members before it are over budget by inference
(noted as such in the table).

Simulated peaks are on the trainer's ``train_peak_mem_mb`` scale (what a step adds to what is
held between steps: parameters, gradients, optimizer state), so the re-check compares like
with like: a candidate's peak is its larger of training step and validation forward, less what
e2e holds between steps; the budget is the usable device memory (``memory.budget_gb`` less the
CUDA context, less a share for what fake tensors cannot see), less the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from videotrain.memory.auto.candidates import Candidate, NoPlanFits, ranked, render_table

INFEASIBLE = "its plan is infeasible"  # how a recomputation plan below the planner's least is skipped


class Evaluator(Protocol):
    """How the walk learns whether a candidate fits, and what to say when none does."""

    def fits(self, c: Candidate, rest: list[Candidate]) -> bool:
        """Whether ``c`` fits the budget, noting why not on ``c``; ``rest``: ``c`` and the
        candidates ranked after it."""
        ...

    def no_plan_fits(self, cands: list[Candidate]) -> NoPlanFits:
        """The error for a walk that found nothing, with the smallest peak known."""
        ...


def walk(cands: list[Candidate], evaluator: Evaluator) -> Candidate:
    """The first plan in :func:`ranked` order that ``evaluator`` says fits, noted ``chosen``
    (the plans after it: not needed). Raises the evaluator's :class:`NoPlanFits` otherwise."""
    order = [c for c in ranked(cands) if not c.skip]
    for i, c in enumerate(order):
        if not evaluator.fits(c, order[i:]):
            continue
        c.note = "chosen"
        for later in order[i + 1:]:
            later.note = later.note or "not needed: a preferred plan fits"
        return c
    raise evaluator.no_plan_fits(cands)


class MeasuredPeaks:
    """Peaks estimated from the e2e profile, or measured: ``measure(c)`` runs one profiling
    step and sets ``c.measured_peak`` (or ``c.skip``), at most ``max_profiles`` times."""

    def __init__(self, budget: float, measure: Callable[[Candidate], None] | None = None,
                 verify: bool = True, max_profiles: int = 16) -> None:
        self.budget, self.measure, self.verify, self.max_profiles = budget, measure, verify, max_profiles
        self.calls = 0

    def _profiled(self, c: Candidate) -> bool:
        if self.measure is None or self.calls >= self.max_profiles or c.skip:
            return False
        self.calls += 1
        self.measure(c)
        return c.measured_peak is not None and not c.skip

    def fits(self, c: Candidate, rest: list[Candidate]) -> bool:
        if c.peak is None and not self._profiled(c):
            c.note = c.note or ("skipped: " + c.skip if c.skip else "not profiled (memory.max_profiles)")
            return False
        if c.peak > self.budget:
            c.note = "over budget" + (" (measured)" if c.measured_peak is not None else "")
            return False
        if self.verify and c.measured_peak is None:
            self._profiled(c)  # at the cap it stays unverified
            if c.skip:
                c.note = "skipped: " + c.skip
                return False
            if c.measured_peak is not None and c.measured_peak > self.budget:
                c.note = "over budget when measured"
                return False
        return True

    def no_plan_fits(self, cands: list[Candidate]) -> NoPlanFits:
        """The smallest budget that would work, measured where it can be."""
        while True:
            known = [c for c in cands if not c.skip and c.peak is not None]
            if not known:
                return NoPlanFits(self.budget, None, None, render_table(cands, self.budget))
            best = min(known, key=lambda c: c.peak)
            if not self.verify or best.measured_peak is not None or not self._profiled(best):
                return NoPlanFits(self.budget, best.peak, best.name, render_table(cands, self.budget))


class SimulatedPeaks:
    """Peaks simulated at full size: ``estimate(c)`` sets ``c.estimated_peak`` (or ``c.skip``),
    at most ``max_estimates`` times. On reaching a family not searched yet, the rest of it is
    bisected for its first member that fits; ``advice`` words the budget that would work in the
    caller's units."""

    def __init__(self, budget: float, estimate: Callable[[Candidate], None], max_estimates: int = 16,
                 advice: Callable[[float], str] | None = None) -> None:
        self.budget, self.estimate, self.max_estimates, self.advice = budget, estimate, max_estimates, advice
        self.calls = 0
        self.searched: set[tuple] = set()

    def _fits(self, c: Candidate) -> bool:
        if c.estimated_peak is None and not c.skip:
            if self.calls >= self.max_estimates:
                c.note = "not estimated (memory.max_profiles)"
                return False
            self.calls += 1
            self.estimate(c)
        if c.skip or c.estimated_peak is None:
            c.note = c.note or f"skipped: {c.skip}"
            return False
        if c.estimated_peak > self.budget:
            c.note = "over budget (estimated)"
            return False
        return True

    def fits(self, c: Candidate, rest: list[Candidate]) -> bool:
        key = family_key(c)
        if key not in self.searched:
            self.searched.add(key)
            _bisect([m for m in rest if family_key(m) == key], self._fits)
        if c.note or c.skip or c.estimated_peak is None or c.estimated_peak > self.budget:
            c.note = c.note or (f"skipped: {c.skip}" if c.skip else "over budget (estimated)"
                                if c.estimated_peak is not None else "not estimated (memory.max_profiles)")
            return False
        return True

    def no_plan_fits(self, cands: list[Candidate]) -> NoPlanFits:
        known = [c for c in cands if not c.skip and c.estimated_peak is not None]
        best = min(known, key=lambda c: c.estimated_peak, default=None)
        table = render_table(cands, self.budget)
        if best is None:
            return NoPlanFits(self.budget, None, None, table)
        return NoPlanFits(self.budget, best.estimated_peak, best.name, table,
                          advice=None if self.advice is None else self.advice(best.estimated_peak))


def choose(cands: list[Candidate], budget: float, measure: Callable[[Candidate], None] | None = None,
           verify: bool = True, max_profiles: int = 16) -> Candidate:
    """The first plan in :func:`ranked` order whose peak fits ``budget`` (bytes), profiling
    where there is no estimate and (``verify``) before choosing (:class:`MeasuredPeaks`). Raises
    :class:`NoPlanFits` with the smallest budget that would work (the least estimated peak,
    measured first where possible)."""
    return walk(cands, MeasuredPeaks(budget, measure, verify, max_profiles))


def choose_estimated(cands: list[Candidate], budget: float, estimate: Callable[[Candidate], None],
                     max_estimates: int = 16, advice: Callable[[float], str] | None = None) -> Candidate:
    """The first plan in :func:`ranked` order whose simulated peak fits ``budget`` (bytes),
    each family bisected (:class:`SimulatedPeaks`, at most ``max_estimates`` simulations). Raises
    :class:`NoPlanFits` with the smallest simulated peak."""
    return walk(cands, SimulatedPeaks(budget, estimate, max_estimates, advice))


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
