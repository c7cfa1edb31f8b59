"""The estimate for a CPU target against the trainer's CPU meter: a training step counted on fake
tensors with oneDNN's convolution backward (``OneDNNConvBackward``) reads what the meter reads
for the same step, run for real in a fresh interpreter (this file as a script: a process that
has run other tests reuses heap blocks, and the meter then reads their history)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from videotrain.memory.estimate import simulate_step
from videotrain.memory.recompute.strategy import Recompute
from videotrain.memory.sbp.strategy import StochasticBackprop
from videotrain.models.backbones import resnet
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier

SHAPE = (4, 8, 3, 64, 64)  # (B, T, C, H, W): activations, not the optimizer step, set the peak
PLANS = {"e2e": lambda: None, "sbp 0.5": lambda: StochasticBackprop(0.5),
         "sbp 0.25": lambda: StochasticBackprop(0.25), "recompute sqrt": lambda: Recompute("sqrt")}
MB = 2**20


def _model(plan: str) -> VideoClassifier:
    torch.manual_seed(0)
    backbone = resnet(layers=[1, 1, 1, 1])
    return VideoClassifier(backbone, TConvHead(backbone.feature_dim, 4, hidden_dim=16), PLANS[plan]())


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), foreach=False)  # the CPU target's kernels


def _estimate(plan: str, onednn: bool) -> float:
    """The step's peak over what is held between steps, the batch included (the meter's scale)."""
    mem = simulate_step(lambda: _model(plan), _optimizer, SHAPE, 4, grad_clip=1.0, onednn=onednn)
    return (mem.train_peak - (mem.held - mem.batch)) / MB


def _measured() -> dict[str, float]:
    """Each plan's third step under the trainer's meter, for real (run in a fresh interpreter)."""
    from videotrain.metrics.memory import StepPeakMemory

    meter, out = StepPeakMemory(torch.device("cpu")), {}
    for plan in PLANS:
        model = _model(plan).train()
        optimizer = _optimizer(model)
        video = torch.randn(*SHAPE)  # (B, T, C, H, W)
        labels = torch.randint(0, 4, (SHAPE[0],))
        for _ in range(3):
            meter.start()
            step_video = video.clone()  # the batch is made inside the step, as the trainer's is
            F.cross_entropy(model(step_video), labels).backward()
            del step_video
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            out[plan] = meter.stop()
        del model, optimizer
    return out


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a CPU build without oneDNN")
@pytest.mark.parametrize("plan", list(PLANS))
def test_the_cpu_estimate_reads_what_the_meter_reads(measured: dict[str, float], plan: str) -> None:
    ours, meter = _estimate(plan, onednn=True), measured[plan]
    assert ours == pytest.approx(meter, rel=0.03), (plan, ours, meter)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a CPU build without oneDNN")
def test_without_onednns_reorder_e2e_reads_low(measured: dict[str, float]) -> None:
    """The term matters: without it e2e's estimate is under the meter by more than the tolerance."""
    assert _estimate("e2e", onednn=False) < 0.97 * measured["e2e"]


if __name__ == "__main__":  # the fresh interpreter of the ``measured`` fixture
    print(json.dumps(_measured()))
