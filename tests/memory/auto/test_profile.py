"""``StepProbe``: real measured steps on a copy, leaving the run untouched; ``unprepare``.

The figures the CPU meter reads (step peaks) are taken in a fresh interpreter (this file run as
a script). The meter reads the resident set, and in a process that has already run many tests
the heap holds large free blocks from before the meter's malloc setting took effect: malloc
serves a step's tensors from them instead of mapping new memory, and their pages count again
as they are touched, in whatever order the free lists give. In CI's floor job (one process
that collects about 870 tests, 50 run before these) SBP's step read 77-80 MB against e2e's 65
MB, where a fresh process reads 30 against 62. Counted figures (saved bytes, input bytes) and
the state checks run here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from videotrain.engine.optim import build_optimizer
from videotrain.engine.precision import Precision
from videotrain.memory.auto.candidates import sbp_peak
from videotrain.memory.auto.profile import MB, Profile, StepProbe, device_free_bytes, unprepare
from videotrain.memory.recompute.execute import RecomputedForward
from videotrain.memory.recompute.strategy import Recompute
from videotrain.memory.sbp.split import PatchedBN
from videotrain.memory.sbp.strategy import StochasticBackprop
from videotrain.models.backbones import resnet, vit
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier

CPU = torch.device("cpu")
SHAPE = (2, 8, 3, 96, 96)  # (B, T, C, H, W): activations (~45 MB) well above the optimizer step's transients


def model_and_probe(strategy=None) -> tuple[VideoClassifier, StepProbe]:
    torch.manual_seed(0)
    backbone = resnet(layers=[1, 1, 1, 1])
    model = VideoClassifier(backbone, TConvHead(backbone.feature_dim, 4, hidden_dim=16), strategy)
    probe = StepProbe(model, lambda m: build_optimizer(m, "adamw", 1e-3, 0.05), Precision("32", CPU),
                      CPU, SHAPE, num_classes=4, grad_clip=1.0)
    return model.train(), probe


def _vit_probe() -> StepProbe:
    """A small ViT (LayerNorm: SBP's dropped frames run alone) on 4 clips of 8 frames at 112 px."""
    torch.manual_seed(0)
    backbone = vit(image_size=112, patch_size=16, num_layers=4, num_heads=3, hidden_dim=192, mlp_dim=768)
    model = VideoClassifier(backbone, TConvHead(backbone.feature_dim, 4, hidden_dim=16))
    return StepProbe(model, lambda m: build_optimizer(m, "adamw", 1e-3, 0.05), Precision("32", CPU),
                     CPU, (4, 8, 3, 112, 112), num_classes=4, grad_clip=1.0)


def _wrapped(backbone: nn.Module) -> list[object]:
    return [m.__dict__["forward"] for m in backbone.modules()
            if isinstance(m.__dict__.get("forward"), PatchedBN | RecomputedForward)]


@pytest.fixture(scope="module")
def probed():
    model, probe = model_and_probe()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    prof = probe.profile()
    sbp = probe.measure(StochasticBackprop(0.25))
    ckpt = probe.measure(Recompute("blocks"), isolated=True)
    yield model, probe, prof, sbp, ckpt, before, rng
    probe.close()


def test_profile_leaves_the_run_untouched(probed) -> None:
    model, probe, _, _, _, before, rng = probed
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and BN statistics
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert _wrapped(model.backbone) == []  # the probe's strategies never touched it
    # warm-up + e2e + 2 on half the clips; sbp x2; a fresh copy's warm-up + 2
    assert probe.steps_run == 4 + 2 + 3


def _simulated_oom(real):
    """``StepProbe._step`` whose steps of more than one clip run out of memory (CUDA's error,
    simulated on the CPU)."""

    def step(self, *args, **kwargs) -> None:
        if self.clips > 1:
            raise torch.cuda.OutOfMemoryError("simulated")
        real(self, *args, **kwargs)

    return step


def _metered_figures() -> dict[str, object]:
    """What the fresh interpreter measures: the e2e profile, SBP at r=0.25, frozen-BN SBP at
    r=1/8 and block checkpointing on one probe; a small ViT's profile and its SBP at r=1/8; then
    the profile of a probe whose 2-clip steps run out of memory."""
    _, probe = model_and_probe()
    out: dict[str, object] = {"profile": dataclasses.asdict(probe.profile())}
    out["sbp"] = probe.measure(StochasticBackprop(0.25)).peak
    out["frozen"] = probe.measure(StochasticBackprop(0.125, bn_policy="frozen")).peak
    out["ckpt"] = probe.measure(Recompute("blocks"), isolated=True).peak
    probe.close()
    vit_probe = _vit_probe()
    out["vit_profile"] = dataclasses.asdict(vit_probe.profile())
    out["vit_sbp"] = vit_probe.measure(StochasticBackprop(0.125)).peak
    vit_probe.close()
    real = StepProbe._step
    StepProbe._step = _simulated_oom(real)
    try:
        _, small = model_and_probe()
        out["small"] = dataclasses.asdict(small.profile())
    finally:
        StepProbe._step = real
    return out


@pytest.fixture(scope="module")
def metered() -> dict:
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_profile_counts_are_consistent(probed) -> None:
    _, _, prof, _, _, _, _ = probed
    assert prof.frames == 16 and prof.has_batchnorm
    assert prof.lockstep  # the resnet traces, so full-batch SBP runs in one forward
    assert 0 < prof.saved_backbone <= prof.saved_total
    assert prof.input_bytes == 16 * 3 * 96 * 96 * 4
    assert min(prof.fwd_s, prof.bwd_s, prof.opt_s, prof.backbone_fwd_s) > 0
    assert prof.as_dict()["e2e_peak_mb"] == prof.e2e_peak / MB


def test_metered_peaks_are_consistent(metered: dict) -> None:
    prof, sbp, ckpt = metered["profile"], metered["sbp"], metered["ckpt"]
    # the step holds every saved activation at once, and more (gradients in flight)
    assert prof["e2e_peak"] >= prof["saved_total"] > 0
    # a no_grad forward stores nothing: only a few layers' outputs live at once
    assert 0 < prof["nograd_peak"] < prof["saved_backbone"]
    # measured, not modelled: SBP at r=0.25 stores a quarter of the backbone's activations,
    # so it saves at least half of the other three quarters; block checkpointing saves some
    assert sbp < prof["e2e_peak"] - 0.5 * 0.75 * prof["saved_backbone"], metered
    assert ckpt < prof["e2e_peak"], metered


def test_lockstep_nograd_pass_counts_its_input_copies(metered: dict) -> None:
    """SBP's one lockstep pass with frozen BN, one frame of each clip kept: the dropped frames'
    no_grad forward (7/8 of the no_grad peak) plus the copies of the input it makes, which are
    live at a ResNet's first conv, where its no_grad peak is; and frozen SBP at r = 1/8 as
    ``sbp_peak`` estimates it from the profile."""
    prof = metered["profile"]
    expected = 7 / 8 * prof["nograd_peak"] + prof["input_bytes"]
    assert abs(prof["twin_nograd_peak"] - expected) < 0.5 * prof["input_bytes"], metered
    estimate = sbp_peak(Profile(**prof), 1, full_batch=False, chunk=16)
    assert estimate == pytest.approx(metered["frozen"], rel=0.05), metered


def test_sbp_estimates_hold_r_of_the_overhead_that_grows_with_the_frames(metered: dict) -> None:
    """A ViT's step overhead (peak minus saved activations) is mostly its backward's transients,
    which grow with the frames that backpropagate: the probe measures that part from a step on
    half the clips, and SBP's estimate holds r of it. At r = 1/8 it measured 11.5 MB, estimated
    12.5; the whole overhead gave 15.5 (35% high; 30.4 against 23.1 MB on 8 clips)."""
    prof = Profile(**metered["vit_profile"])
    assert 0.5 * prof.overhead < prof.overhead_frames <= prof.overhead, metered["vit_profile"]
    estimate = sbp_peak(prof, 1, full_batch=False, chunk=prof.frames)
    assert estimate == pytest.approx(metered["vit_sbp"], rel=0.15), (estimate / MB, metered["vit_sbp"] / MB)


def test_profile_on_fewer_clips_after_out_of_memory(metered: dict) -> None:
    """e2e that does not fit the device: profiled on 1 of 2 clips, extrapolated, compared with the
    full-batch profile of the same model."""
    full, small = metered["profile"], metered["small"]
    assert small["measured_clips"] == 1 and small["batch_size"] == 2
    assert small["saved_total"] == pytest.approx(full["saved_total"], rel=0.01)  # activations scale
    assert small["saved_backbone"] == pytest.approx(full["saved_backbone"], rel=0.01)
    assert small["e2e_peak"] == pytest.approx(full["e2e_peak"], rel=0.15), metered


def test_candidates_run_on_the_whole_batch_after_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """After an e2e profile on fewer clips, candidates are still measured on the whole batch
    (and fail there the same way), and the backbone is unprepared even when the step failed."""
    monkeypatch.setattr(StepProbe, "_step", _simulated_oom(StepProbe._step))
    _, probe = model_and_probe()
    small = probe.profile()
    assert small.extrapolated and small.measured_clips == 1
    assert probe.clips == 2  # candidates are measured on the whole batch
    with pytest.raises(torch.cuda.OutOfMemoryError):
        probe.measure(StochasticBackprop(0.5))
    assert _wrapped(probe.model.backbone) == []  # unprepared even when the step failed
    probe.close()


def test_unprepare_restores_the_backbone() -> None:
    torch.manual_seed(0)
    backbone = resnet(layers=[1, 1, 1, 1]).train()
    reference = copy.deepcopy(backbone)
    own = backbone.net.conv1.__dict__.get("forward")
    marker = lambda x: x  # noqa: E731  an instance-level forward set by someone else
    backbone.net.conv1.forward = marker
    StochasticBackprop(0.5).prepare(backbone)
    Recompute("blocks").prepare(backbone)
    assert len(_wrapped(backbone)) > 4
    unprepare(backbone)
    assert _wrapped(backbone) == [] and backbone.net.conv1.forward is marker
    del backbone.net.conv1.forward
    assert own is None
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(backbone.eval()(x), reference.eval()(x))
    # a second SBP prepares the backbone as its own again
    second = StochasticBackprop(0.5)
    second.prepare(backbone)
    assert all(f.owner is second.norm for f in _wrapped(backbone))


def test_device_free_bytes_on_cpu() -> None:
    assert device_free_bytes(CPU) > 0


if __name__ == "__main__":  # the fresh interpreter of the ``metered`` fixture
    print(json.dumps(_metered_figures()))
