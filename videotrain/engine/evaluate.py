"""Evaluation over multi-view items: every strategy evaluates the same way (all frames).

``evaluate`` runs the model over a loader and returns accuracies (validation during training);
``multi_view_test`` is the paper-style test (``eval.clips`` x ``eval.crops`` views per video)
that ``python -m videotrain.eval`` and ``trainer.test_after_fit`` run, writing its report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

from videotrain import NEUTRAL
from videotrain.data.loaders import DataBundle
from videotrain.data.preflight import check_bad_fraction
from videotrain.data.transforms import clips_to_device
from videotrain.engine.precision import Precision
from videotrain.metrics.accuracy import AGGREGATES, MultiViewAccuracy
from videotrain.metrics.eval_report import write_eval_report
from videotrain.untrusted import shown_name

log = logging.getLogger(__name__)


@dataclass
class EvalSettings:
    """The ``eval`` config group: how a trained model is scored, so none of it changes training
    (every key resume-neutral)."""

    clips: int = field(default=10, metadata=NEUTRAL)  # temporal clips per video, evenly spaced
    # spatial crops per clip: 1 = centre, 3 = left/centre/right (or top/.../bottom)
    crops: int = field(default=3, metadata=NEUTRAL)
    aggregate: str = field(default="mean", metadata=NEUTRAL)  # how the views' softmax becomes the video's scores
    batch_size: int = field(default=1, metadata=NEUTRAL)  # videos per forward (each is clips x crops views)
    # backbone frames per forward: auto | None (all) | N
    frame_chunk: int | str | None = field(default="auto", metadata=NEUTRAL)

    def __post_init__(self) -> None:
        for key in ("clips", "crops", "batch_size"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"eval.{key} must be >= 1, got {getattr(self, key)}")
        chunk = self.frame_chunk
        if not (chunk is None or chunk == "auto" or (isinstance(chunk, int) and chunk >= 1)):
            raise ValueError(f"eval.frame_chunk must be auto, null or a number of frames >= 1, "
                             f"got {chunk!r}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"eval.aggregate must be one of {', '.join(AGGREGATES)}, "
                             f"got {self.aggregate!r}")


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
        if batch["video"] is None:  # every video of the batch was unreadable: none is scored
            continue
        video = clips_to_device(batch["video"], device)  # (B, V, T, C, H, W) float32
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


def multi_view_test(model: torch.nn.Module, data: DataBundle, bad: list[str], settings: EvalSettings,
                    precision: Precision, device: torch.device, out_dir: str | Path, *,
                    max_bad_fraction: float, progress: bool = False,
                    checkpoint: str | None = None, **describe: Any) -> dict[str, Any]:
    """Evaluate ``model`` on ``data.val`` (built with ``settings``' views per video); writes
    ``eval.json``, ``per_class.csv`` and ``confusion.png`` into ``out_dir`` and returns the
    summary ``eval.json`` holds. ``describe`` adds fields to it (the clip shape, say). Under
    DDP (``data.val`` sharded by rank) it is a collective: the counts and skipped files are
    reduced over the ranks, every rank returns the summary, and rank 0 writes the report."""
    s = settings
    meter = MultiViewAccuracy((1, 5), data.num_classes, s.aggregate)
    skipped = set(bad)
    index = data.val.dataset.index
    val_paths = {p for p, _ in index.paths}

    def on_skipped(paths: list[str]) -> None:
        skipped.update(paths)
        check_bad_fraction(len(skipped & val_paths), len(val_paths), index.source, max_bad_fraction)

    m = evaluate(model, data.val, precision, device, progress=progress, on_skipped=on_skipped,
                 meter=meter)  # under DDP: each rank its shard of the videos, the counts reduced
    writes = True
    if dist.is_available() and dist.is_initialized():
        shards: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shards, sorted(skipped))
        skipped = set().union(*shards)
        writes = dist.get_rank() == 0  # every rank has the summary, rank 0 writes it
    summary = {
        "checkpoint": checkpoint, "split": "val", "source": index.source,
        "clips": s.clips, "crops": s.crops, "views": s.clips * s.crops, "aggregate": s.aggregate,
        "video_top1": m["val_top1"], "video_top5": m["val_top5"],
        "clip_top1": m["val_clip_top1"], "clip_top5": m["val_clip_top5"],
        "mean_class_acc": m["val_mean_class_acc"], "loss": m["val_loss"],
        "videos": m["val_videos"], "videos_listed": data.val_listed or len(index),
        "num_classes": data.num_classes, "dropped_classes": [shown_name(n) for n in data.dropped_classes],
        "skipped_videos": len(skipped), "skipped_paths": sorted(skipped), **describe,
    }
    if not writes:
        return summary
    write_eval_report(out_dir, summary, meter.confusion, data.class_names)
    log.info("eval (%d clips x %d crops, %s): video top-1 %.4f top-5 %.4f, clip top-1 %.4f, "
             "mean class acc %.4f over %d of %d listed videos%s; written to %s", s.clips, s.crops,
             s.aggregate, summary["video_top1"], summary["video_top5"], summary["clip_top1"],
             summary["mean_class_acc"], summary["videos"], summary["videos_listed"],
             f" (data.drop_classes: {', '.join(map(shown_name, data.dropped_classes))})" if data.dropped_classes else "",
             out_dir)
    return summary
