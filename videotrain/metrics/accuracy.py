"""Top-k accuracy at clip level and at video level (the views' softmax aggregated), plus the
video-level confusion matrix behind mean class accuracy and the per-class report."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

AGGREGATES = ("mean", "sum", "max")


def topk_correct(scores: torch.Tensor, labels: torch.Tensor, ks: Sequence[int]) -> dict[int, int]:
    """Number of rows whose label is among the top-k scores, for each k (clamped to K)."""
    kmax = min(max(ks), scores.shape[1])
    top = scores.topk(kmax, dim=1).indices  # (N, kmax)
    hits = top.eq(labels[:, None])
    return {k: int(hits[:, : min(k, kmax)].any(dim=1).sum()) for k in ks}


def aggregate_views(probs: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """``(B, V, K)`` per-view softmax -> ``(B, K)`` video scores: their mean (the Kinetics
    convention), sum (same ranking as the mean), or per-class max."""
    if how == "mean":
        return probs.mean(dim=1)
    if how == "sum":
        return probs.sum(dim=1)
    if how == "max":
        return probs.amax(dim=1)
    raise ValueError(f"eval.aggregate must be one of {', '.join(AGGREGATES)}, got {how!r}")


class MultiViewAccuracy:
    """Accumulates clip-level and video-level top-k over batches of ``(B, V, K)`` logits.

    A *clip* is one view (temporal clip x spatial crop); a video's prediction aggregates its
    views' softmax (``aggregate``). The loss is always the NLL of the mean softmax.
    ``confusion[i, j]`` counts videos of class ``i`` predicted (top-1) as ``j``.
    """

    def __init__(self, ks: Sequence[int] = (1, 5), num_classes: int | None = None,
                 aggregate: str = "mean") -> None:
        aggregate_views(torch.zeros(1, 1, 1), aggregate)  # validate the name now
        self.ks = tuple(ks)
        self.aggregate = aggregate
        self.clip = dict.fromkeys(self.ks, 0)
        self.video = dict.fromkeys(self.ks, 0)
        self.num_clips = 0
        self.num_videos = 0
        self.loss_sum = 0.0
        self.confusion = None if num_classes is None else torch.zeros(num_classes, num_classes,
                                                                      dtype=torch.float64)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        b, v, k = logits.shape  # (B, V, K)
        logits = logits.float()
        probs = logits.softmax(dim=-1)
        for kk, n in topk_correct(logits.flatten(0, 1), labels.repeat_interleave(v), self.ks).items():
            self.clip[kk] += n
        scores = aggregate_views(probs, self.aggregate)  # (B, K)
        for kk, n in topk_correct(scores, labels, self.ks).items():
            self.video[kk] += n
        if self.confusion is None:
            self.confusion = torch.zeros(k, k, dtype=torch.float64)
        flat = (labels.cpu() * k + scores.argmax(dim=1).cpu()).long()
        self.confusion += torch.bincount(flat, minlength=k * k).view(k, k).double()
        self.loss_sum += float(torch.nn.functional.nll_loss(probs.mean(1).clamp_min(1e-12).log(), labels, reduction="sum"))
        self.num_clips += b * v
        self.num_videos += b

    def state(self) -> torch.Tensor:
        """Counts as one tensor, so DDP can all-reduce them."""
        vals = [*self.clip.values(), *self.video.values(), self.num_clips, self.num_videos, self.loss_sum]
        conf = self.confusion.flatten() if self.confusion is not None else torch.zeros(0)
        return torch.cat([torch.tensor(vals, dtype=torch.float64), conf.double()])

    def load(self, t: torch.Tensor) -> None:
        n = len(self.ks)
        vals = t[: 2 * n + 3].tolist()
        self.clip = dict(zip(self.ks, vals[:n], strict=True))
        self.video = dict(zip(self.ks, vals[n : 2 * n], strict=True))
        self.num_clips, self.num_videos, self.loss_sum = vals[2 * n :]
        rest = t[2 * n + 3 :].double()
        k = math.isqrt(rest.numel())
        self.confusion = rest.view(k, k).clone() if k else None

    def per_class(self) -> list[dict[str, float | int | None]]:
        """Per class: videos, top-1 hits and accuracy (None for a class with no videos)."""
        if self.confusion is None:
            return []
        totals, hits = self.confusion.sum(dim=1), self.confusion.diagonal()
        return [{"class": i, "videos": int(totals[i]), "correct": int(hits[i]),
                 "accuracy": float(hits[i] / totals[i]) if totals[i] else None}
                for i in range(len(totals))]

    def mean_class_accuracy(self) -> float:
        """The mean over classes (with at least one video) of their video-level top-1."""
        accs = [r["accuracy"] for r in self.per_class() if r["accuracy"] is not None]
        return sum(accs) / len(accs) if accs else 0.0

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in self.ks:
            out[f"val_top{k}"] = self.video[k] / max(self.num_videos, 1)
            out[f"val_clip_top{k}"] = self.clip[k] / max(self.num_clips, 1)
        out["val_mean_class_acc"] = self.mean_class_accuracy()
        out["val_loss"] = self.loss_sum / max(self.num_videos, 1)
        out["val_videos"] = int(self.num_videos)
        return out
