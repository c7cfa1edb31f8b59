"""``AutoStrategy``: the budget keys on the trainer's scale, the plan it swaps in, the re-check
that steps down, exact resume, with a stand-in estimator; the candidates' ``memory:`` nodes as
the estimating process checks them; and real runs on the real estimator (``memory_plan`` in
results.json, failing before training, a step-down, and the reference: a plan chosen for a
budget trains within it, measured by the trainer's meter in a process of its own)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

import videotrain.run as run
from videotrain import plan
from videotrain.config import schema
from videotrain.config.files import checked_config
from videotrain.memory.auto import strategy as auto_strategy
from videotrain.memory.auto.candidates import MB, Options, build_candidates, ranked
from videotrain.memory.auto.choice import INFEASIBLE
from videotrain.memory.auto.strategy import (
    RECHECK_TOLERANCE,
    STRATEGIES,
    AutoStrategy,
    NoPlanFits,
    device_free_bytes,
    memory_node,
    unprepare,
)
from videotrain.memory.base import MemoryStrategy, SelfPlanning, StepObserver
from videotrain.memory.estimate import GIB, UNSEEN_FRAC, StepMemory
from videotrain.memory.frame_dropout import FrameDropout
from videotrain.memory.recompute.execute import RecomputedForward
from videotrain.memory.recompute.planner import InfeasibleBudget
from videotrain.memory.recompute.strategy import Recompute
from videotrain.memory.registry import STRATEGIES as REGISTRY
from videotrain.memory.sbp.split import PatchedBN
from videotrain.memory.sbp.strategy import StochasticBackprop
from videotrain.models.backbones import resnet
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier

CPU = torch.device("cpu")
T = 8
HELD, BATCH = 50 * MB, 10 * MB  # the stand-in's bytes between steps, of which the batch
HEADROOM = 1 + UNSEEN_FRAC


def step_mb(strategy: object) -> float:
    """The stand-in's step (MB over what is held): e2e 100, recompute 70 + 30 x its budget
    fraction (least memory 65), sbp 20 + 80 r, frozen BN 5 + 80 r, frame dropout 80 r."""
    if isinstance(strategy, Recompute):
        return 70 + 30 * strategy.budget_frac if strategy.budget_frac else 65.0
    if isinstance(strategy, FrameDropout):
        return 80 * strategy.keep_ratio
    if isinstance(strategy, StochasticBackprop):
        frozen = strategy.describe().get("bn_policy") == "frozen"
        return (5 if frozen else 20) + 80 * strategy.keep_ratio
    return 100.0


class StandIn:
    """An estimator of ``memory:`` nodes: instantiates each (so a bad node fails here) and
    returns the step of :func:`step_mb`; ``fail`` maps a target's class name to an error."""

    def __init__(self, fail: dict[str, Exception] | None = None) -> None:
        self.nodes: list[dict] = []
        self.fail = fail or {}

    def __call__(self, node: dict) -> StepMemory:
        self.nodes.append(node)
        strategy = instantiate(node)
        if type(strategy).__name__ in self.fail:
            raise self.fail[type(strategy).__name__]
        step = int(step_mb(strategy) * MB)
        return StepMemory(held=HELD, batch=BATCH, fwd_bwd_peak=HELD + step, opt_peak=HELD + 1,
                          eval_peak=HELD + 1)


def expected_mb(step: float) -> float:
    """A stand-in step on the trainer's scale (the batch is inside the meter's step)."""
    return step + BATCH / MB


def tiny_model(strategy) -> VideoClassifier:
    torch.manual_seed(0)
    backbone = resnet(layers=[1, 1, 1, 1])
    return VideoClassifier(backbone, TConvHead(backbone.feature_dim, 4, hidden_dim=16), strategy)


def planned(estimate: StandIn | None = None, **kw) -> tuple[AutoStrategy, VideoClassifier]:
    auto = AutoStrategy(**({"budget_mb": 70} | kw))
    model = tiny_model(auto)
    auto.plan(estimate or StandIn(), T, CPU)
    return auto, model


def bns_owned_by(model: VideoClassifier, strategy: StochasticBackprop) -> bool:
    bns = [m for m in model.backbone.modules() if isinstance(m, nn.BatchNorm2d)]
    return bool(bns) and all(m.__dict__["forward"].owner is strategy.norm for m in bns)


# ---------------------------------------------------------------------- keys and nodes
def test_the_configs_keys_are_the_signatures() -> None:
    """The 8 keys a user sets; the group's schema is derived from the signature (the DDP rank
    is set in code)."""
    keys = set(yaml.safe_load(Path("configs/memory/auto.yaml").read_text())) - {"defaults", "_target_"}
    assert keys == {"budget_mb", "budget_frac", "budget_gb", "free_frac", "allow_frame_dropout",
                    "allow_frozen_bn", "sampler", "seed"}
    assert set(inspect.signature(AutoStrategy).parameters) == keys | {"rank"}
    fields = {f.name for f in dataclasses.fields(schema.SCHEMAS["memory"]["auto_schema"])} - {"_target_"}
    assert fields == keys


def test_memory_nodes_pass_the_estimating_process_checks(compose_cfg) -> None:
    """Every kind's node, in a resolved config as ``ConfigEstimator`` sends it, passes
    ``checked_config`` (the child's door) and builds the registered strategy."""
    base = OmegaConf.to_container(compose_cfg([]), resolve=True)
    checked = set()
    for c in build_candidates(4, True, Options(allow_frame_dropout=True)):
        cfg = checked_config({**copy.deepcopy(base), "memory": memory_node(c)}, "test")
        built = instantiate(cfg.memory)
        assert isinstance(built, REGISTRY[STRATEGIES[c.kind]].cls), c.name
        checked.add(c.kind)
    assert checked == set(STRATEGIES)  # the loop met every kind, or it tested nothing


# ---------------------------------------------------------------------- the decision
def test_auto_is_a_strategy_with_the_optional_hooks() -> None:
    auto = AutoStrategy(budget_mb=10)
    assert isinstance(auto, MemoryStrategy) and isinstance(auto, StepObserver)
    assert isinstance(auto, SelfPlanning)
    with pytest.raises(RuntimeError, match="no plan yet"):
        tiny_model(auto).train()(torch.randn(1, 2, 3, 32, 32))


def test_plan_switches_to_the_chosen_strategy(caplog: pytest.LogCaptureFixture) -> None:
    """70 MB for a step + the 10 MB batch, + 10%: recompute needs 82.5 at least; sbp
    (30 + 80 r) 1.1 <= 70 up to r = 3/8."""
    with caplog.at_level(logging.INFO, logger="videotrain.memory.auto.strategy"):
        auto, model = planned()
    assert auto.active.name == "sbp r=0.375" and isinstance(auto.inner, StochasticBackprop)
    assert auto.inner.keep_ratio == 0.375 and bns_owned_by(model, auto.inner)  # prepared
    assert auto.active.estimated_peak == pytest.approx(expected_mb(20 + 30) * MB)
    assert "memory=auto decision" in caplog.text and "| sbp r=0.375 |" in caplog.text
    report = auto.plan_report()
    assert report["chosen"] == "sbp r=0.375" and report["budget_mb"] == 70
    assert report["budget_source"] == "memory.budget_mb=70"
    assert report["need_mb"] == pytest.approx(60 * HEADROOM)
    assert "largest keep ratio" in report["reason"]
    json.dumps(report)  # goes into results.json
    x = torch.randn(2, T, 3, 32, 32)  # (B, T, C, H, W): it trains on the chosen strategy
    model.train()(x).sum().backward()
    assert auto.inner.last_keep.shape == (2, 3)


def test_budget_frac_is_a_fraction_of_e2es_estimated_peak() -> None:
    whole, _ = planned(budget_mb=None, budget_frac=1.0)
    assert whole.chosen.name == "e2e"  # all of its own peak: e2e fits
    e2e_need = expected_mb(100) * HEADROOM
    assert whole.budget == pytest.approx(e2e_need * MB)
    half, _ = planned(budget_mb=None, budget_frac=0.5)
    assert half.budget == pytest.approx(0.5 * e2e_need * MB)
    assert "x e2e's estimated step peak" in half.budget_source
    need = half.chosen.need / MB  # the largest keep ratio within half: (30 + 80 r) <= 55
    assert need <= 0.5 * e2e_need and half.chosen.name == "sbp r=0.250"


def test_budget_gb_decides_as_plan_fit_does() -> None:
    """A plan fits when (its step + what is held) x 1.1 fits the device, as ``plan --fit``
    decides; on the trainer's scale that is the device less 1.1 x what e2e holds without the
    batch (CPU: no CUDA context)."""
    gb = 0.1
    auto, _ = planned(budget_mb=None, budget_gb=gb)
    base = HELD - BATCH
    assert auto.budget == pytest.approx(gb * GIB - base * HEADROOM)
    chosen = auto.chosen
    assert (chosen.estimated_peak + base) * HEADROOM <= gb * GIB
    before = ranked(auto.candidates)[ranked(auto.candidates).index(chosen) - 1]
    assert before.need is None or (before.estimated_peak + base) * HEADROOM > gb * GIB
    assert "memory.budget_gb=0.1" in auto.budget_source


def test_free_frac_takes_a_share_of_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto_strategy, "device_free_bytes", lambda device: 0.2 * GIB)
    auto, model = planned(budget_mb=None, free_frac=0.5)
    weights = sum(t.numel() * t.element_size() for t in [*model.backbone.parameters(), *model.backbone.buffers()])
    assert auto.budget == pytest.approx(0.5 * (0.2 * GIB + weights) - (HELD - BATCH) * HEADROOM)
    assert "memory.free_frac=0.5" in auto.budget_source
    assert device_free_bytes(CPU) > 0  # the real reading, on this machine


@pytest.mark.parametrize("key,advice", [("budget_mb", "set memory.budget_mb=27.5 or more"),
                                        ("budget_frac", "set memory.budget_frac=0.23 or more"),
                                        ("budget_gb", "set memory.budget_gb=0.1 or more")])
def test_no_plan_fits_before_training_names_the_budget_in_the_users_key(key: str, advice: str) -> None:
    """The smallest: frozen BN at r = 1/8, 5 + 10 MB and the 10 MB batch, + 10%: 27.5 MB; of
    e2e's 121 MB, 0.23 (rounded up); on a device, with 1.1 x the 40 MB held: 0.07 GiB, 0.1."""
    auto = AutoStrategy(**{key: 1e-6})
    tiny_model(auto)
    with pytest.raises(NoPlanFits, match="smallest budget that would work") as err:
        auto.plan(StandIn(), T, CPU)
    assert err.value.smallest == "sbp r=0.125 bn=frozen"
    assert err.value.min_budget == pytest.approx(expected_mb(15) * HEADROOM * MB)
    assert advice in str(err.value)
    assert auto.inner is None  # nothing was swapped in


def test_a_failing_estimate_skips_its_candidate_and_e2es_stops_the_decision(caplog) -> None:
    # what the estimating process reports when the planner finds no plan for a budget
    estimate = StandIn({"Recompute": RuntimeError(f"{InfeasibleBudget.__name__}: 30 MiB is infeasible")})
    with caplog.at_level(logging.WARNING):
        auto, _ = planned(estimate)
    recompute = [c for c in auto.candidates if c.kind == "recompute" and c.skip]
    assert recompute and all(c.skip.startswith(INFEASIBLE) for c in recompute)
    assert auto.chosen.name == "sbp r=0.375"
    auto = AutoStrategy(budget_mb=1, allow_frame_dropout=True)
    tiny_model(auto)
    with pytest.raises(NoPlanFits):
        auto.plan(StandIn({"FrameDropout": RuntimeError("fake tensors: no kernel")}), T, CPU)
    assert "fake tensors: no kernel" in caplog.text and any("its estimate failed: fake tensors: no kernel" in (c.skip or "") for c in auto.candidates)
    with pytest.raises(ValueError, match="cannot be estimated"):
        planned(StandIn({"EndToEnd": RuntimeError("no kernel")}))


@pytest.mark.parametrize("kwargs,key", [
    ({"budget_mb": 1, "budget_frac": 0.5}, "memory.budget_mb and memory.budget_frac"),
    ({"budget_gb": 1, "budget_mb": 5}, "at most one of memory.budget_gb"),
    ({"budget_mb": 0}, "memory.budget_mb"), ({"budget_frac": -1}, "memory.budget_frac"),
    ({"budget_gb": 0}, "memory.budget_gb must be > 0"),
    ({"free_frac": 1.5}, "memory.free_frac"), ({"sampler": "best"}, "memory.sampler"),
])
def test_bad_values_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        AutoStrategy(**kwargs)


# ---------------------------------------------------------------------- the re-check
def test_recheck_steps_down_estimating_what_it_needs(caplog: pytest.LogCaptureFixture) -> None:
    estimate = StandIn()
    auto, model = planned(estimate)
    first, estimated = auto.active, len(estimate.nodes)
    auto.observe_step(1, 500.0)  # the first step allocates gradients and optimizer state
    assert auto.step_downs == [] and auto.recheck is None
    auto.observe_step(2, 50.0)
    assert auto.recheck["measured_peak_mb"] == 50.0 and auto.step_downs == []
    auto.observe_step(3, 70 * (1 + RECHECK_TOLERANCE))  # within the tolerance of 70 MB
    assert auto.step_downs == []
    with caplog.at_level(logging.WARNING, logger="videotrain.memory.auto.strategy"):
        auto.observe_step(4, 76.0)  # 10 MB over its 66 MB need: the next must need 60 at most
    assert auto.active is not first and ranked(auto.candidates).index(auto.active) > ranked(
        auto.candidates).index(first)
    assert auto.active.need + 10 * MB <= auto.budget
    assert auto.active.name == "sbp r=0.250"  # sbp+recompute r=3/8 needs 66; sbp r=1/4 55
    assert len(estimate.nodes) > estimated  # estimated after the decision, when it was needed
    (down,) = auto.step_downs
    assert down["step"] == 4 and down["from"] == first.name and down["to"] == "sbp r=0.250"
    assert down["measured_peak_mb"] == 76.0 and down["budget_mb"] == 70
    assert "stepping down to sbp r=0.250" in caplog.text
    assert bns_owned_by(model, auto.inner)  # re-prepared
    model.train()(torch.randn(2, T, 3, 32, 32)).sum().backward()
    assert auto.inner.last_keep.shape == (2, 2)
    report = auto.plan_report()
    assert report["step_downs"] == auto.step_downs and report["chosen"] == first.name


def test_recheck_with_nothing_smaller_continues_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    auto, _ = planned(budget_mb=28)  # only the smallest plan fits
    assert auto.active.name == "sbp r=0.125 bn=frozen"
    auto.observe_step(1, 1.0)
    with caplog.at_level(logging.WARNING, logger="videotrain.memory.auto.strategy"):
        auto.observe_step(2, 1e6)
    assert auto.step_downs[-1]["to"] is None and "continuing over budget" in caplog.text


def test_state_dict_resumes_the_stepped_down_plan_exactly() -> None:
    auto, model = planned()
    auto.observe_step(1, 1.0)
    auto.observe_step(2, 76.0)
    model.train()(torch.randn(2, T, 3, 32, 32))  # one mask draw
    state = auto.state_dict()
    assert state["active"] == "sbp r=0.250"
    fresh, fresh_model = planned()
    assert fresh.active.name == "sbp r=0.375"
    fresh.load_state_dict(state)
    assert fresh.active.name == "sbp r=0.250" and fresh.step_downs == auto.step_downs
    assert fresh.inner.state_dict() == auto.inner.state_dict()
    fresh_model.train()(torch.randn(2, T, 3, 32, 32))
    model.train()(torch.randn(2, T, 3, 32, 32))
    assert torch.equal(fresh.inner.last_keep, auto.inner.last_keep)  # the same next mask


def _wrapped(backbone: nn.Module) -> list[object]:
    return [m.__dict__["forward"] for m in backbone.modules()
            if isinstance(m.__dict__.get("forward"), PatchedBN | RecomputedForward)]


def test_unprepare_restores_the_backbone() -> None:
    torch.manual_seed(0)
    backbone = resnet(layers=[1, 1, 1, 1]).train()
    reference = copy.deepcopy(backbone)
    marker = lambda x: x  # noqa: E731  an instance-level forward set by someone else
    backbone.net.conv1.forward = marker
    StochasticBackprop(0.5).prepare(backbone)
    Recompute("blocks").prepare(backbone)
    assert len(_wrapped(backbone)) > 4
    unprepare(backbone)
    assert _wrapped(backbone) == [] and backbone.net.conv1.forward is marker
    del backbone.net.conv1.forward
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(backbone.eval()(x), reference.eval()(x))
    second = StochasticBackprop(0.5)  # a second SBP prepares the backbone as its own again
    second.prepare(backbone)
    assert all(f.owner is second.norm for f in _wrapped(backbone))


# ---------------------------------------------------------------------- in a run
def resnet_run(run_overrides, **extra) -> list[str]:
    """The tiny run on the default resnet10 without the shift (so SBP + recompute is a
    candidate too)."""
    return [o for o in run_overrides(**extra) if not o.startswith("model")] + [
        "model.head.hidden_dim=16", "model.backbone.temporal_shift=0"]


# frames large enough for activations, not the optimizer step or validation, to set the peak
ACTIVATIONS = ["data.crop_size=64", "data.short_side=64", "data.num_frames=8", "data.val_batch_size=1"]


def test_run_records_memory_plan(run_overrides, compose_cfg, tmp_path: Path) -> None:
    cfg = compose_cfg(resnet_run(run_overrides, memory="auto", memory__budget_mb=100000,
                                 trainer__max_steps=2))
    results = run.train(cfg, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["memory_strategy"] == "auto" and saved["memory"]["plan"] == "e2e"
    mp = saved["memory_plan"]
    assert mp["chosen"] == mp["active"] == "e2e" and mp["budget_mb"] == 100000
    assert mp["estimated_peak_mb"] > 0 and mp["step_downs"] == []
    assert mp["recheck"]["step"] == 2  # the first step is not compared
    assert results["memory_plan"] == mp


def test_run_with_an_impossible_budget_fails_before_training(run_overrides, compose_cfg,
                                                             tmp_path: Path) -> None:
    cfg = compose_cfg(resnet_run(run_overrides, memory="auto", memory__budget_mb=0.0001))
    with pytest.raises(NoPlanFits, match=r"smallest budget that would work is .* MB"):
        run.train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # no outputs, no checkpoint: nothing was trained


def test_run_steps_down_when_a_step_goes_over(run_overrides, compose_cfg, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole chain in a real run: the meter's readings are replaced (half the budget, and
    20% over it at step 3: this process's CPU meter reads its heap's history, see
    tests/metrics/), the strategy steps down to a plan it estimates within the budget less the
    misestimate, training goes on with it, and results say so."""
    import videotrain.engine.trainer as trainer_mod

    ov = [*resnet_run(run_overrides, memory="auto", memory__budget_frac=1.0, trainer__max_steps=4), *ACTIVATIONS]
    budget: dict[str, float] = {}
    decide = AutoStrategy.plan

    def plan_and_keep_the_budget(self: AutoStrategy, *args, **kwargs) -> dict:
        report = decide(self, *args, **kwargs)
        budget["mb"] = self.budget / MB
        return report

    class Replaced(trainer_mod.StepPeakMemory):
        calls = 0

        def stop(self) -> float | None:
            Replaced.calls += 1
            super().stop()
            return budget["mb"] * (1.2 if Replaced.calls == 3 else 0.5)

    monkeypatch.setattr(AutoStrategy, "plan", plan_and_keep_the_budget)
    monkeypatch.setattr(trainer_mod, "StepPeakMemory", Replaced)
    results = run.train(compose_cfg(ov), tmp_path)
    mp = results["memory_plan"]
    budget_mb = budget["mb"]
    assert mp["chosen"] == "e2e" and mp["budget_mb"] == pytest.approx(budget_mb)
    (down,) = mp["step_downs"]
    assert down["step"] == 3 and down["from"] == "e2e" and down["to"] == mp["active"] != "e2e"
    shift = 1.2 * budget_mb - down["need_mb"]
    assert down["to_need_mb"] + shift <= budget_mb
    assert results["memory"]["plan"] == mp["active"] and results["steps"] == 4
    assert mp["observed_peak_mb"][mp["active"]] > 0  # step 4 ran with the new plan


def test_run_trains_on_the_choice_for_a_device_budget(run_overrides, compose_cfg, tmp_path: Path) -> None:
    """A ``budget_gb`` e2e cannot meet: the run trains on the plan chosen from estimates."""
    ov = [*resnet_run(run_overrides, memory="auto", trainer__max_steps=3), *ACTIVATIONS]
    e2e = plan.auto_report(compose_cfg([*ov, "memory.budget_gb=100"]))
    assert e2e["chosen"] == "e2e"
    need_gb = e2e["candidates"][0]["estimated_train_peak_gb"] * HEADROOM
    results = run.train(compose_cfg([*ov, f"memory.budget_gb={need_gb * 0.9:.4f}"]), tmp_path)
    mp = results["memory_plan"]
    assert mp["chosen"] != "e2e" and mp["recheck"]["plan"] == mp["chosen"]
    assert results["steps"] == 3


@pytest.mark.slow
def test_a_plan_chosen_for_a_budget_trains_within_it(run_overrides, run_cli, tmp_path: Path) -> None:
    """The reference: half of e2e's estimated peak, the default resnet10 at 64 px (8 clips of 8
    frames: activations set the peak), trained in a process of its own; the plan chosen from estimates trains without a step-down, and every
    step the trainer's meter measures after the first is within the budget (and its tolerance)."""
    args = resnet_run(run_overrides, memory="auto", memory__budget_frac=0.5, trainer__max_steps=4,
                      data__short_side=64, data__crop_size=64, data__num_frames=8,
                      data__sampling_rate=1, data__batch_size=8, trainer__max_epochs=4)
    done = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    mp = results["memory_plan"]
    assert mp["chosen"] != "e2e" and mp["step_downs"] == [], mp["table"]
    e2e = next(c for c in mp["candidates"] if c["name"] == "e2e")
    assert mp["budget_mb"] == pytest.approx(0.5 * e2e["need_mb"], rel=1e-3)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["peak_mem_mb"] for r in rows if r.get("peak_mem_mb") is not None]
    assert len(peaks) == 4 and max(peaks[1:]) <= mp["budget_mb"] * (1 + RECHECK_TOLERANCE), (peaks, mp["table"])
    assert results["train_peak_mem_mb"] <= mp["budget_mb"] * (1 + RECHECK_TOLERANCE)
