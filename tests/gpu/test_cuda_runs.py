"""On a CUDA device (``pytest -m gpu``): training runs in each mixed precision, and ``plan
--fit``'s prediction of a step's memory against what CUDA's allocator measures.

The CPU twins of these checks run in the default suite (bf16 CPU autocast everywhere; the
predictor against torch's MemTracker in tests/config/test_estimate.py). Here the GPU code paths run for real:
fp16's GradScaler, CUDA autocast, ``max_memory_allocated``. Each test prints its figures, so a
GPU run's log (docs/results/gpu/) holds them whether or not it passes.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from videotrain import run
from videotrain.config.estimate import simulate_cfg
from videotrain.memory.estimate import UNSEEN_FRAC

pytestmark = pytest.mark.gpu
MIB = 2**20


@pytest.mark.parametrize("memory", ["sbp", "sbp-frozen", "recompute"])
@pytest.mark.parametrize("precision", ["bf16", "16"])
def test_training_run_on_cuda(cuda: torch.device, run_overrides, compose_cfg, metrics_rows,
                              tmp_path: Path, precision: str, memory: str) -> None:
    """Two epochs of the tiny run on CUDA: finite losses every step, a metered peak every step,
    validation each epoch, and a checkpoint with the GradScaler's state (fp16: a live scale).
    ``sbp-frozen``: SBP's plain scheme (``memory.bn_policy=frozen``)."""
    extra = {"memory__bn_policy": "frozen"} if memory == "sbp-frozen" else {}
    overrides = run_overrides(device="cuda", trainer__precision=precision,
                              memory=memory.removesuffix("-frozen"), trainer__max_epochs=2, **extra)
    results = run.train(compose_cfg(overrides), tmp_path)
    rows = metrics_rows(tmp_path)
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    peaks = [r["peak_mem_mb"] for r in rows if "train_loss" in r]
    print(f"{precision} {memory}: losses {[round(x, 4) for x in losses]}, "
          f"peaks {[round(p, 2) for p in peaks]} MB, val {results.get('val_top1')}")
    assert results["steps"] == len(losses) == 8
    assert all(math.isfinite(x) for x in losses), losses
    assert all(p is not None and p > 0 for p in peaks), peaks
    assert [r["step"] for r in rows if "val_top1" in r] == [4, 8]
    blob = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    if precision == "16":
        assert blob["scaler"]["scale"] > 0, blob["scaler"]
    else:
        assert not blob["scaler"], blob["scaler"]  # no scaler without fp16


@pytest.mark.parametrize("memory", [["memory=e2e"], ["memory=sbp"], ["memory=sbp", "memory.bn_policy=frozen"],
                                    ["memory=recompute", "memory.policy=sqrt"]],
                         ids=["e2e", "sbp", "sbp-frozen", "checkpoint-sqrt"])
def test_fit_estimate_against_the_cuda_peak(cuda: torch.device, compose_cfg, tmp_path: Path,
                                              memory: list[str]) -> None:
    """The default job's model and batch (synthetic task, resnet10 + tconv, B=8 x T=8 at 64
    px) in bf16: the fake-tensor prediction that ``plan --fit`` makes, against the trainer's
    metered step peak (``max_memory_allocated`` over the step minus what the step started
    with) and the whole run's ``max_memory_allocated``. The run's peak must stay within what
    ``plan --fit`` budgets (the prediction plus its unseen share), and the step's within 15%."""
    cfg = compose_cfg(["device=cuda", "trainer.precision=bf16", "trainer.max_steps=4",
                       "trainer.progress=false", "logger.wandb.mode=disabled", *memory])
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(cuda)
    before = torch.cuda.memory_allocated(cuda)
    results = run.train(cfg, tmp_path)
    run_peak = (torch.cuda.max_memory_allocated(cuda) - before) / MIB
    predicted = simulate_cfg(cfg, "cuda")  # after the run: the dataset (its classes) exists
    step_pred = predicted.step_increase / MIB
    peak_pred = max(predicted.train_peak, predicted.eval_peak or 0) / MIB
    step = results["train_peak_mem_mb"]
    print(f"{' '.join(memory)}: step peak measured {step:.1f} MB, predicted {step_pred:.1f} MB "
          f"({step / step_pred - 1:+.1%}); run peak measured {run_peak:.1f} MB, predicted "
          f"{peak_pred:.1f} MB ({run_peak / peak_pred - 1:+.1%}), budgeted "
          f"{peak_pred * (1 + UNSEEN_FRAC):.1f} MB")
    assert run_peak <= peak_pred * (1 + UNSEEN_FRAC)
    assert step == pytest.approx(step_pred, rel=0.15)


def test_clips_to_device_normalizes_uint8_on_cuda(cuda: torch.device) -> None:
    """The trainer's input path on a GPU: a pinned uint8 batch copied without blocking and
    normalized there by one ``addcmul`` that reads uint8 (dynamic casting in CUDA's kernel),
    equal to the CPU's result."""
    from videotrain.data.transforms import clips_to_device

    clips = torch.randint(0, 256, (2, 4, 3, 16, 16), dtype=torch.uint8).pin_memory()
    got = clips_to_device(clips, cuda)
    assert got.device.type == "cuda" and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), clips_to_device(clips, torch.device("cpu")), rtol=0, atol=1e-6)
