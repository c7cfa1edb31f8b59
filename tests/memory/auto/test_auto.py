"""``memory=auto``: predictions, ranking and choice on synthetic profiles (no timing, no
measuring), the strategy's plan / re-check / step-down / resume with a fake probe, and the run
integration (results.json ``memory_plan``, failing before training)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import videotrain.run as run
from videotrain.engine.precision import Precision
from videotrain.memory.auto.candidates import (
    TIER_DROPOUT,
    TIER_EXACT,
    TIER_SBP,
    TIER_SBP_FROZEN,
    Candidate,
    NoPlanFits,
    Options,
    build_candidates,
    dropout_peak,
    keep_counts,
    ranked,
    render_table,
    sbp_peak,
    sbp_time,
)
from videotrain.memory.auto.choice import choose
from videotrain.memory.auto.profile import MB, Profile, ProfiledStep
from videotrain.memory.auto.strategy import AutoStrategy
from videotrain.memory.base import MemoryStrategy, SelfPlanning, StepObserver
from videotrain.memory.recompute.planner import InfeasibleBudget
from videotrain.memory.recompute.strategy import Recompute
from videotrain.memory.sbp.strategy import StochasticBackprop
from videotrain.models.backbones import resnet
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier


def profile(**kw) -> Profile:
    """A synthetic e2e profile: peak 100 MB = 82 MB saved (80 backbone) + 18 MB overhead."""
    base = dict(batch_size=2, num_frames=8, e2e_peak=100 * MB, saved_total=82 * MB,
                saved_backbone=80 * MB, input_bytes=2 * MB, nograd_peak=40 * MB, fwd_s=1.0,
                bwd_s=2.0, opt_s=0.1, backbone_fwd_s=0.9, has_batchnorm=True, held_growth=10 * MB)
    return Profile(**{**base, **kw})


CKPT = [  # two recomputation plans as the caller plans them: less recompute first
    {"params": {"policy": "optimal", "budget_frac": 0.6}, "name": "ckpt-a", "overhead_frac": 0.1},
    {"params": {"policy": "optimal", "objective": "memory"}, "name": "ckpt-b", "overhead_frac": 0.4},
]


def cands(p: Profile | None = None, **opts) -> list[Candidate]:
    return build_candidates(p or profile(), CKPT, Options(**opts))


def by_name(cs: list[Candidate]) -> dict[str, Candidate]:
    return {c.name: c for c in cs}


class FakeMeasure:
    """Stands in for a profiling step: peaks (MB) by candidate name, else the prediction x
    ``scale``; counts the calls."""

    def __init__(self, peaks: dict[str, float] | None = None, scale: float = 1.0) -> None:
        self.peaks, self.scale, self.calls = peaks or {}, scale, []

    def __call__(self, c: Candidate) -> None:
        self.calls.append(c.name)
        if c.name in self.peaks:
            c.measured_peak = self.peaks[c.name] * MB
        elif c.estimated_peak is not None:
            c.measured_peak = c.estimated_peak * self.scale
        else:
            c.skip = "no figure in this test"


# ---------------------------------------------------------------------- predictions
def test_sbp_peak_estimate() -> None:
    p = profile()
    # O + A_head + r (A_bb + X) = 18 + 2 + (k/8) 82, floored by the record pass (40) with BN
    assert sbp_peak(p, 4, full_batch=True, chunk=8) == pytest.approx((18 + 2 + 41) * MB)
    assert sbp_peak(p, 1, full_batch=True, chunk=8) == pytest.approx(40 * MB)
    # frozen BN / no BN: dropped frames in chunks of 8 of the 16 frames -> half the no_grad peak
    assert sbp_peak(p, 1, full_batch=False, chunk=8) == pytest.approx((20 + 82 / 8) * MB)
    assert sbp_peak(p, 7, full_batch=False, chunk=8) == pytest.approx((20 + 7 * 82 / 8) * MB)
    peaks = [sbp_peak(p, k, True, 8) for k in keep_counts(8)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] < p.e2e_peak
    assert dropout_peak(p, 4) == pytest.approx((18 + 0.5 * 84) * MB)


def test_sbp_peak_estimate_of_the_lockstep_pass() -> None:
    """The lockstep pass with full-batch BN holds, beyond the no_grad forward's peak, the kept
    half of one block and the kept input: at r = 1/8 that floor (40 * (1 + 1/16) + 2/8 = 42.75
    MB) is above the stored estimate (30.25). Frames that meet only at a shift (frozen BN) pass
    their dropped part in one unchunked no_grad pass: the no_grad peak (40)."""
    traced = profile(lockstep=True)
    assert sbp_peak(traced, 1, full_batch=True, chunk=8) == pytest.approx(42.75 * MB)
    assert sbp_peak(traced, 1, full_batch=False, chunk=8) == pytest.approx((20 + 82 / 8) * MB)  # chunks
    shift = profile(lockstep=True, mixes_frames=True)
    assert sbp_peak(shift, 1, full_batch=False, chunk=8) == pytest.approx(40 * MB)
    assert sbp_peak(shift, 1, full_batch=True, chunk=8) == pytest.approx(42.75 * MB)
    assert sbp_peak(shift, 6, full_batch=True, chunk=8) == pytest.approx((20 + 6 / 8 * 82) * MB)


def test_sbp_peak_estimate_of_one_pass_over_frames_that_do_not_meet() -> None:
    """Frozen BN or no BN in one pass: the lockstep pass measured keeping r0 = 1/8
    (``twin_nograd_peak``, 37 MB with a 2 MB input: a dropped share of (37 - 2/8) / (7/8) = 42
    MB) gives the transient at r as (1 - r) 42 + r 2. Chunks run another path: the no_grad peak
    scaled by the chunk, as without a lockstep profile."""
    p = profile(twin_nograd_peak=37 * MB)
    assert sbp_peak(p, 1, full_batch=False, chunk=16) == pytest.approx(37 * MB)  # over stored 30.25
    assert sbp_peak(p, 3, full_batch=False, chunk=16) == pytest.approx((20 + 3 / 8 * 82) * MB)
    assert sbp_peak(p, 1, full_batch=False, chunk=8) == pytest.approx((20 + 82 / 8) * MB)
    assert sbp_peak(profile(), 1, full_batch=False, chunk=16) == pytest.approx(35 * MB)  # 40 x 14/16


def test_sbp_and_dropout_hold_r_of_the_overhead_that_grows_with_the_frames() -> None:
    """Of the 18 MB overhead, 8 grow with the frames that backpropagate: at r = 1/2 the step holds
    10 + 4 of it; a measured part above the overhead counts as all of it."""
    p = profile(overhead_frames=8 * MB)
    assert p.overhead_at(0.5) == pytest.approx(14 * MB) and p.overhead_at(1.0) == p.overhead
    assert sbp_peak(p, 4, full_batch=True, chunk=8) == pytest.approx((14 + 2 + 41) * MB)
    assert dropout_peak(p, 4) == pytest.approx((14 + 0.5 * 84) * MB)
    assert profile(overhead_frames=30 * MB).overhead_at(0.0) == 0.0


def test_nograd_chunk_auto_is_one_pass_unless_the_budget_needs_chunks() -> None:
    """``nograd_chunk: auto``: the dropped frames of a candidate without BN statistics run in
    one no_grad pass (one kernel per layer) where that fits, else in the largest power-of-two
    chunks that fit; an integer is kept as set."""
    p = profile(has_batchnorm=False)  # a ViT: its sbp candidates' dropped frames run alone
    loose = by_name(build_candidates(p, [], Options(), budget=200 * MB))
    assert {c.params["nograd_chunk"] for c in loose.values() if c.kind == "sbp"} == {"auto"}
    # r = 1/8: stored 18 + 2 + 82/8 = 30.25 MB; one pass over the 14 dropped of 16 frames holds
    # 40 * 14/16 = 35 MB, over a 32 MB budget; chunks of 8 hold 20
    tight = by_name(build_candidates(p, [], Options(), budget=32 * MB))
    assert tight["sbp r=0.125"].params["nograd_chunk"] == 8
    assert tight["sbp r=0.125"].estimated_peak == pytest.approx(30.25 * MB)
    assert sbp_peak(p, 1, False, 16) > 32 * MB  # twice the chunk does not fit
    # r = 1/2: 61 MB stored, no chunk would fit, so none slows it
    assert tight["sbp r=0.500"].params["nograd_chunk"] == "auto"
    fixed = by_name(build_candidates(p, [], Options(nograd_chunk=4), budget=200 * MB))["sbp r=0.500"]
    assert fixed.params["nograd_chunk"] == 4


def test_time_estimate_orders_plans() -> None:
    p = profile()
    e2e = p.step_s
    assert sbp_time(p, 0.5, record_pass=False) < e2e  # half the backbone backward
    assert sbp_time(p, 0.5, record_pass=True) > sbp_time(p, 0.5, record_pass=False)  # extra fwd
    cs = by_name(cands())
    assert cs["ckpt-a"].estimated_time < cs["ckpt-b"].estimated_time  # less recompute
    assert cs["sbp+recompute r=0.500"].estimated_time > cs["sbp r=0.500"].estimated_time
    # a backbone that traces runs full-batch SBP in lockstep: one forward, no record pass
    lock = by_name(cands(profile(lockstep=True)))
    assert lock["sbp r=0.500"].estimated_time == pytest.approx(sbp_time(p, 0.5, record_pass=False))
    assert lock["sbp r=0.500"].estimated_time < cs["sbp r=0.500"].estimated_time
    assert lock["sbp+recompute r=0.500"].estimated_time == pytest.approx(  # still record/apply
        cs["sbp+recompute r=0.500"].estimated_time)


def test_keep_counts_are_distinct_frame_counts() -> None:
    assert keep_counts(8) == [7, 6, 5, 4, 3, 2, 1]
    assert keep_counts(1) == []
    r = {c.keep_ratio for c in cands() if c.kind == "sbp"}
    assert r == {k / 8 for k in range(1, 8)}


# ---------------------------------------------------------------------- ranking
def test_ranking_is_expected_accuracy_then_speed() -> None:
    order = [c.name for c in ranked(cands(allow_frame_dropout=True))]
    assert order[:3] == ["e2e", "ckpt-a", "ckpt-b"]  # exact gradients first, fastest first
    assert order[3:6] == ["sbp r=0.875", "sbp+recompute r=0.875", "sbp r=0.750"]
    tiers = [c.tier for c in ranked(cands(allow_frame_dropout=True))]
    assert tiers == sorted(tiers)
    assert tiers[-1] == TIER_DROPOUT and TIER_SBP_FROZEN in tiers and TIER_EXACT == tiers[0]
    sbp = [c.keep_ratio for c in ranked(cands()) if c.tier == TIER_SBP]
    assert sbp == sorted(sbp, reverse=True)  # larger keep ratio = better expected accuracy


def test_no_frozen_candidates_without_batchnorm() -> None:
    assert not [c for c in cands(profile(has_batchnorm=False)) if c.tier == TIER_SBP_FROZEN]


# ---------------------------------------------------------------------- the choice
def test_budget_above_e2e_chooses_e2e_without_profiling_anything() -> None:
    cs, measure = cands(), FakeMeasure()
    chosen = choose(cs, 150 * MB, measure)
    assert chosen.kind == "e2e" and measure.calls == []
    assert chosen.note == "chosen"
    assert all(c.note.startswith("not needed") for c in cs if c is not chosen and not c.skip)


def test_recompute_fastest_plan_that_fits() -> None:
    measure = FakeMeasure({"ckpt-a": 80, "ckpt-b": 70})
    assert choose(cands(), 85 * MB, measure).name == "ckpt-a"  # fits: the slower one not profiled
    assert measure.calls == ["ckpt-a"]
    measure = FakeMeasure({"ckpt-a": 80, "ckpt-b": 70})
    assert choose(cands(), 75 * MB, measure).name == "ckpt-b"
    assert measure.calls == ["ckpt-a", "ckpt-b"]


def test_sbp_largest_keep_ratio_that_fits_and_is_verified() -> None:
    cs = cands(sbp_recompute=None)
    measure = FakeMeasure({"ckpt-a": 80, "ckpt-b": 70})
    chosen = choose(cs, 55 * MB, measure)  # sbp k=3: 20 + 3/8 * 82 = 50.75 MB; k=4 61 MB
    assert chosen.name == "sbp r=0.375"
    assert measure.calls == ["ckpt-a", "ckpt-b", "sbp r=0.375"]  # the chosen one was verified
    assert chosen.measured_peak == chosen.estimated_peak
    assert by_name(cs)["sbp r=0.500"].note == "over budget"


def test_verification_over_budget_moves_on() -> None:
    cs = cands(sbp_recompute=None)
    measure = FakeMeasure({"ckpt-a": 80, "ckpt-b": 70}, scale=1.1)  # predictions 10% low
    chosen = choose(cs, 55 * MB, measure)  # k=3 measures 55.8 MB > 55: next is k=2 (44.6 MB)
    assert chosen.name == "sbp r=0.250"
    assert by_name(cs)["sbp r=0.375"].note == "over budget when measured"


def test_verify_off_trusts_estimates() -> None:
    measure = FakeMeasure({"ckpt-a": 80, "ckpt-b": 70}, scale=1.1)
    assert choose(cands(sbp_recompute=None), 55 * MB, measure, verify=False).name == "sbp r=0.375"
    assert "sbp r=0.375" not in measure.calls


def test_sbp_recompute_keeps_more_frames_than_plain_sbp() -> None:
    measure = FakeMeasure({"ckpt-a": 80, "ckpt-b": 70, "sbp+recompute r=0.875": 70,
                           "sbp+recompute r=0.750": 60, "sbp+recompute r=0.625": 52})
    chosen = choose(cands(), 55 * MB, measure)
    assert chosen.name == "sbp+recompute r=0.625"  # before plain sbp at r=0.375
    assert chosen.kind == "sbp_recompute" and chosen.params["recompute"] == "blocks"


def test_sbp_recompute_skipped_with_its_reason() -> None:
    cs = cands(sbp_recompute_error="sbp+recompute: StochasticBackprop does not take recompute= yet")
    chosen = choose(cs, 55 * MB, FakeMeasure({"ckpt-a": 80, "ckpt-b": 70}))
    assert chosen.name == "sbp r=0.375"
    assert "not considered: sbp+recompute: StochasticBackprop does not take" in render_table(cs, 55 * MB)


def test_frozen_bn_after_every_full_batch_plan_and_only_if_allowed() -> None:
    # below the record-pass floor (40 MB) only frozen BN fits: 20 + 82/8 = 30.25 MB
    measure = FakeMeasure({"ckpt-a": 80, "ckpt-b": 70})
    assert choose(cands(sbp_recompute=None), 35 * MB, measure).name == "sbp r=0.125 bn=frozen"
    with pytest.raises(NoPlanFits) as err:
        choose(cands(sbp_recompute=None, allow_frozen_bn=False), 35 * MB,
               FakeMeasure({"ckpt-a": 80, "ckpt-b": 70}))
    assert err.value.min_budget == pytest.approx(40 * MB)


def test_frame_dropout_only_when_allowed() -> None:
    p = profile(nograd_peak=90 * MB)  # no full-batch sbp goes below 90 MB; frame dropout does
    opts = dict(sbp_recompute=None, allow_frozen_bn=False)
    with pytest.raises(NoPlanFits):
        choose(cands(p, **opts), 60 * MB, FakeMeasure({"ckpt-a": 95, "ckpt-b": 95}))
    chosen = choose(cands(p, **opts, allow_frame_dropout=True), 59 * MB,
                    FakeMeasure({"ckpt-a": 95, "ckpt-b": 95}))
    assert chosen.kind == "frame_dropout" and chosen.keep_ratio == 0.375  # r=0.5 needs 18 + 84/2 = 60 MB


def test_no_plan_fits_names_the_smallest_budget_measured() -> None:
    cs = cands(sbp_recompute=None)
    measure = FakeMeasure({"ckpt-a": 80, "ckpt-b": 70, "sbp r=0.125 bn=frozen": 31})
    with pytest.raises(NoPlanFits) as err:
        choose(cs, 5 * MB, measure)
    assert isinstance(err.value, InfeasibleBudget) and isinstance(err.value, ValueError)
    assert err.value.min_budget == 31 * MB and err.value.smallest == "sbp r=0.125 bn=frozen"
    assert "sbp r=0.125 bn=frozen" in measure.calls  # the smallest estimate was measured
    text = str(err.value)
    assert "smallest budget that would work is 31.0 MB" in text and "memory.budget_mb=31.0" in text
    assert "| e2e |" in text  # the table comes with it


def test_extrapolated_e2e_is_only_an_estimate() -> None:
    """After an out-of-memory e2e profile, e2e is verified like any predicted plan, and a plan
    that runs out of memory in its profiling step is skipped."""
    cs = cands(profile(measured_clips=1), sbp_recompute=None)
    e2e = by_name(cs)["e2e"]
    assert e2e.measured_peak is None and e2e.estimated_peak == 100 * MB

    def oom_for_exact(c: Candidate) -> None:
        if c.tier == TIER_EXACT:
            c.skip = "out of memory in its profiling step"
        else:
            c.measured_peak = c.estimated_peak

    chosen = choose(cs, 150 * MB, oom_for_exact)
    assert chosen.name == "sbp r=0.875" and e2e.skip.startswith("out of memory")


def test_max_profiles_caps_profiling_steps() -> None:
    cs, measure = cands(sbp_recompute=None), FakeMeasure({"ckpt-a": 80, "ckpt-b": 70})
    chosen = choose(cs, 55 * MB, measure, max_profiles=1)
    assert measure.calls == ["ckpt-a"]
    assert by_name(cs)["ckpt-b"].note.startswith("not profiled")
    assert chosen.name == "sbp r=0.375" and chosen.measured_peak is None  # unverified: cap reached


def test_table_lists_estimated_and_measured() -> None:
    cs = cands(sbp_recompute=None)
    chosen = choose(cs, 55 * MB, FakeMeasure({"ckpt-a": 80, "ckpt-b": 70}))
    table = render_table(cs, 55 * MB, chosen)
    assert "| 1 | e2e | exact (e2e gradients) | 100.0 | 100.0 |" in table
    assert "| sbp r=0.375 |" in table and "**chosen**" in table
    assert "| ckpt-b | exact (e2e gradients) | – | 70.0 |" in table
    assert "not considered: frame dropout: not allowed" in table  # and why


# ---------------------------------------------------------------------- the strategy
def tiny_model(strategy) -> VideoClassifier:
    torch.manual_seed(0)
    backbone = resnet(layers=[1, 1, 1, 1])
    return VideoClassifier(backbone, TConvHead(backbone.feature_dim, 4, hidden_dim=16), strategy)


class FakeProbe:
    """A StepProbe that returns the synthetic profile and fake measurements (no timing); the
    recompute plans are planned for real on a tiny backbone."""

    def __init__(self, model: VideoClassifier, peaks: dict[str, float], p: Profile | None = None) -> None:
        self.model, self.device, self.p = model, torch.device("cpu"), p or profile()
        self.precision = Precision("32", self.device)  # what the recompute plans are made under
        self.peaks, self.measured, self.closed = peaks, [], False

    def profile(self) -> Profile:
        return self.p

    def frames(self) -> torch.Tensor:
        return torch.randn(4, 3, 32, 32)  # (N, C, H, W)

    def measure(self, strategy: MemoryStrategy, isolated: bool = False) -> ProfiledStep:
        key = strategy.describe()
        self.measured.append(key)
        if isinstance(strategy, Recompute):
            return ProfiledStep(95 * MB, 1.0)
        r = key.get("keep_ratio", 1.0)
        return ProfiledStep(self.peaks.get(f"{key['strategy']} {r}", sbp_peak(self.p, round(r * 8), True, 8) / MB) * MB, 1.0)

    def close(self) -> None:
        self.closed = True


def planned(budget_mb: float = 55, **kw) -> tuple[AutoStrategy, VideoClassifier, FakeProbe]:
    auto = AutoStrategy(budget_mb=budget_mb, sbp_recompute=None, recompute_fracs=[0.5], **kw)
    model = tiny_model(auto)
    probe = FakeProbe(model, {})
    auto.plan(probe)
    return auto, model, probe


def test_auto_is_a_strategy_with_the_optional_hooks() -> None:
    auto = AutoStrategy(budget_mb=10)
    assert isinstance(auto, MemoryStrategy) and isinstance(auto, StepObserver)
    assert isinstance(auto, SelfPlanning)
    with pytest.raises(RuntimeError, match="no plan yet"):
        tiny_model(auto).train()(torch.randn(1, 2, 3, 32, 32))


def test_plan_switches_to_the_chosen_strategy(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="videotrain.memory.auto.strategy"):
        auto, model, probe = planned()
    assert probe.closed
    assert auto.active.name == "sbp r=0.375" and isinstance(auto.inner, StochasticBackprop)
    assert auto.inner.keep_ratio == 0.375
    bns = [m for m in model.backbone.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(m.__dict__["forward"].owner is auto.inner.norm for m in bns)  # prepared
    assert "memory=auto decision" in caplog.text and "| sbp r=0.375 |" in caplog.text
    report = auto.plan_report()
    assert report["chosen"] == "sbp r=0.375" and report["budget_mb"] == 55
    assert report["budget_source"] == "memory.budget_mb=55"
    assert "largest keep ratio" in report["reason"]
    json.dumps(report)  # goes into results.json
    # it trains: the features come from the chosen strategy
    x = torch.randn(2, 8, 3, 32, 32)  # (B, T, C, H, W)
    model.train()(x).sum().backward()
    assert auto.inner.last_keep.shape == (2, 3)


def test_recheck_steps_down_and_records_it(caplog: pytest.LogCaptureFixture) -> None:
    auto, model, _ = planned()
    auto.observe_step(1, 500.0)  # the first step allocates gradients and optimizer state
    assert auto.step_downs == [] and auto.recheck is None
    auto.observe_step(2, 50.0)
    assert auto.recheck["measured_peak_mb"] == 50.0 and auto.step_downs == []
    auto.observe_step(3, 56.0)  # within the 2% tolerance of 55 MB
    assert auto.step_downs == []
    with caplog.at_level(logging.WARNING, logger="videotrain.memory.auto.strategy"):
        auto.observe_step(4, 60.0)  # 9.25 MB over the 50.75 MB estimate: r=0.25 (40.5 + 9.25) fits
    assert auto.active.name == "sbp r=0.250" and auto.inner.keep_ratio == 0.25
    (down,) = auto.step_downs
    assert down["step"] == 4 and down["from"] == "sbp r=0.375" and down["to"] == "sbp r=0.250"
    assert down["measured_peak_mb"] == 60.0 and down["budget_mb"] == 55
    assert "stepping down to sbp r=0.250" in caplog.text
    bns = [m for m in model.backbone.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(m.__dict__["forward"].owner is auto.inner.norm for m in bns)  # re-prepared
    model.train()(torch.randn(2, 8, 3, 32, 32)).sum().backward()
    assert auto.inner.last_keep.shape == (2, 2)
    assert auto.plan_report()["step_downs"] == auto.step_downs
    assert auto.plan_report()["chosen"] == "sbp r=0.375"  # the decision stays on record


def test_recheck_with_nothing_smaller_continues_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    auto, _, _ = planned(budget_mb=200)  # e2e
    assert auto.active.name == "e2e"
    auto.observe_step(1, 1.0)
    auto.active = min(auto.candidates, key=lambda c: c.peak or 1e18)  # pretend: the smallest plan
    with caplog.at_level(logging.WARNING, logger="videotrain.memory.auto.strategy"):
        auto.observe_step(2, 500.0)
    assert auto.step_downs[-1]["to"] is None and "continuing over budget" in caplog.text


def test_state_dict_resumes_the_stepped_down_plan() -> None:
    auto, model, _ = planned()
    auto.observe_step(1, 1.0)
    auto.observe_step(2, 60.0)
    model.train()(torch.randn(2, 8, 3, 32, 32))  # one mask draw
    state = auto.state_dict()
    assert state["active"] == "sbp r=0.250"
    fresh, fresh_model, _ = planned()
    assert fresh.active.name == "sbp r=0.375"
    fresh.load_state_dict(state)
    assert fresh.active.name == "sbp r=0.250" and fresh.step_downs == auto.step_downs
    assert fresh.inner.state_dict() == auto.inner.state_dict()
    fresh_model.train()(torch.randn(2, 8, 3, 32, 32))
    model.train()(torch.randn(2, 8, 3, 32, 32))
    assert torch.equal(fresh.inner.last_keep, auto.inner.last_keep)  # same next mask


def test_budget_sources() -> None:
    p = profile()
    assert AutoStrategy(budget_mb=64).resolve_budget(p, None)[0] == 64 * MB
    assert AutoStrategy(budget_frac=0.5).resolve_budget(p, None)[0] == 50 * MB
    budget, source = AutoStrategy(free_frac=0.5).resolve_budget(p, 1000 * MB)
    assert budget == 0.5 * (1000 - 10) * MB and "free device memory" in source


@pytest.mark.parametrize("kwargs,key", [
    ({"budget_mb": 1, "budget_frac": 0.5}, "memory.budget_mb and memory.budget_frac"),
    ({"budget_mb": 0}, "memory.budget_mb"), ({"budget_frac": -1}, "memory.budget_frac"),
    ({"free_frac": 1.5}, "memory.free_frac"), ({"recompute_fracs": [0.5, 0]}, "memory.recompute_fracs"),
    ({"sampler": "best"}, "memory.sampler"), ({"sbp_recompute": "all"}, "memory.sbp_recompute"),
    ({"max_profiles": -1}, "memory.max_profiles"), ({"recheck_tolerance": -0.1}, "memory.recheck_tolerance"),
    ({"nograd_chunk": 0}, "memory.nograd_chunk"),
])
def test_bad_values_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        AutoStrategy(**kwargs)


def test_plan_fails_before_training_with_the_smallest_budget() -> None:
    auto = AutoStrategy(budget_mb=1, sbp_recompute=None, recompute_fracs=[0.5])
    probe = FakeProbe(tiny_model(auto), {})
    with pytest.raises(NoPlanFits, match="smallest budget that would work"):
        auto.plan(probe)
    assert probe.closed and auto.inner is None


# ---------------------------------------------------------------------- in a run
def resnet_run(run_overrides, **extra) -> list[str]:
    """The tiny run on the default resnet10 (its tensors are large enough for the CPU meter),
    per-frame: with TSM's shift (the config default) memory=auto has no SBP candidates
    (tests/memory/test_temporal_shift_strategies.py), and these tests step down to one."""
    return [o for o in run_overrides(**extra) if not o.startswith("model")] + [
        "model.head.hidden_dim=16", "model.backbone.temporal_shift=0"]


def test_run_records_memory_plan(run_overrides, compose_cfg, tmp_path: Path) -> None:
    cfg = compose_cfg(resnet_run(run_overrides, memory="auto", memory__budget_mb=100000,
                                 trainer__max_steps=2))
    results = run.train(cfg, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["memory_strategy"] == "auto" and saved["memory"]["plan"] == "e2e"
    plan = saved["memory_plan"]
    assert plan["chosen"] == plan["active"] == "e2e" and plan["budget_mb"] == 100000
    assert plan["profile"]["e2e_peak_mb"] > plan["profile"]["saved_backbone_mb"] > 0
    assert plan["step_downs"] == []
    assert plan["recheck"]["step"] == 2  # the first step is not compared
    assert results["memory_plan"] == plan


def test_run_with_an_impossible_budget_fails_before_training(run_overrides, compose_cfg,
                                                             tmp_path: Path) -> None:
    cfg = compose_cfg(resnet_run(run_overrides, memory="auto", memory__budget_mb=0.0001,
                                 memory__recompute_fracs="[0.5]"))
    with pytest.raises(NoPlanFits, match=r"smallest budget that would work is .* MB"):
        run.train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # no outputs, no checkpoint: nothing was trained


def test_run_steps_down_when_a_step_goes_over(run_overrides, compose_cfg, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole chain in a real run: the trainer's meter reports an over-budget step (faked at
    step 3), the strategy steps down, training goes on with the smaller plan, results say so."""
    import videotrain.engine.trainer as trainer_mod

    class Inflated(trainer_mod.StepPeakMemory):
        calls = 0

        def stop(self) -> float | None:
            Inflated.calls += 1
            peak = super().stop()
            return 1e6 if Inflated.calls == 3 else peak

    monkeypatch.setattr(trainer_mod, "StepPeakMemory", Inflated)
    cfg = compose_cfg(resnet_run(run_overrides, memory="auto", memory__budget_mb=100000,
                                 memory__recompute_fracs="[0.5]", trainer__max_steps=4))
    results = run.train(cfg, tmp_path)
    plan = results["memory_plan"]
    (down,) = plan["step_downs"]
    assert down["step"] == 3 and down["from"] == "e2e" and down["measured_peak_mb"] == 1e6
    assert down["to"] == plan["active"] != plan["chosen"] == "e2e"
    assert results["memory"]["plan"] == plan["active"] and results["steps"] == 4
    assert plan["observed_peak_mb"][plan["active"]] > 0  # step 4 ran with the new plan


@pytest.mark.slow
def test_auto_trains_within_its_budget(run_overrides, run_cli, tmp_path: Path) -> None:
    """Acceptance on a small setting: half the measured e2e peak, the default resnet10 at 64 px;
    it trains, states its plan, and every measured step after the first stays within 10%."""
    args = resnet_run(run_overrides, memory="auto", memory__budget_frac=0.5, trainer__max_steps=4,
                      data__short_side=64, data__crop_size=64, data__num_frames=8,
                      data__sampling_rate=1)
    done = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "memory=auto decision" in done.stderr + done.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    plan = results["memory_plan"]
    assert plan["chosen"] != "e2e" and plan["step_downs"] == []
    assert plan["budget_mb"] == pytest.approx(0.5 * plan["profile"]["e2e_peak_mb"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["peak_mem_mb"] for r in rows if r.get("peak_mem_mb") is not None]
    assert len(peaks) == 4 and max(peaks[1:]) <= 1.1 * plan["budget_mb"]
    assert results["train_peak_mem_mb"] <= 1.1 * plan["budget_mb"]
