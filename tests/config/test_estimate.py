"""``videotrain.config.estimate``: a configured run's step on fake tensors, against an
independent count (torch's MemTracker), built as training builds it, and free of torch's
warnings about fake tensors."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

from videotrain.config.build import compose_cfg
from videotrain.config.estimate import simulate_cfg
from videotrain.memory.estimate import GIB

TINY = ["model/backbone=resnet10", "model/head=tconv", "data.num_frames=8", "data.crop_size=96",
        "data.batch_size=2", "data.val_batch_size=2", "trainer.precision=bf16"]


def test_e2e_row_agrees_with_torch_memtracker_over_meta_tensors() -> None:
    """fp32 e2e against an independent count: torch's MemTracker over meta tensors of the same
    model, batch and AdamW step, the second step (parameters, gradients and optimizer state
    included)."""
    from hydra.utils import instantiate
    from torch.distributed._tools.mem_tracker import MemTracker

    from videotrain.models.video import VideoClassifier

    overrides = ["model/backbone=resnet18", "model/head=mean", "data.num_frames=8",
                 "data.crop_size=112", "data.batch_size=4", "trainer.grad_clip=null"]
    cfg = compose_cfg(overrides)
    ours = simulate_cfg(cfg, "cpu", with_eval=False).train_peak
    with torch.device("meta"):
        backbone = instantiate(cfg.model.backbone, pretrained=None)
        model = VideoClassifier(backbone, instantiate(cfg.model.head, in_dim=backbone.feature_dim,
                                                      num_classes=400))
        video = torch.randn(4, 8, 3, 112, 112)
        labels = torch.randint(0, 400, (4,))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    F.cross_entropy(model(video), labels).backward()  # step 1: gradients and AdamW state exist
    optimizer.step()  # from here on, as in the trainer's steady state (zeroed, not freed)
    optimizer.zero_grad(set_to_none=False)
    tracker = MemTracker()
    tracker.track_external(model, optimizer, video)
    with tracker:
        F.cross_entropy(model(video), labels).backward()
        optimizer.step()
    theirs = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    print(f"e2e fp32: predicted {ours / GIB:.4f} GiB, MemTracker {theirs / GIB:.4f} GiB")
    assert ours == pytest.approx(theirs, rel=0.25), (ours / GIB, theirs / GIB)


def test_fit_simulates_sync_bn_as_training_builds_it() -> None:
    """``trainer.sync_bn=true`` reaches the simulated model: SBP's full-batch BN statistics are
    refused with it, in the prediction as in training."""
    cfg = compose_cfg([*TINY, "trainer.sync_bn=true", "memory=sbp", "memory.bn_policy=full_batch"])
    with pytest.raises(ValueError, match="trainer.sync_bn=true does not combine with memory=sbp"):
        simulate_cfg(cfg, "cuda")


@pytest.mark.parametrize("head", ["transformer", "lstm", "tconv", "mean"])
def test_simulation_reads_no_fake_tensor_data_pointer(head: str) -> None:
    """torch warns when code reads a fake tensor's data pointer (``nn.TransformerEncoder``'s
    deep copy of its layer did, under ``plan --fit`` and ``memory=auto``); as an error here."""
    cfg = compose_cfg([*TINY, f"model/head={head}", "data.num_frames=4", "data.crop_size=64"])
    gc.disable()  # as in the simulator's processes (videotrain.memory.estimate)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="Accessing the data pointer of FakeTensor")
            assert simulate_cfg(cfg, "cuda").train_peak > 0
    finally:
        gc.enable()
