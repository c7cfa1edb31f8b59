"""The training recipe's batch-level parts: MixUp / CutMix with soft targets, and an EMA of the
weights. (RandAugment and random erasing act on each clip: ``videotrain.data.transforms``.)

``recipe.mixup_alpha`` / ``recipe.cutmix_alpha`` use torchvision.transforms.v2's ``MixUp`` and
``CutMix`` on the batch as a ``tv_tensors.Video``: one mixing coefficient and (CutMix) one box
per clip, the same on every frame, so the motion of both clips survives. With both on, each
batch uses one of them at random (``recipe.switch_prob``: CutMix's share); a batch is mixed at
all with probability ``recipe.mix_prob``. The targets become class probabilities, and the loss
is the cross-entropy against them (``trainer.label_smoothing`` still applies).

``recipe.ema_decay`` keeps ``torch.optim.swa_utils.AveragedModel`` of the model, updated after
every optimizer step. Its decay warms up as ``min(decay, (1 + n) / (10 + n))`` after ``n``
updates (TensorFlow's ``ExponentialMovingAverage`` with ``num_updates``), so that a short run's
average is not dominated by the random initial weights. Buffers (BatchNorm statistics) are
averaged too. The EMA is validated next to the model, checkpointed, and is what the run ships.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torchvision import tv_tensors
from torchvision.transforms import v2


@dataclass
class RecipeSettings:
    """The ``recipe`` config group (``configs/recipe/``); every part is off by default."""

    randaugment_ops: int = 0  # RandAugment: ops per clip (0 = off), the same on every frame
    randaugment_magnitude: int = 9  # of 31 (torchvision's num_magnitude_bins)
    random_erasing: float = 0.0  # probability per clip of erasing one box (the same on every frame)
    mixup_alpha: float = 0.0  # MixUp's Beta(alpha, alpha); 0 = off
    cutmix_alpha: float = 0.0  # CutMix's Beta(alpha, alpha); 0 = off
    mix_prob: float = 1.0  # the share of batches that are mixed
    switch_prob: float = 0.5  # with both on: the share of mixed batches that use CutMix
    ema_decay: float | None = None  # EMA of the weights; null = off

    def __post_init__(self) -> None:
        d = self.ema_decay
        checks = {  # key: (holds, the allowed range)
            "randaugment_ops": (self.randaugment_ops >= 0, ">= 0"),
            "randaugment_magnitude": (0 <= self.randaugment_magnitude <= 30, "in [0, 30]"),
            "random_erasing": (0.0 <= self.random_erasing <= 1.0, "in [0, 1]"),
            "mixup_alpha": (self.mixup_alpha >= 0.0, ">= 0"),
            "cutmix_alpha": (self.cutmix_alpha >= 0.0, ">= 0"),
            "mix_prob": (0.0 <= self.mix_prob <= 1.0, "in [0, 1]"),
            "switch_prob": (0.0 <= self.switch_prob <= 1.0, "in [0, 1]"),
            "ema_decay": (d is None or 0.0 < d < 1.0, "in (0, 1) or null"),
        }
        bad = [f"recipe.{k} must be {allowed}, got {getattr(self, k)!r}"
               for k, (holds, allowed) in checks.items() if not holds]
        if bad:
            raise ValueError("; ".join(bad))

    @property
    def mixes(self) -> bool:
        return self.mix_prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)


class BatchMix:
    """MixUp / CutMix on a training batch: ``(video (B, T, C, H, W), labels (B,))`` ->
    ``(mixed video, targets (B, K) class probabilities)``. Unmixed batches get one-hot targets,
    so the loss is always against probabilities."""

    def __init__(self, settings: RecipeSettings, num_classes: int) -> None:
        self.s, self.num_classes = settings, num_classes
        self.mixup = v2.MixUp(alpha=settings.mixup_alpha, num_classes=num_classes) \
            if settings.mixup_alpha > 0 else None
        self.cutmix = v2.CutMix(alpha=settings.cutmix_alpha, num_classes=num_classes) \
            if settings.cutmix_alpha > 0 else None

    def __call__(self, video: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # torch's RNG (saved in checkpoints) decides, so a resumed run mixes the same way
        if float(torch.rand(())) >= self.s.mix_prob:
            return video, F.one_hot(labels, self.num_classes).float()
        mix = self.mixup or self.cutmix
        if self.mixup is not None and self.cutmix is not None:
            mix = self.cutmix if float(torch.rand(())) < self.s.switch_prob else self.mixup
        mixed, targets = mix(tv_tensors.Video(video), labels)  # the same mix on every frame
        return mixed.as_subclass(torch.Tensor), targets


def soft_target_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of ``logits (B, K)`` against class probabilities or class indices."""
    return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)


def _ema_update(decay: float):
    """``multi_avg_fn`` for ``AveragedModel``: one lerp per group of tensors (AveragedModel groups
    them by device and dtype); integer buffers (BatchNorm's counters) are copied."""
    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor) -> None:
        if not averaged[0].is_floating_point():
            torch._foreach_copy_(averaged, current)
            return
        n = float(num_averaged)
        d = min(decay, (1.0 + n) / (10.0 + n))
        torch._foreach_lerp_(averaged, current, 1.0 - d)

    return update


class WeightEMA:
    """An exponential moving average of a model's weights and buffers (module docstring)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        # AveragedModel deep-copies the model; its memory strategy state is copied too, but the
        # average only ever runs in eval mode, where every strategy encodes all frames plainly
        self.averaged = AveragedModel(model, multi_avg_fn=_ema_update(decay), use_buffers=True)
        self.averaged.eval()
        for p in self.averaged.parameters():
            p.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        """The averaged model (a copy of the trained one's class)."""
        return self.averaged.module

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.averaged.update_parameters(model)

    @property
    def num_updates(self) -> int:
        return int(self.averaged.n_averaged)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, under the model's own key names (a loadable state dict)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load(self, weights: dict[str, torch.Tensor], num_updates: int) -> None:
        self.module.load_state_dict(weights)
        self.averaged.n_averaged.fill_(num_updates)

