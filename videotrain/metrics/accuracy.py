"""Top-k accuracy at clip level and at video level (softmax averaged over views)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def topk_correct(scores: torch.Tensor, labels: torch.Tensor, ks: Sequence[int]) -> dict[int, int]:
    """Number of rows whose label is among the top-k scores, for each k (clamped to K)."""
    kmax = min(max(ks), scores.shape[1])
    top = scores.topk(kmax, dim=1).indices  # (N, kmax)
    hits = top.eq(labels[:, None])
    return {k: int(hits[:, : min(k, kmax)].any(dim=1).sum()) for k in ks}


class MultiViewAccuracy:
    """Accumulates clip-level and video-level top-k over batches of ``(B, V, K)`` logits."""

    def __init__(self, ks: Sequence[int] = (1, 5)) -> None:
        self.ks = tuple(ks)
        self.clip = dict.fromkeys(self.ks, 0)
        self.video = dict.fromkeys(self.ks, 0)
        self.num_clips = 0
        self.num_videos = 0
        self.loss_sum = 0.0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        b, v, _ = logits.shape  # (B, V, K)
        logits = logits.float()
        probs = logits.softmax(dim=-1)
        for k, n in topk_correct(logits.flatten(0, 1), labels.repeat_interleave(v), self.ks).items():
            self.clip[k] += n
        for k, n in topk_correct(probs.mean(dim=1), labels, self.ks).items():
            self.video[k] += n
        self.loss_sum += float(torch.nn.functional.nll_loss(probs.mean(1).clamp_min(1e-12).log(), labels, reduction="sum"))
        self.num_clips += b * v
        self.num_videos += b

    def state(self) -> torch.Tensor:
        """Counts as one tensor, so DDP can all-reduce them."""
        vals = [*self.clip.values(), *self.video.values(), self.num_clips, self.num_videos, self.loss_sum]
        return torch.tensor(vals, dtype=torch.float64)

    def load(self, t: torch.Tensor) -> None:
        n = len(self.ks)
        vals = t.tolist()
        self.clip = dict(zip(self.ks, vals[:n], strict=True))
        self.video = dict(zip(self.ks, vals[n : 2 * n], strict=True))
        self.num_clips, self.num_videos, self.loss_sum = vals[2 * n :]

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in self.ks:
            out[f"val_top{k}"] = self.video[k] / max(self.num_videos, 1)
            out[f"val_clip_top{k}"] = self.clip[k] / max(self.num_clips, 1)
        out["val_loss"] = self.loss_sum / max(self.num_videos, 1)
        out["val_videos"] = int(self.num_videos)
        return out
