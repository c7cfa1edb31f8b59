"""``memory=auto``'s candidate plans, their ranking and the decision table.

The plans that trade memory for accuracy or time are few and known (e2e, recomputation at
planner budgets, SBP keep ratios ``k/T``, with a recomputed kept path or frozen BN, frame
dropout when allowed); each is a ``memory:`` node a run could be given. A candidate's peak is
the fake-tensor estimate of its step (``choice.py``); what it *needs* is that estimate plus the
share fake tensors cannot see (``UNSEEN_FRAC``). Ranking: expected accuracy first (a tier, then
the keep ratio), then :func:`relative_cost`. Invariant: along a family (one plan at falling keep
ratios or planner budgets) the rank order is the order of falling memory, which the bisection
relies on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from videotrain.memory.estimate import UNSEEN_FRAC
from videotrain.memory.recompute.planner import InfeasibleBudget

MB = 2**20
TIER_EXACT, TIER_SBP, TIER_SBP_FROZEN, TIER_DROPOUT = 0, 1, 2, 3
TIER_NAMES = {TIER_EXACT: "exact (e2e gradients)", TIER_SBP: "sbp", TIER_SBP_FROZEN: "sbp, frozen BN",
              TIER_DROPOUT: "frame dropout"}
FORWARD_SHARE = 1 / 3  # a forward's share of a training step (the backward costs about two)
RECOMPUTE_FRACS = (0.9, 0.75, 0.6, 0.5, 0.4)  # planner budgets of the recompute candidates
SBP_RECOMPUTE = "blocks"  # the kept path's recomputation of the SBP + recompute candidates


@dataclass(eq=False)
class Candidate:
    """One plan: the strategy (``kind``, ``params``), its expected accuracy and its estimate."""

    name: str
    kind: str  # e2e | recompute | sbp | sbp_recompute | frame_dropout
    params: dict[str, Any]
    tier: int
    keep_ratio: float = 1.0
    estimated_peak: float | None = None  # bytes, the trainer's train_peak_mem_mb scale
    skip: str | None = None  # why it is not a candidate here
    note: str = ""  # what the decision made of it
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the estimate's device figures

    @property
    def need(self) -> float | None:
        """What the plan needs of the budget (bytes): its estimate and the share not seen."""
        return None if self.estimated_peak is None else self.estimated_peak * (1 + UNSEEN_FRAC)

    def rank_key(self) -> tuple:
        return (self.tier, -self.keep_ratio, relative_cost(self), self.name)

    def to_dict(self) -> dict[str, Any]:
        def mb(x: float | None) -> float | None:
            return None if x is None else round(x / MB, 3)

        return {"name": self.name, "kind": self.kind, "params": self.params, "tier": self.tier,
                "accuracy": TIER_NAMES[self.tier], "keep_ratio": self.keep_ratio,
                "relative_cost": round(relative_cost(self), 3), "estimated_peak_mb": mb(self.estimated_peak),
                "need_mb": mb(self.need), "skip": self.skip, "note": self.note, **self.extra}


def relative_cost(c: Candidate) -> float:
    """A step's cost relative to e2e's, for the ranking alone: a forward is about a third of a step,
    so SBP at ``r`` does ``(1 + 2r)/3`` of e2e's work, frame dropout ``r``, and recomputation adds
    up to one forward (SBP + recompute: one)."""
    r = c.keep_ratio
    if c.kind == "e2e":
        return 1.0
    if c.kind == "recompute":  # the planner's budget: the less memory, the more recomputed
        return 1.0 + FORWARD_SHARE * (1.0 - c.params.get("budget_frac", 0.0))
    if c.kind == "frame_dropout":
        return r
    sbp = (1 + 2 * r) / 3
    return sbp + FORWARD_SHARE if c.kind == "sbp_recompute" else sbp  # record/apply's extra forward


def round_up(x: float, digits: int = 1) -> float:
    """``x`` rounded up to ``digits`` decimals (advice never names a budget that falls short)."""
    return math.ceil(round(x * 10**digits, 6)) / 10**digits  # float noise does not round up


class NoPlanFits(InfeasibleBudget):
    """No candidate fits the budget; ``min_budget`` is the smallest budget that would work."""

    def __init__(self, budget: float, min_budget: float | None, smallest: str | None, table: str,
                 advice: str | None = None) -> None:
        if min_budget is None:
            hint = "no candidate could be estimated"
        else:
            advice = advice or f"set memory.budget_mb={round_up(min_budget / MB):.1f} or more"
            hint = f"the smallest budget that would work is {min_budget / MB:.1f} MB ({smallest}): {advice}"
        ValueError.__init__(self, f"memory=auto: no plan fits the budget of {budget / MB:.1f} MB; {hint}\n{table}")
        self.budget, self.min_budget, self.smallest = budget, min_budget, smallest


@dataclass
class Options:
    """What the user allows and how the subset plans are configured (configs/memory/auto.yaml)."""

    allow_frame_dropout: bool = False
    allow_frozen_bn: bool = True
    sampler: str = "uniform"
    seed: int = 0
    sbp_recompute_error: str | None = None  # why SBP + recompute cannot run on this backbone


def keep_counts(num_frames: int) -> list[int]:
    """Frames kept per clip for the subset plans: every ``k`` from ``T-1`` down to 1."""
    return list(range(num_frames - 1, 0, -1))


def build_candidates(num_frames: int, has_batchnorm: bool, opt: Options) -> list[Candidate]:
    """Every candidate, none estimated yet. Recomputation plans are planner specs (the planner
    plans each inside its estimate), from the largest budget down to the least-memory plan;
    every node is one the strategy's config accepts (the strategies' defaults elsewhere)."""
    cands = [Candidate("e2e", "e2e", {}, TIER_EXACT)]
    for f in sorted(RECOMPUTE_FRACS, reverse=True):
        cands.append(Candidate(f"recompute optimal (budget_frac={f:g})", "recompute",
                               {"policy": "optimal", "budget_frac": f, "objective": "time"}, TIER_EXACT))
    cands.append(Candidate("recompute optimal (least memory)", "recompute",
                           {"policy": "optimal", "objective": "memory"}, TIER_EXACT))
    common = {"sampler": opt.sampler, "seed": opt.seed}
    for k in keep_counts(num_frames):
        r = k / num_frames
        cands.append(Candidate(f"sbp r={r:.3f}", "sbp", {"keep_ratio": r, "bn_policy": "full_batch", **common},
                               TIER_SBP, r))
        cands.append(Candidate(f"sbp+recompute r={r:.3f}", "sbp_recompute",
                               {"keep_ratio": r, "bn_policy": "full_batch", "recompute": SBP_RECOMPUTE, **common},
                               TIER_SBP, r, skip=opt.sbp_recompute_error))
        if has_batchnorm:
            cands.append(Candidate(f"sbp r={r:.3f} bn=frozen", "sbp",
                                   {"keep_ratio": r, "bn_policy": "frozen", **common}, TIER_SBP_FROZEN, r,
                                   skip=None if opt.allow_frozen_bn else
                                   "sbp with frozen BN: not allowed (memory.allow_frozen_bn=false)"))
        cands.append(Candidate(f"frame_dropout r={r:.3f}", "frame_dropout",
                               {"keep_ratio": r, "sampler": opt.sampler, "seed": opt.seed}, TIER_DROPOUT, r,
                               skip=None if opt.allow_frame_dropout else "frame dropout: not allowed, it "
                               "changes what the head sees (memory.allow_frame_dropout=false)"))
    return cands


def ranked(cands: list[Candidate]) -> list[Candidate]:
    return sorted(cands, key=Candidate.rank_key)


def reason(chosen: Candidate, cands: list[Candidate], budget: float) -> str:
    """Why ``chosen``, in one sentence for the log and results.json."""
    assert chosen.need is not None
    fits = f"needs {chosen.need / MB:.1f} MB <= budget {budget / MB:.1f} MB"
    if chosen.kind == "e2e":
        return f"e2e fits ({fits}): exact gradients and no extra compute"
    better = [c for c in cands if not c.skip and c.rank_key() < chosen.rank_key() and c.need is not None]
    closest = min(better, key=lambda c: c.need, default=None)
    why_not = (f"no plan with better expected accuracy fits (the smallest of those estimated, {closest.name}, "
               f"needs {closest.need / MB:.1f} MB)" if closest else "no preferred plan fits")
    what = {"recompute": "exact gradients at the least recompute that fits",
            "sbp": f"the largest keep ratio that fits (r={chosen.keep_ratio:.3f})",
            "sbp_recompute": f"the largest keep ratio that fits (r={chosen.keep_ratio:.3f}), with recomputation",
            "frame_dropout": f"frame dropout allowed, largest keep ratio that fits (r={chosen.keep_ratio:.3f})"}
    return f"{chosen.name} ({fits}): {what[chosen.kind]}; {why_not}"


def render_table(cands: list[Candidate], budget: float, chosen: Candidate | None = None) -> str:
    """The decision as a markdown table in ranking order, for the log, the CLI and results.json."""
    lines = [f"memory budget {budget / MB:.1f} MB (per-step peak, as train_peak_mem_mb)", "",
             "| # | plan | expected accuracy | estimated peak MB | + headroom MB | relative cost | outcome |",
             "|---|---|---|---|---|---|---|"]

    def mb(x: float | None) -> str:
        return "–" if x is None else f"{x / MB:.1f}"

    rows = [c for c in ranked(cands) if c.note or not c.skip]
    for i, c in enumerate(rows):
        outcome = c.note or (f"skipped: {c.skip}" if c.skip else "")
        lines.append(f"| {i + 1} | {c.name} | {TIER_NAMES[c.tier]} | {mb(c.estimated_peak)} | {mb(c.need)} | "
                     f"{relative_cost(c):.2f} | " + (f"**{outcome}**" if c is chosen else outcome) + " |")
    lines += [f"(not considered: {s})" for s in sorted({c.skip for c in cands if c.skip and not c.note})]
    return "\n".join(lines)
