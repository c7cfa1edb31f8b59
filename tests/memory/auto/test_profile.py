"""``StepProbe``: real measured steps on a copy, leaving the run untouched; ``unprepare``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from videotrain.engine.optim import build_optimizer
from videotrain.engine.precision import Precision
from videotrain.memory.auto.profile import MB, StepProbe, device_free_bytes, unprepare
from videotrain.memory.recompute.execute import CheckpointedForward
from videotrain.memory.recompute.strategy import Recompute
from videotrain.memory.sbp.split import PatchedBN
from videotrain.memory.sbp.strategy import StochasticBackprop
from videotrain.models.backbones import resnet
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


def _wrapped(backbone: nn.Module) -> list[object]:
    return [m.__dict__["forward"] for m in backbone.modules()
            if isinstance(m.__dict__.get("forward"), PatchedBN | CheckpointedForward)]


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
    assert probe.steps_run == 2 + 2 + 3  # warm-up + e2e; sbp x2; a fresh copy's warm-up + 2


def test_profile_figures_are_consistent(probed) -> None:
    _, _, prof, sbp, ckpt, _, _ = probed
    assert prof.frames == 16 and prof.has_batchnorm
    assert prof.lockstep  # the resnet traces, so full-batch SBP runs in one forward
    assert 0 < prof.saved_backbone <= prof.saved_total
    assert prof.input_bytes == 16 * 3 * 96 * 96 * 4
    # the step holds every saved activation at once, and more (gradients in flight)
    assert prof.e2e_peak >= prof.saved_total > 0
    # a no_grad forward stores nothing: only a few layers' outputs live at once
    assert 0 < prof.nograd_peak < prof.saved_backbone
    assert min(prof.fwd_s, prof.bwd_s, prof.opt_s, prof.backbone_fwd_s) > 0
    # measured, not modelled: SBP at r=0.25 stores a quarter of the backbone's activations,
    # so it saves at least half of the other three quarters; block checkpointing saves some
    assert sbp.peak < prof.e2e_peak - 0.5 * 0.75 * prof.saved_backbone
    assert ckpt.peak < prof.e2e_peak
    assert prof.as_dict()["e2e_peak_mb"] == prof.e2e_peak / MB


def test_profile_on_fewer_clips_after_out_of_memory(probed, monkeypatch: pytest.MonkeyPatch) -> None:
    """e2e that does not fit the device: profiled on 1 of 2 clips, extrapolated, compared with the
    full-batch profile of the same model (CUDA's out-of-memory error simulated on the CPU)."""
    full = probed[2]
    real = StepProbe._step

    def step(self, *args, **kwargs) -> None:
        if self.clips > 1:
            raise torch.cuda.OutOfMemoryError("simulated")
        real(self, *args, **kwargs)

    monkeypatch.setattr(StepProbe, "_step", step)
    _, probe = model_and_probe()
    small = probe.profile()
    assert small.extrapolated and small.measured_clips == 1 and small.batch_size == 2
    assert small.saved_total == pytest.approx(full.saved_total, rel=0.01)  # activations scale
    assert small.saved_backbone == pytest.approx(full.saved_backbone, rel=0.01)
    assert small.e2e_peak == pytest.approx(full.e2e_peak, rel=0.15)
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
