"""``memory=auto`` from predictions (``memory.budget_gb``): the bisection walk on synthetic
peaks, the strategy's budget scale with a stand-in predictor, and the real thing end to end
(``videotrain.plan`` for a CUDA card on this CPU machine, and a run that trains on its choice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

import videotrain.run as run
from videotrain import plan
from videotrain.memory.auto.candidates import (
    TIER_SBP,
    Candidate,
    NoPlanFits,
    Options,
    estimated_candidates,
    ranked,
)
from videotrain.memory.auto.choice import (
    INFEASIBLE,
    choose_estimated,
    walk,
)
from videotrain.memory.auto.profile import MB
from videotrain.memory.auto.strategy import STRATEGIES, AutoStrategy, memory_node
from videotrain.memory.estimate import GIB, UNSEEN_FRAC, StepMemory
from videotrain.memory.frame_dropout import FrameDropout
from videotrain.memory.recompute.strategy import Recompute
from videotrain.memory.sbp.strategy import StochasticBackprop
from videotrain.models.backbones import resnet
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier

T = 16


def peak_mb(c: Candidate) -> float:
    """Synthetic peaks that fall along every family: e2e 100, recompute 90 down to 40, sbp
    20 + 80 r (recomputed kept path: 10 + 60 r), frozen BN 5 + 80 r."""
    if c.kind == "e2e":
        return 100.0
    if c.kind == "recompute":
        return 40.0 if "budget_frac" not in c.params else 100 * c.params["budget_frac"]
    r = c.keep_ratio
    if c.kind == "sbp_recompute":
        return 10 + 60 * r
    return (5 if c.params.get("bn_policy") == "frozen" else 20) + 80 * r


class FakePredict:
    """Sets ``peak_mb`` as the prediction; budget fractions below ``infeasible_below`` are
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


def cands(**opts) -> list[Candidate]:
    return estimated_candidates(T, True, [0.9, 0.75, 0.6, 0.5, 0.4], Options(**opts))


def by_name(cs: list[Candidate]) -> dict[str, Candidate]:
    return {c.name: c for c in cs}


class Listed:
    """An evaluator that fits only the names it is given and records what the walk asked."""

    def __init__(self, fitting: set[str]) -> None:
        self.fitting, self.asked = fitting, []

    def fits(self, c: Candidate, rest: list[Candidate]) -> bool:
        self.asked.append((c.name, rest[0] is c, len(rest)))
        return c.name in self.fitting

    def no_plan_fits(self, cs: list[Candidate]) -> NoPlanFits:
        return NoPlanFits(1.0, None, None, "table")


def test_one_walk_serves_both_evaluators() -> None:
    """``walk`` asks in ranked order, skipped plans left out, each with the rest of the ranking;
    chooses the first that fits and notes the rest not needed; else raises the evaluator's
    error (``choose`` and ``choose_estimated`` are that walk with ``MeasuredPeaks`` and
    ``SimulatedPeaks``, tested in test_auto.py and below)."""
    cs = cands()
    order = [c for c in ranked(cs) if not c.skip]
    target = order[5]
    ev = Listed({target.name, order[7].name})
    assert walk(cs, ev) is target and target.note == "chosen"
    assert [a[0] for a in ev.asked] == [c.name for c in order[:6]]
    assert all(first for _, first, _ in ev.asked)
    assert [n for _, _, n in ev.asked] == list(range(len(order), len(order) - 6, -1))
    assert all(c.note == "not needed: a preferred plan fits" for c in order[6:])
    with pytest.raises(NoPlanFits):
        walk(cands(), Listed(set()))


def test_candidates_are_specs_without_figures() -> None:
    cs = cands()
    assert cs[0].name == "e2e" and all(c.estimated_peak is None for c in cs)
    ckpt = [c.params.get("budget_frac") for c in cs if c.kind == "recompute"]
    assert ckpt == [0.9, 0.75, 0.6, 0.5, 0.4, None]  # from the least recompute down
    assert {c.keep_ratio for c in cs if c.kind == "sbp"} == {k / T for k in range(1, T)}
    assert by_name(cs)["frame_dropout r=0.500"].skip  # not allowed by default
    assert not [c for c in estimated_candidates(T, False, [0.5], Options()) if "frozen" in c.name]


def test_e2e_fits_with_one_estimate() -> None:
    cs, predict = cands(), FakePredict()
    assert choose_estimated(cs, 120 * MB, predict).name == "e2e"
    assert predict.calls == ["e2e"]


def test_bisection_finds_the_largest_keep_ratio_in_log_estimates() -> None:
    cs, predict = cands(), FakePredict()
    # recompute >= 40 MB; sbp 20 + 80 r fits up to r = 3/16 (35 MB), and sbp+recompute
    # 10 + 60 r up to r = 7/16 (36.25 MB): it wins on expected accuracy
    chosen = choose_estimated(cs, 38 * MB, predict)
    assert chosen.name == "sbp+recompute r=0.438" and chosen.tier == TIER_SBP
    assert len(predict.calls) <= 1 + 3 + 2 * 4  # e2e, the 6 plans, 2 families of 15 members
    named = by_name(cs)
    assert named["sbp+recompute r=0.500"].note.startswith("over budget")
    assert "inferred" in named["sbp r=0.938"].note  # never predicted, over by inference
    assert named["sbp r=0.938"].estimated_peak is None
    predicted = [c for c in cs if c.estimated_peak is not None]
    for c in predicted:  # every prediction the walk made is a real one, noted truthfully
        assert (c.estimated_peak <= 38 * MB) == (c.note in ("chosen", "not needed: a preferred plan fits", ""))


def test_recompute_plans_below_the_planners_least_are_skipped_not_inferred_over() -> None:
    cs, predict = cands(), FakePredict(infeasible_below=0.7)
    chosen = choose_estimated(cs, 80 * MB, predict)  # 0.75 fits (75 MB), 0.6 and lower are infeasible
    assert chosen.name == "recompute optimal (budget_frac=0.75)"
    named = by_name(cs)
    assert named["recompute optimal (budget_frac=0.4)"].skip.startswith(INFEASIBLE)
    # the least-memory plan is never infeasible: an infeasible fraction does not rule it out
    cs, predict = cands(), FakePredict(infeasible_below=0.95)
    assert choose_estimated(cs, 45 * MB, predict).name == "recompute optimal (least memory)"
    assert "recompute optimal (budget_frac=0.4)" not in predict.calls  # inferred infeasible


def test_nothing_fits_names_the_smallest_and_the_advice() -> None:
    with pytest.raises(NoPlanFits, match=r"smallest budget that would work is 10\.0 MB \(sbp r=0\.062 bn=frozen\): ADVICE"):
        choose_estimated(cands(), 1 * MB, FakePredict(), max_estimates=100,
                         advice=lambda peak: "ADVICE")


def test_estimate_cap() -> None:
    cs, predict = cands(), FakePredict()
    with pytest.raises(NoPlanFits):
        choose_estimated(cs, 30 * MB, predict, max_estimates=3)
    assert len(predict.calls) == 3
    assert any(c.note == "not estimated (memory.max_profiles)" for c in cs)


# ---------------------------------------------------------------------- the strategy
def tiny_model(auto: AutoStrategy) -> VideoClassifier:
    backbone = resnet(layers=[1, 1, 1, 1])
    return VideoClassifier(backbone, TConvHead(backbone.feature_dim, 4, hidden_dim=8), auto)


def step_memory(node: dict) -> StepMemory:
    """A stand-in predictor: 50 MB held between steps (40 of weights, gradients and optimizer
    state, 10 of batch); the step adds ``peak_mb`` of its candidate."""
    strategy = instantiate(node)
    c = Candidate("x", "e2e", {}, 0)
    if isinstance(strategy, Recompute):
        c.kind, c.params = "recompute", {"budget_frac": strategy.budget_frac} if strategy.budget_frac else {}
    elif isinstance(strategy, (StochasticBackprop, FrameDropout)):
        c.kind, c.keep_ratio = "sbp", strategy.keep_ratio
        c.params = {"bn_policy": getattr(strategy, "bn_policy", "full_batch")}
    held = 50 * MB
    return StepMemory(held=held, batch=10 * MB, fwd_bwd_peak=held + int(peak_mb(c) * MB),
                      opt_peak=held + 1, eval_peak=held + 1)


def test_memory_nodes_instantiate_the_candidates_strategies() -> None:
    checked: set[str] = set()
    all_cands = cands(allow_frame_dropout=True)
    for c in all_cands:
        if c.kind == "e2e" or c.keep_ratio in (1.0, 0.5):
            assert isinstance(instantiate(memory_node(c)), STRATEGIES[c.kind])
            checked.add(c.kind)
    # the loop must have matched something of every kind, or it passes on nothing
    assert checked == {c.kind for c in all_cands} == set(STRATEGIES), checked


def test_plan_estimated_budget_is_on_the_trainers_scale() -> None:
    gb = 0.09  # on a CPU target: all of it for the allocator
    auto = AutoStrategy(budget_gb=gb, sbp_recompute=None, recompute_fracs=[0.5])
    tiny_model(auto)
    assert auto.estimates(torch.device("cpu")) and not AutoStrategy(budget_mb=5).estimates(torch.device("cpu"))
    seen: list[dict] = []
    report = auto.plan_estimated(lambda node: seen.append(node) or step_memory(node), T, torch.device("cpu"))
    # budget: 0.09 GiB / 1.1 (unseen share), less the 40 MB held between steps without the
    # batch: 43.8 MB; e2e (110) and the least-memory recompute plan (50) are over
    budget = gb * GIB / (1 + UNSEEN_FRAC) - 40 * MB
    assert report["budget_mb"] == pytest.approx(budget / MB) and report["mode"] == "estimated"
    # a step's peak on that scale: what it adds, plus the batch (held, but inside the meter's step)
    expected = max(k for k in range(1, T) if 10 + 20 + 80 * k / T <= budget / MB) / T
    assert auto.chosen.name == f"sbp r={expected:.3f}" and isinstance(auto.inner, StochasticBackprop)
    assert seen[0]["_target_"].endswith("EndToEnd") and len(seen) < 12
    assert "memory.budget_gb=0.09" in report["budget_source"]
    json.dumps(report)


def test_a_step_over_budget_estimates_its_way_down() -> None:
    """The first steps verify the choice: a step measured over the budget steps down to the
    next plan that fits the budget less the misprediction, predicting plans the first walk
    never needed."""
    auto = AutoStrategy(budget_gb=0.09, sbp_recompute=None, recompute_fracs=[0.5])
    tiny_model(auto)
    seen: list[dict] = []
    auto.plan_estimated(lambda node: seen.append(node) or step_memory(node), T, torch.device("cpu"))
    first, before = auto.active, len(seen)
    auto.observe_step(1, 1e6)  # the first step allocates gradients and optimizer state: ignored
    assert auto.active is first and not auto.step_downs
    over = first.estimated_peak / MB + 12  # 12 MB more than predicted
    auto.observe_step(2, over)
    order = ranked(auto.candidates)
    assert order.index(auto.active) > order.index(first)  # later in the ranking
    assert auto.active.estimated_peak + 12 * MB <= auto.budget
    assert len(seen) > before  # predicted after the decision, when it was needed
    assert auto.step_downs[0]["from"] == first.name and auto.step_downs[0]["to"] == auto.active.name


def test_budget_gb_is_exclusive_and_positive() -> None:
    with pytest.raises(ValueError, match="at most one of memory.budget_gb"):
        AutoStrategy(budget_gb=1, budget_mb=5)
    with pytest.raises(ValueError, match="memory.budget_gb must be > 0"):
        AutoStrategy(budget_gb=0)


# ---------------------------------------------------------------------- end to end
def test_plan_cli_estimates_for_a_cuda_card_on_this_machine(tmp_path: Path, capsys) -> None:
    """The default model for a 0.7 GiB CUDA device (0.2 GiB after the context): e2e does not
    fit, a recomputation plan does; no GPU is used and nothing is profiled."""
    out = tmp_path / "auto.json"
    assert plan.main(["--out", str(out), "memory=auto", "memory.budget_gb=0.7", "device=cuda",
                      "memory.recompute_fracs=[0.9]"]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "estimated" and report["profile"] is None
    named = {c["name"]: c for c in report["candidates"]}
    assert named["e2e"]["note"] == "over budget (estimated)"
    chosen = named[report["chosen"]]
    assert chosen["kind"] == "recompute" and chosen["estimated_peak_mb"] <= report["budget_mb"]
    assert named["e2e"]["estimated_peak_mb"] > report["budget_mb"]
    assert "chosen:" in capsys.readouterr().out


def test_run_trains_on_the_estimated_choice(run_overrides, compose_cfg, tmp_path: Path) -> None:
    """Frames large enough for activations (not the optimizer step) to set the peak; a budget
    e2e cannot meet; the run trains on the plan chosen from predictions and re-checks it."""
    ov = [o for o in run_overrides(memory="auto", trainer__max_steps=3) if not o.startswith("model")]
    ov += ["model.head.hidden_dim=16", "data.crop_size=64", "data.short_side=64", "data.num_frames=8",
           "data.val_batch_size=1"]
    e2e = plan.auto_report(compose_cfg([*ov, "memory.budget_gb=100"]))
    assert e2e["chosen"] == "e2e" and e2e["mode"] == "estimated"
    need_gb = e2e["candidates"][0]["estimated_train_peak_gb"] * (1 + UNSEEN_FRAC)
    cfg = compose_cfg([*ov, f"memory.budget_gb={need_gb * 0.9:.4f}"])  # e2e cannot fit
    results = run.train(cfg, tmp_path)
    mp = results["memory_plan"]
    assert mp["mode"] == "estimated" and mp["chosen"] != "e2e"
    assert mp["recheck"]["plan"] == mp["chosen"]  # verified on the first steps, as profiled plans are
    assert results["steps"] == 3
