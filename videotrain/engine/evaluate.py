"""Evaluation over multi-view items: every strategy evaluates the same way (all frames)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

from videotrain.engine.precision import Precision
from videotrain.metrics.accuracy import MultiViewAccuracy


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: DataLoader,
    precision: Precision,
    device: torch.device,
    ks: tuple[int, ...] = (1, 5),
    progress: bool = False,
    on_skipped: Callable[[list[str]], None] | None = None,
    num_classes: int | None = None,
    aggregate: str = "mean",
    meter: MultiViewAccuracy | None = None,
) -> dict[str, float]:
    """Clip-level and video-level (views' softmax aggregated by ``aggregate``) top-k and mean
    class accuracy; reduced over DDP ranks. Pass ``meter`` to keep the per-class counts."""
    was_training = model.training
    model.eval()
    acc = meter if meter is not None else MultiViewAccuracy(ks, num_classes, aggregate)
    for batch in tqdm(loader, desc="val", disable=not progress, leave=False):
        if on_skipped and batch["skipped"]:
            on_skipped(batch["skipped"])
        video = batch["video"].to(device, non_blocking=True)  # (B, V, T, C, H, W)
        labels = batch["label"].to(device, non_blocking=True)
        b, v = video.shape[:2]
        with precision.autocast():
            logits = model(video.flatten(0, 1))  # (B*V, K)
        acc.update(logits.view(b, v, -1), labels)
    if dist.is_available() and dist.is_initialized():
        t = acc.state().to(device)
        dist.all_reduce(t)
        acc.load(t.cpu())
    model.train(was_training)
    return acc.compute()
