"""Optimizers, explicit learning-rate scaling with the global batch, and the warmup + cosine
schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases, norm weights and embeddings (1-D params and tokens)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith((".cls", "pos.weight")) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module, name: str, lr: float, weight_decay: float = 0.0,
    momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=momentum > 0)
    raise ValueError(f"optim.name must be 'adamw' or 'sgd', got {name!r}")


LR_SCALINGS = ("none", "linear", "sqrt")


def scaled_lr(lr: float, scaling: str, base_batch_size: int | None, global_batch_size: int) -> float:
    """The learning rate for a global batch (all processes, all accumulated micro-batches).

    ``none``: ``lr`` as configured, whatever the batch. ``linear``: ``lr * global / base``
    (Goyal et al., 2017: the usual rule for SGD). ``sqrt``: ``lr * sqrt(global / base)`` (often
    preferred for Adam-type optimizers). Scaling is never implicit: adding GPUs changes the
    learning rate only when ``optim.lr_scaling`` says so, relative to ``optim.base_batch_size``,
    the global batch ``optim.lr`` was tuned for.
    """
    if scaling not in LR_SCALINGS:
        raise ValueError(f"optim.lr_scaling must be one of {', '.join(LR_SCALINGS)}; got {scaling!r}")
    if scaling == "none":
        return lr
    if not isinstance(base_batch_size, int) or base_batch_size < 1:
        raise ValueError(f"optim.base_batch_size must be a positive integer with "
                         f"optim.lr_scaling={scaling}; got {base_batch_size!r}")
    ratio = global_batch_size / base_batch_size
    return lr * (ratio if scaling == "linear" else math.sqrt(ratio))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the base LR over ``warmup_steps``, then cosine to ``min_lr_ratio``."""
    total_steps = max(total_steps, 1)
    warmup_steps = min(max(warmup_steps, 0), total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
