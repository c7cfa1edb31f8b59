"""``memory=auto``'s candidates, ranking and walk on synthetic estimates: bisection per family,
inference noted as such, infeasible recomputation budgets, the estimate cap, ``NoPlanFits``."""

from __future__ import annotations

import pytest

from videotrain.memory.auto.candidates import (
    MB,
    TIER_DROPOUT,
    TIER_EXACT,
    TIER_SBP,
    TIER_SBP_FROZEN,
    Candidate,
    NoPlanFits,
    Options,
    build_candidates,
    keep_counts,
    ranked,
    reason,
    relative_cost,
    render_table,
)
from videotrain.memory.auto.choice import INFEASIBLE, choose
from videotrain.memory.estimate import UNSEEN_FRAC
from videotrain.memory.recompute.planner import InfeasibleBudget

T = 16
HEADROOM = 1 + UNSEEN_FRAC


def peak_mb(c: Candidate) -> float:
    """Synthetic estimates that fall along every family: e2e 100, recompute 100 x its budget
    fraction (least memory 40), sbp 20 + 80 r (recomputed kept path: 10 + 60 r), frozen BN 5 + 80 r,
    frame dropout 80 r."""
    if c.kind == "e2e":
        return 100.0
    if c.kind == "recompute":
        return 40.0 if "budget_frac" not in c.params else 100 * c.params["budget_frac"]
    r = c.keep_ratio
    if c.kind == "sbp_recompute":
        return 10 + 60 * r
    if c.kind == "frame_dropout":
        return 80 * r
    return (5 if c.params.get("bn_policy") == "frozen" else 20) + 80 * r


class FakeEstimate:
    """Sets ``peak_mb`` as the estimate; planner budgets below ``infeasible_below`` are
    infeasible, as the recomputation planner says; counts the calls."""

    def __init__(self, infeasible_below: float = 0.0) -> None:
        self.calls: list[str] = []
        self.infeasible_below = infeasible_below

    def __call__(self, c: Candidate) -> None:
        self.calls.append(c.name)
        if c.params.get("budget_frac", 1.0) < self.infeasible_below:
            c.skip = f"{INFEASIBLE} (below the least)"
            return
        c.estimated_peak = peak_mb(c) * MB


def cands(has_bn: bool = True, **opts) -> list[Candidate]:
    return build_candidates(T, has_bn, Options(**opts))


def by_name(cs: list[Candidate]) -> dict[str, Candidate]:
    return {c.name: c for c in cs}


def budget(need_mb: float) -> float:
    """The budget (bytes) at which a plan estimated at ``need_mb / HEADROOM`` just fits."""
    return need_mb * MB


# ---------------------------------------------------------------------- candidates and ranking
def test_candidates_are_specs_without_figures() -> None:
    cs = cands()
    assert cs[0].name == "e2e" and all(c.estimated_peak is None and c.need is None for c in cs)
    ckpt = [c.params.get("budget_frac") for c in cs if c.kind == "recompute"]
    assert ckpt == [0.9, 0.75, 0.6, 0.5, 0.4, None]  # from the least recompute down
    assert {c.keep_ratio for c in cs if c.kind == "sbp"} == {k / T for k in range(1, T)}
    assert keep_counts(4) == [3, 2, 1] and keep_counts(1) == []
    assert by_name(cs)["frame_dropout r=0.500"].skip  # not allowed by default
    assert not [c for c in cands(has_bn=False) if c.tier == TIER_SBP_FROZEN]
    assert all(c.skip for c in cands(allow_frozen_bn=False) if c.tier == TIER_SBP_FROZEN)
    skipped = cands(sbp_recompute_error="the shift mixes frames")
    assert {c.skip for c in skipped if c.kind == "sbp_recompute"} == {"the shift mixes frames"}


def test_need_is_the_estimate_plus_what_fake_tensors_do_not_see() -> None:
    c = Candidate("x", "e2e", {}, TIER_EXACT, estimated_peak=50 * MB)
    assert c.need == pytest.approx(50 * MB * HEADROOM)


def test_ranking_is_expected_accuracy_then_relative_cost() -> None:
    order = ranked(cands(allow_frame_dropout=True))
    names = [c.name for c in order]
    assert names[:7] == ["e2e", *[f"recompute optimal (budget_frac={f:g})" for f in (0.9, 0.75, 0.6, 0.5, 0.4)],
                         "recompute optimal (least memory)"]
    assert names[7:9] == ["sbp r=0.938", "sbp+recompute r=0.938"]  # same accuracy: the cheaper first
    tiers = [c.tier for c in order]
    assert tiers == sorted(tiers) and tiers[0] == TIER_EXACT and tiers[-1] == TIER_DROPOUT
    sbp = [c.keep_ratio for c in order if c.tier == TIER_SBP]
    assert sbp == sorted(sbp, reverse=True)  # larger keep ratio = better expected accuracy


def test_relative_costs_are_the_constants_of_the_docstring() -> None:
    named = by_name(cands(allow_frame_dropout=True))
    assert relative_cost(named["e2e"]) == 1.0
    assert relative_cost(named["recompute optimal (budget_frac=0.9)"]) == pytest.approx(1 + 0.1 / 3)
    assert relative_cost(named["recompute optimal (least memory)"]) == pytest.approx(4 / 3)
    assert relative_cost(named["sbp r=0.500"]) == pytest.approx(1 / 3 + 2 / 3 * 0.5)
    assert relative_cost(named["sbp+recompute r=0.500"]) == pytest.approx(1 / 3 + 2 / 3 * 0.5 + 1 / 3)
    assert relative_cost(named["frame_dropout r=0.500"]) == 0.5


# ---------------------------------------------------------------------- the walk
def test_e2e_fits_with_one_estimate() -> None:
    cs, estimate = cands(), FakeEstimate()
    chosen = choose(cs, budget(120), estimate)
    assert chosen.name == "e2e" and estimate.calls == ["e2e"]
    assert all(c.note.startswith("not needed") for c in cs if c is not chosen and not c.skip)


def test_e2e_just_over_with_its_headroom_does_not_fit() -> None:
    """100 MB estimated needs 110: a 109 MB budget takes the next plan."""
    chosen = choose(cands(), budget(109), FakeEstimate())
    assert chosen.name == "recompute optimal (budget_frac=0.9)"  # 90 x 1.1 = 99


def test_bisection_finds_the_largest_keep_ratio_in_log_estimates() -> None:
    cs, estimate = cands(), FakeEstimate()
    # recompute >= 40 MB (44 with headroom); sbp 20 + 80 r: (20 + 80 r) 1.1 <= 41.8 up to
    # r = 3/16; sbp+recompute (10 + 60 r) 1.1 <= 41.8 up to r = 7/16: it wins on expected accuracy
    chosen = choose(cs, budget(41.8), estimate)
    assert chosen.name == "sbp+recompute r=0.438" and chosen.tier == TIER_SBP
    assert len(estimate.calls) <= 1 + 3 + 2 * 4  # e2e, the 6 plans, 2 families of 15 members
    named = by_name(cs)
    assert named["sbp+recompute r=0.500"].note.startswith("over budget")
    assert "inferred" in named["sbp r=0.938"].note  # never estimated, over by inference
    assert named["sbp r=0.938"].estimated_peak is None
    for c in cs:  # every estimate the walk made is a real one, noted truthfully
        if c.need is not None:
            assert (c.need <= budget(41.8)) == (c.note in ("chosen", "not needed: a preferred plan fits", ""))


def test_recompute_plans_below_the_planners_least_are_skipped_not_inferred_over() -> None:
    cs, estimate = cands(), FakeEstimate(infeasible_below=0.7)
    chosen = choose(cs, budget(88), estimate)  # 0.75 fits (82.5), 0.6 and lower are infeasible
    assert chosen.name == "recompute optimal (budget_frac=0.75)"
    assert by_name(cs)["recompute optimal (budget_frac=0.4)"].skip.startswith(INFEASIBLE)
    # the least-memory plan is never infeasible: an infeasible fraction does not rule it out
    cs, estimate = cands(), FakeEstimate(infeasible_below=0.95)
    assert choose(cs, budget(50), estimate).name == "recompute optimal (least memory)"
    assert "recompute optimal (budget_frac=0.4)" not in estimate.calls  # inferred infeasible


def test_frozen_bn_after_every_full_batch_plan_and_frame_dropout_only_when_allowed() -> None:
    # no sbp+recompute; below sbp's least (25 x 1.1 = 27.5) only frozen BN ((5 + 80 r) 1.1 <= 20
    # up to r = 2/16) or frame dropout fits
    off = {"sbp_recompute_error": "not in this test"}
    assert choose(cands(**off), budget(20), FakeEstimate()).name == "sbp r=0.125 bn=frozen"
    with pytest.raises(NoPlanFits):
        choose(cands(**off, allow_frozen_bn=False), budget(20), FakeEstimate())
    chosen = choose(cands(**off, allow_frozen_bn=False, allow_frame_dropout=True), budget(20), FakeEstimate())
    assert chosen.name == "frame_dropout r=0.188"  # 80 r x 1.1 <= 20 up to r = 3/16


def test_nothing_fits_names_the_smallest_need_and_the_advice() -> None:
    cs = cands()
    with pytest.raises(NoPlanFits) as err:
        choose(cs, budget(1), FakeEstimate(), max_estimates=100, advice=lambda need: f"ADVICE {need / MB:.1f}")
    assert isinstance(err.value, InfeasibleBudget) and isinstance(err.value, ValueError)
    # the smallest: frozen BN at r = 1/16, 5 + 5 = 10 MB estimated, 11 with headroom
    assert err.value.smallest == "sbp r=0.062 bn=frozen"
    assert err.value.min_budget == pytest.approx(11 * MB)
    text = str(err.value)
    assert "smallest budget that would work is 11.0 MB (sbp r=0.062 bn=frozen): ADVICE 11.0" in text
    assert "| e2e |" in text  # the table comes with it


def test_estimate_cap() -> None:
    cs, estimate = cands(), FakeEstimate()
    with pytest.raises(NoPlanFits):
        choose(cs, budget(30), estimate, max_estimates=3)
    assert len(estimate.calls) == 3
    assert any(c.note == "not estimated (the walk's cap)" for c in cs)


def test_table_and_reason() -> None:
    cs = cands()
    chosen = choose(cs, budget(41.8), FakeEstimate())
    table = render_table(cs, budget(41.8), chosen)
    assert "| 1 | e2e | exact (e2e gradients) | 100.0 | 110.0 | 1.00 | over budget (estimated) |" in table
    assert "| sbp+recompute r=0.438 |" in table and "**chosen**" in table
    assert "not considered: frame dropout: not allowed" in table  # and why
    why = reason(chosen, cs, budget(41.8))
    assert "largest keep ratio that fits (r=0.438), with recomputation" in why
    assert "needs" in why  # names the smallest of the better plans estimated
