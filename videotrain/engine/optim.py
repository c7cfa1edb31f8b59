"""Optimizers, explicit learning-rate scaling with the global batch, and the warmup + cosine
schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


# The optim group's options, declared once: their schemas are derived from these fields
# (videotrain.config.schema) and configs/optim/<name>.yaml holds the same defaults (a test checks).
@dataclass
class AdamWSettings:
    """``optim=adamw``: ``build_optimizer``'s arguments plus the LR scaling (``scaled_lr``)."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: tuple[float, ...] = (0.9, 0.999)
    lr_scaling: str = "none"  # none | linear | sqrt (LR_SCALINGS)
    base_batch_size: int | None = 8  # the global batch lr was tuned for
    layer_decay: float | None = None  # layer-wise LR decay; None: off
    head_lr: float | None = None  # None: lr


@dataclass
class SGDSettings:
    """``optim=sgd``: as ``AdamWSettings``, with momentum (Nesterov when > 0) for betas."""

    name: str = "sgd"
    lr: float = 0.05
    weight_decay: float = 1e-4
    momentum: float = 0.9
    lr_scaling: str = "none"
    base_batch_size: int | None = 8
    layer_decay: float | None = None
    head_lr: float | None = None


def _no_decay(name: str, p: nn.Parameter) -> bool:
    """Biases, norm weights and embeddings (1-D params and tokens) get no weight decay."""
    return p.ndim <= 1 or name.endswith((".cls", "pos.weight", "cls_token", "pos_embed",
                                         "class_token", "pos_embedding"))


def backbone_layers(backbone: nn.Module) -> tuple[dict[str, int], int]:
    """Layer ids for layer-wise LR decay: ``({parameter name: id}, number of layers)``.

    Built from the backbone contract's ``blocks()`` (execution order): blocks that share a
    parent module are one layer (a CNN's stages: ``layer1`` ... ``layer4``, ``stages.0`` ...),
    and where all blocks share one parent each block is its own layer (a transformer's
    encoder blocks). Parameters before the first block (stem, patch and position embeddings)
    are layer 0; those between blocks (a ConvNeXt stage's downsampling) join the next block's
    layer; those after the last (the final norm) belong with the head (layer n + 1).
    """
    names = {id(m): n for n, m in backbone.named_modules()}
    blocks = [names[id(b)] for b in backbone.blocks()]
    parents = [n.rsplit(".", 1)[0] if "." in n else "" for n in blocks]
    per_block = len(set(parents)) == 1
    ids: dict[str, int] = {}
    layer = 0
    for i, name in enumerate(blocks):
        if i == 0 or per_block or parents[i] != parents[i - 1]:
            layer += 1
        ids[name] = layer
    out: dict[str, int] = {}
    pending: list[str] = []  # outside every block: they join the next block's layer
    seen_block = False
    for pname, _ in backbone.named_parameters():
        owner = next((b for b in blocks if pname.startswith(b + ".")), None)
        if owner is None:
            pending.append(pname)
            continue
        out.update({p: ids[owner] if seen_block else 0 for p in pending})
        out[pname], seen_block, pending = ids[owner], True, []
    out.update({p: layer + 1 for p in pending})
    return out, layer


def param_groups(model: nn.Module, weight_decay: float, lr: float, layer_decay: float | None = None,
                 head_lr: float | None = None) -> list[dict]:
    """Parameter groups with their own ``lr``: weight decay off for 1-D params and tokens;
    with ``layer_decay`` (``optim.layer_decay``) the backbone's layer ``i`` of ``n`` trains at
    ``lr * layer_decay ** (n + 1 - i)`` (BEiT/VideoMAE's layer-wise decay); the head trains at
    ``head_lr`` (``optim.head_lr``; None: ``lr``). A model without ``backbone``/``head``
    attributes gets the two plain groups."""
    if layer_decay is not None and not 0.0 < layer_decay <= 1.0:
        raise ValueError(f"optim.layer_decay must be in (0, 1] or null, got {layer_decay}")
    backbone, head = getattr(model, "backbone", None), getattr(model, "head", None)
    layers, n = ({}, 0)
    if layer_decay is not None and backbone is not None and hasattr(backbone, "blocks"):
        layers, n = backbone_layers(backbone)
    groups: dict[tuple[str, float, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        part_lr = lr
        if head is not None and name.startswith("head."):
            part_lr = lr if head_lr is None else head_lr
            where = "head"
        elif name.startswith("backbone.") and name[len("backbone."):] in layers:
            layer = layers[name[len("backbone."):]]
            part_lr = lr * layer_decay ** (n + 1 - layer)
            where = f"backbone.layer{layer}"
        else:
            where = "backbone" if name.startswith("backbone.") else "other"
        groups.setdefault((where, part_lr, _no_decay(name, p)), []).append(p)
    return [{"params": ps, "lr": g_lr, "weight_decay": 0.0 if nd else weight_decay,
             "name": f"{where}{'/no_decay' if nd else ''}"}
            for (where, g_lr, nd), ps in groups.items()]


def build_optimizer(
    model: nn.Module, name: str, lr: float, weight_decay: float = 0.0,
    momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.999),
    layer_decay: float | None = None, head_lr: float | None = None,
) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay, lr, layer_decay, head_lr)
    if not groups:
        raise ValueError("no parameter requires a gradient: nothing to train")
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
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 50, min_lr_ratio: float = 0.01
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the base LR over ``warmup_steps``, then cosine to ``min_lr_ratio``. Its
    defaults are ``sched=cosine``'s (the group's schema is derived from this signature)."""
    total_steps = max(total_steps, 1)
    warmup_steps = min(max(warmup_steps, 0), total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
