"""trainer.compile for every strategy (videotrain.memory.compiled), on the CPU.

Each strategy trains the same tiny model from the same weights eager and compiled, with the
``aot_eager`` backend (the properties here, what is traced, split, saved and recompiled, are
the compiler front end's, not inductor's; one test runs inductor itself): every step's loss and
gradients, the BN statistics and the evaluation logits equal eager's, the measured step peak
is at most 1.10x eager's (measured in a fresh process: ``compiled_peaks_worker.py``), and after
the warm-up steps nothing recompiles.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from videotrain.memory import EndToEnd, FrameDropout, Recompute, StochasticBackprop
from videotrain.memory.auto import AutoStrategy
from videotrain.memory.compiled import (
    Compiler,
    check_compile,
    compile_counts,
    compile_model,
    wants_compile,
)
from videotrain.memory.estimate import StepMemory
from videotrain.metrics.memory import StepPeakMemory
from videotrain.models.backbones import FrameBackbone, vit
from videotrain.models.video import VideoClassifier

# frame size per backbone: a ResNet's large enough that activations, not the allocator's noise,
# set the CPU step peak; the tiny ViT's is fixed by its position embedding
PX = {"resnet": 64, "vit": 32}
# frames per clip: the ViT's step must hold more activations than its weights (backbone_of)
FRAMES = {"resnet": 8, "vit": 32}
WARMUP, STEPS = 2, 6  # the default run; test_fifty_steps_compile_once runs 50
PEAK_RATIO = 1.10

STRATEGIES = {
    "e2e": ("resnet", lambda: EndToEnd()),
    "frame_dropout": ("resnet", lambda: FrameDropout(0.5)),
    "sbp": ("resnet", lambda: StochasticBackprop(0.5)),
    "sbp_frozen": ("resnet", lambda: StochasticBackprop(0.5, bn_policy="frozen")),
    "sbp_vit": ("vit", lambda: StochasticBackprop(0.25)),
    "recompute_blocks": ("resnet", lambda: Recompute("blocks")),
    "recompute_sqrt": ("resnet", lambda: Recompute("sqrt")),
    "recompute_optimal": ("resnet", lambda: Recompute("optimal", budget_frac=0.75)),
    "sbp_recompute_sqrt": ("resnet", lambda: StochasticBackprop(0.5, recompute="sqrt")),
    "sbp_recompute_blocks": ("resnet", lambda: StochasticBackprop(0.5, recompute="blocks")),
}


def backbone_of(kit, kind: str) -> FrameBackbone:
    """The tiny ResNet, or a ViT eight times as wide as the kit's, at ``FRAMES`` frames: a
    compiled backward returns a region's parameter gradients together (one transient the size
    of the weights, 4 MB here, where eager accumulates each as it comes), so the step peaks
    compare the plans only where activations outweigh the weights, as they do at real sizes."""
    if kind == "vit":
        return vit(image_size=PX["vit"], patch_size=8, num_layers=2, num_heads=2, hidden_dim=256,
                   mlp_dim=512)
    return kit.BACKBONES[kind]()


def pair(kit, name: str) -> tuple[VideoClassifier, VideoClassifier]:
    """(eager, compiled) models of strategy ``name`` from identical weights, in train mode."""
    backbone, make = STRATEGIES[name]
    bb = backbone_of(kit, backbone)
    head = kit.make_head(bb.feature_dim)
    eager = VideoClassifier(copy.deepcopy(bb), copy.deepcopy(head), make()).train()
    compiled = VideoClassifier(bb, head, make()).train()
    compile_model(compiled, Compiler(backend="aot_eager"))
    return eager, compiled


def clips(step: int, px: int = 64, frames: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    video = torch.randn(2, frames, 3, px, px, generator=g)  # (B, T, C, H, W)
    return video, torch.randint(0, 5, (2,), generator=g)


def train(models: list[nn.Module], steps: int, px: int, frames: int = 8) -> dict[str, list]:
    """The same SGD steps for each model; per step: losses, the largest relative gradient
    difference from the first model, measured peaks (MB) and dynamo's counts after the step."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    meter = StepPeakMemory(torch.device("cpu"))
    out: dict[str, list] = {"loss": [], "grad_diff": [], "peak": [], "counts": [], "time": []}
    for i in range(steps):
        video, labels = clips(i, px, frames)
        losses, peaks, times, grads = [], [], [], []
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad(set_to_none=False)
            meter.start()
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(model(video), labels)
            loss.backward()
            times.append(time.perf_counter() - t0)
            peaks.append(meter.stop())
            losses.append(float(loss.detach()))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
        assert grads[0].keys() == grads[1].keys()  # the same parameters got a gradient
        # relative to each parameter's gradient, or to 1e-4 of the largest where it is ~0 (a
        # bias before a BN: fp32 rounding alone)
        top = max(float(g.abs().max()) for g in grads[0].values())
        out["grad_diff"].append(max(float((grads[0][k] - grads[1][k]).abs().max())
                                    / max(float(grads[0][k].abs().max()), 1e-4 * top) for k in grads[0]))
        out["loss"].append(losses)
        out["peak"].append(peaks)
        out["time"].append(times)
        out["counts"].append(compile_counts())
    return out


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_compiled_training_equals_eager(kit, name: str) -> None:
    eager, compiled = pair(kit, name)
    before = compile_counts()
    px, frames = PX[STRATEGIES[name][0]], FRAMES[STRATEGIES[name][0]]
    got = train([eager, compiled], WARMUP + STEPS, px, frames)
    after_warmup = got["counts"][WARMUP - 1]
    assert after_warmup["graphs"] > before["graphs"]  # it really ran compiled code
    assert got["counts"][-1]["frames"] == after_warmup["frames"], "recompiled after the warm-up"
    for (a, b), diff in zip(got["loss"], got["grad_diff"], strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
        assert diff < 1e-4
    kit.assert_close_dicts(kit.bn_buffers(eager), kit.bn_buffers(compiled))
    eager.eval(), compiled.eval()
    video = clips(99, px, frames)[0]
    with torch.no_grad():
        torch.testing.assert_close(compiled(video), eager(video), rtol=1e-4, atol=1e-5)
    assert compile_counts()["graphs"] > got["counts"][-1]["graphs"]  # evaluation compiled too


@pytest.fixture(scope="module")
def fresh_peaks() -> dict[str, dict[str, float]]:
    """Every strategy's median step peak (MB), eager and compiled, measured in a fresh process
    (``compiled_peaks_worker.py`` says why)."""
    worker = Path(__file__).with_name("compiled_peaks_worker.py")
    done = subprocess.run([sys.executable, str(worker), *STRATEGIES], capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_compiled_peak_is_at_most_eagers(fresh_peaks: dict[str, dict[str, float]], name: str) -> None:
    """The same plan compiled: its measured step peak at most 1.10x eager's."""
    peak = fresh_peaks[name]
    assert peak["compiled"] <= PEAK_RATIO * peak["eager"], peak


def compiled_steps(model: nn.Module, steps: int, start: int = 0, px: int = 64) -> list[int]:
    """SGD steps of ``model``; dynamo's compiled-frame count after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    for i in range(start, start + steps):
        video, labels = clips(i, px)
        opt.zero_grad()
        nn.functional.cross_entropy(model(video), labels).backward()
        opt.step()
        counts.append(compile_counts()["frames"])
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_fifty_steps_compile_once(kit, name: str) -> None:
    """50 steps after the warm-up, 0 recompiles."""
    _, compiled = pair(kit, name)
    counts = compiled_steps(compiled, WARMUP + 50, px=PX[STRATEGIES[name][0]])
    assert counts[-1] == counts[WARMUP - 1] > 0


def stand_in_estimate(node: dict) -> StepMemory:
    """A step of 100 MB for e2e and less for the others (SBP 20 + 80 r, recompute 70 + 30 x
    its budget fraction, frame dropout 80 r), over 50 MB held."""
    strategy = instantiate(node)
    if isinstance(strategy, StochasticBackprop):
        mb = (5 if strategy.bn_policy == "frozen" else 20) + 80 * strategy.keep_ratio
    elif isinstance(strategy, Recompute):
        mb = 70 + 30 * (strategy.budget_frac or 0)
    elif isinstance(strategy, FrameDropout):
        mb = 80 * strategy.keep_ratio
    else:
        mb = 100
    held = 50 * 2**20
    return StepMemory(held=held, batch=10 * 2**20, fwd_bwd_peak=held + int(mb * 2**20),
                      opt_peak=held + 1, eval_peak=held + 1)


def test_auto_compiles_its_plan_and_a_step_down_once(kit) -> None:
    """memory=auto runs its plan compiled; a step-down compiles the next plan, once."""
    auto = AutoStrategy(budget_mb=70)
    bb = kit.BACKBONES["resnet"]()
    model = VideoClassifier(bb, kit.make_head(bb.feature_dim), auto).train()
    auto.plan(stand_in_estimate, 8, torch.device("cpu"))
    compile_model(model, Compiler(backend="aot_eager"))
    first = auto.active
    counts = compiled_steps(model, WARMUP + 2)
    assert counts[0] > 0 and counts[-1] == counts[WARMUP - 1]
    auto.observe_step(1, 1.0)
    auto.observe_step(2, 1e6)  # over the budget: the next plan
    assert auto.active is not first and auto.step_downs[-1]["to"] == auto.active.name
    after = compiled_steps(model, WARMUP + 2, start=10)
    assert after[0] > counts[-1]  # the new plan compiled
    assert after[-1] == after[WARMUP - 1]  # once


def test_the_rule_and_the_checks() -> None:
    assert wants_compile("auto", "cuda") and not wants_compile("auto", "cpu")
    assert wants_compile(True, "cpu") and not wants_compile(False, "cuda")
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="trainer.compile must be"):
            check_compile(bad)
    with pytest.raises(ValueError, match="trainer.compile_mode"):
        Compiler(mode="fast")
    assert Compiler(mode="reduce-overhead").options()["mode"] == "reduce-overhead"
    assert "mode" not in Compiler().options()  # null: the compiler's own default


def test_a_run_trains_and_validates_compiled_as_eager(run_overrides, compose_cfg, metrics_rows,
                                                      monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """run.train with trainer.compile=true: the trainer compiles the model (aot_eager here),
    training and validation run compiled, and the run's losses and validation are eager's."""
    import videotrain.engine.trainer as trainer_module
    import videotrain.run as run

    monkeypatch.setattr(trainer_module, "Compiler", functools.partial(Compiler, backend="aot_eager"))
    extra = {"memory": "sbp", "trainer.max_steps": 3, "trainer.val_every_n_epochs": 1}
    results, rows, frames = {}, {}, {}
    for mode in ("false", "true"):
        before = compile_counts()["frames"]
        results[mode] = run.train(compose_cfg(run_overrides(trainer__compile=mode, **extra)), tmp_path / mode)
        frames[mode] = compile_counts()["frames"] - before
        rows[mode] = [r["train_loss"] for r in metrics_rows(tmp_path / mode) if "train_loss" in r]
    # at least one lockstep region, then validation's backbone (how many regions dynamo counts
    # as frames differs between torch versions: 2 on torch 2.11, 3 on 2.14)
    assert frames["false"] == 0 and frames["true"] >= 2
    assert rows["true"] == pytest.approx(rows["false"], rel=1e-5) and len(rows["true"]) == 3
    for key in ("val_loss", "val_top1", "steps"):
        assert results["true"][key] == pytest.approx(results["false"][key], rel=1e-5), key


def test_inductor_trains_sbp_as_eager(kit) -> None:
    """The compiler's own backend (inductor, C++ on the CPU) on SBP's lockstep regions: the
    losses and gradients are eager's within fp32 rounding (inductor's fused reductions: up to
    about 1e-3 of a gradient here), and nothing recompiles."""
    bb = kit.BACKBONES["vit"]()
    head = kit.make_head(bb.feature_dim)
    eager = VideoClassifier(copy.deepcopy(bb), copy.deepcopy(head), StochasticBackprop(0.5)).train()
    compiled = VideoClassifier(bb, head, StochasticBackprop(0.5)).train()
    compile_model(compiled, Compiler())
    got = train([eager, compiled], WARMUP + 2, PX["vit"])
    assert got["counts"][-1]["frames"] == got["counts"][WARMUP - 1]["frames"] > 0
    for (a, b), diff in zip(got["loss"], got["grad_diff"], strict=True):
        assert b == pytest.approx(a, rel=1e-4)
        assert diff < 5e-3, got["grad_diff"]  # fused kernels sum in another order


def test_an_untraceable_block_is_compiled_as_its_forward_and_says_so(caplog) -> None:
    """A block fx cannot trace (control flow on a value) still runs compiled, as its bound
    forward, with one log line naming it and the reason."""
    from videotrain.memory.compiled import compiled_forward

    class Gate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.sum() > 0 else x

    block = Gate()
    with caplog.at_level("INFO", logger="videotrain.memory.compiled"):
        run = compiled_forward(block, block.forward, Compiler(backend="aot_eager"))
    assert "Gate is compiled as its forward" in caplog.text and "TraceError" in caplog.text
    x = torch.ones(3)
    assert torch.equal(run(x), x * 2) and torch.equal(run(-x), -x)
