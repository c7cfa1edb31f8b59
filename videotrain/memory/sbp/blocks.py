"""Block granularity of SBP (the paper's "graph model"): split residual *branches* by frame.

Inside every selected residual block, the branch runs with autograd for a per-block random
subset of frames and under ``no_grad`` for the rest, while the skip path carries gradient for
every frame. Only the kept frames' branch activations are stored.

Blocks come from the backbone contract (``backbone.blocks()``); what a strategy must know is
where the residual branch is. That knowledge lives in small *adapters* that re-express a
block's forward as ``skip + branch(fn, x)``, where ``branch`` is the SBP split. They match
blocks by attribute names (duck typing), not by torchvision class:

* ResNet blocks (torchvision ``BasicBlock``/``Bottleneck``: ``conv1, bn1, conv2, bn2[, conv3,
  bn3], relu, downsample``): ``relu(branch(x) + (downsample(x) or x))``.
* Transformer encoder blocks (torchvision ``EncoderBlock``: ``ln_1, self_attention, dropout,
  ln_2, mlp``): ``x = x + dropout(attn(ln_1(x)))``; ``x + mlp(ln_2(x))``, two split branches
  sharing the block's frame subset.
* timm blocks, matched by the ``forward`` they re-express (class attribute names alone would
  also match look-alikes such as timm's post-norm ``ResPostBlock``, whose forward differs):
  ResNet ``BasicBlock``/``Bottleneck`` (``act(branch(x) + (downsample(x) or x))``), ConvNeXt's
  ``ConvNeXtBlock`` (``branch(x) + shortcut(x)``) and the ViT ``Block``
  (``x + branch(attention)``, then ``+ branch(mlp)``), and every timm subclass that keeps
  that forward.
* Any block defining ``sbp_forward(x, branch)`` (the extension point for new backbones).

A block with TSM's temporal shift (``block.temporal_shift``, set by
``videotrain.models.temporal_shift``) has its branch input shifted over all frames first:
``skip(x) + branch(residual, shift(x))``, so the split branch itself stays per-frame.

Wrapping patches ``forward`` on the block *instance*: parameters and ``state_dict`` keys do
not change, and outside an SBP step (eval, ``no_grad``, or not inside ``encode``) the block
runs its original forward unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from videotrain.memory.sbp.lockstep import PartRows, lockstep_forward, lockstep_graph
from videotrain.memory.sbp.split import FullBatchNorm, has_train_batchnorm, split_forward

# branch(fn, x) -> fn(x) for all N frames, with autograd only through the kept frames
Branch = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]
Adapter = Callable[[nn.Module, torch.Tensor, Branch], torch.Tensor]

_RESNET_ATTRS = ("conv1", "bn1", "conv2", "bn2", "relu", "downsample")
_VIT_ATTRS = ("ln_1", "self_attention", "dropout", "ln_2", "mlp")


def resnet_block_forward(block: nn.Module, x: torch.Tensor, branch: Branch) -> torch.Tensor:
    """torchvision BasicBlock/Bottleneck with a split branch. ``x (N, C, H, W)``."""

    def residual(z: torch.Tensor) -> torch.Tensor:  # conv1 .. bn2 (BasicBlock) / bn3
        out = block.relu(block.bn1(block.conv1(z)))
        out = block.bn2(block.conv2(out))
        if hasattr(block, "conv3"):  # Bottleneck
            out = block.bn3(block.conv3(block.relu(out)))
        return out

    identity = x if block.downsample is None else block.downsample(x)  # every frame, with grad
    return block.relu(branch(residual, x) + identity)  # (N, C', H', W')


def vit_block_forward(block: nn.Module, x: torch.Tensor, branch: Branch) -> torch.Tensor:
    """torchvision EncoderBlock with both residual branches split. ``x (N, S, D)``."""

    def attention(z: torch.Tensor) -> torch.Tensor:
        h = block.ln_1(z)
        h, _ = block.self_attention(h, h, h, need_weights=False)
        return block.dropout(h)

    def mlp(z: torch.Tensor) -> torch.Tensor:
        return block.mlp(block.ln_2(z))

    x = branch(attention, x) + x  # same operand order as EncoderBlock: dropout(attn) + input
    return x + branch(mlp, x)


def timm_resnet_block_forward(block: nn.Module, x: torch.Tensor, branch: Branch) -> torch.Tensor:
    """timm ``BasicBlock``/``Bottleneck`` with a split branch. ``x (N, C, H, W)``."""
    bottleneck = hasattr(block, "conv3")

    def residual(z: torch.Tensor) -> torch.Tensor:  # conv1 .. bn2 (BasicBlock) / bn3, se, drop_path
        if bottleneck:
            out = block.act1(block.bn1(block.conv1(z)))
            out = block.aa(block.act2(block.drop_block(block.bn2(block.conv2(out)))))
            out = block.bn3(block.conv3(out))
        else:
            out = block.aa(block.act1(block.drop_block(block.bn1(block.conv1(z)))))
            out = block.bn2(block.conv2(out))
        if block.se is not None:
            out = block.se(out)
        if block.drop_path is not None:
            out = block.drop_path(out)
        return out

    shortcut = x if block.downsample is None else block.downsample(x)  # every frame, with grad
    act = block.act3 if bottleneck else block.act2
    return act(branch(residual, x) + shortcut)


def convnext_block_forward(block: nn.Module, x: torch.Tensor, branch: Branch) -> torch.Tensor:
    """timm ``ConvNeXtBlock`` with a split branch. ``x (N, C, H, W)``."""

    def residual(z: torch.Tensor) -> torch.Tensor:
        y = block.conv_dw(z)
        if block.use_conv_mlp:
            y = block.mlp(block.norm(y))
        else:  # channels-last LayerNorm and MLP
            y = block.mlp(block.norm(y.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        if block.gamma is not None:
            y = y.mul(block.gamma.reshape(1, -1, 1, 1))
        return block.drop_path(y)

    return branch(residual, x) + block.shortcut(x)


def timm_vit_block_forward(block: nn.Module, x: torch.Tensor, branch: Branch) -> torch.Tensor:
    """timm ViT ``Block`` (pre-norm, layer scale, drop path) with both residual branches split.
    ``x (N, S, D)``."""

    def attention(z: torch.Tensor) -> torch.Tensor:
        return block.drop_path1(block.ls1(block.attn(block.norm1(z))))

    def mlp(z: torch.Tensor) -> torch.Tensor:
        return block.drop_path2(block.ls2(block.mlp(block.norm2(z))))

    x = x + branch(attention, x)
    return x + branch(mlp, x)


# (module, qualified name) of a block class's ``forward`` -> the adapter that re-expresses it
_FORWARD_ADAPTERS: dict[tuple[str, str], Adapter] = {
    ("timm.models.resnet", "BasicBlock.forward"): timm_resnet_block_forward,
    ("timm.models.resnet", "Bottleneck.forward"): timm_resnet_block_forward,
    ("timm.models.convnext", "ConvNeXtBlock.forward"): convnext_block_forward,
    ("timm.models.vision_transformer", "Block.forward"): timm_vit_block_forward,
}


def _custom_block_forward(block: nn.Module, x: torch.Tensor, branch: Branch) -> torch.Tensor:
    return block.sbp_forward(x, branch)


def block_adapter(block: nn.Module) -> Adapter:
    """The adapter that knows where ``block``'s residual branches are."""
    if callable(getattr(block, "sbp_forward", None)):
        return _custom_block_forward
    forward = getattr(type(block), "forward", None)
    key = (getattr(forward, "__module__", ""), getattr(forward, "__qualname__", ""))
    if key in _FORWARD_ADAPTERS:
        return _FORWARD_ADAPTERS[key]
    if all(hasattr(block, a) for a in _RESNET_ATTRS):
        return resnet_block_forward
    if all(hasattr(block, a) for a in _VIT_ATTRS):
        return vit_block_forward
    raise TypeError(
        f"memory.granularity=block: do not know the residual branch of {type(block).__name__}. "
        f"Supported: ResNet blocks ({', '.join(_RESNET_ATTRS)}), transformer encoder blocks "
        f"({', '.join(_VIT_ATTRS)}), timm's ResNet, ConvNeXt and ViT blocks "
        f"({', '.join(sorted({q.split('.')[0] for _, q in _FORWARD_ADAPTERS}))}), or a block "
        f"defining sbp_forward(x, branch)."
    )


def branch_norms(block: nn.Module) -> list[nn.Module]:
    """BN layers on the residual branch (everything in the block except its downsample)."""
    skip = getattr(block, "downsample", None)
    skip_ids = {id(m) for m in skip.modules()} if isinstance(skip, nn.Module) else set()
    return [m for m in block.modules() if isinstance(m, _BatchNorm) and id(m) not in skip_ids]


def select_blocks(num_blocks: int, blocks: float | int | list[int] | None) -> list[int]:
    """Indices into ``backbone.blocks()``: ``None`` = first 2/3 (the paper's best practice),
    a number in (0, 1] = that leading fraction, a list = those indices (negatives allowed)."""
    if num_blocks < 1:
        raise ValueError("memory.granularity=block: backbone.blocks() is empty")
    if blocks is None or isinstance(blocks, int | float):
        frac = 2 / 3 if blocks is None else float(blocks)
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"memory.blocks as a fraction must be in (0, 1], got {blocks}")
        return list(range(max(1, round(frac * num_blocks))))
    picked = sorted({int(i) % num_blocks for i in blocks if -num_blocks <= int(i) < num_blocks})
    if len(picked) != len(list(blocks)) or not picked:
        raise ValueError(
            f"memory.blocks={list(blocks)}: indices must be distinct and within "
            f"[-{num_blocks}, {num_blocks}) for a backbone with {num_blocks} blocks"
        )
    return picked


class _Branch(nn.Module):
    """One residual branch ``fn`` of ``block`` as a module, so that ``torch.fx`` can trace it
    (the branch's layers become ``block.*`` submodule calls)."""

    def __init__(self, block: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
                 tracer: Callable[[], object] | None) -> None:
        super().__init__()
        self.block, self._fn, self._tracer = block, fn, tracer

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self._fn(z)

    def fx_tracer(self) -> object:  # the backbone's tracer (timm's leaf modules and functions)
        from torch import fx

        return self._tracer() if self._tracer is not None else fx.Tracer()


class BlockSplitter:
    """Wraps residual blocks and, during one SBP step, tells each its kept/dropped rows.

    A branch with training-mode BN runs the lockstep code (``videotrain.memory.sbp.lockstep``):
    each branch traced once (per block and branch function) into kept/dropped twins that meet at
    its BN layers, as at frame granularity; record/apply where it cannot be traced."""

    def __init__(self, norm: FullBatchNorm, chunk: int | None) -> None:
        self.norm = norm
        self.chunk = chunk
        self.rows: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.total_rows = 0  # N = B*T of the current step
        self.scale: float | None = None
        self.lockstep = True  # full-batch branches in lockstep (memory.lockstep)
        self.tracer: Callable[[], object] | None = None  # the backbone's fx tracer, if it has one
        self._twins: dict[tuple[int, object], object] = {}  # (block, branch code) -> twin or None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_twins": {}}  # generated code is rebuilt, not pickled

    def _twin(self, block: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
        key = (id(block), getattr(fn, "__code__", fn))
        if key not in self._twins:
            self._twins[key] = lockstep_graph(_Branch(block, fn, self.tracer))
        return self._twins[key]

    def wrap(self, blocks: list[nn.Module]) -> None:
        for blk in blocks:
            if not isinstance(blk.__dict__.get("forward"), PatchedBlock):
                blk.forward = PatchedBlock(self, blk)

    @contextmanager
    def step(
        self,
        total_rows: int,
        rows: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]],
        scale: float | None,
    ) -> Iterator[None]:
        """Activate SBP in the wrapped blocks: ``rows[block] = (kept rows, dropped rows)``."""
        self.rows, self.total_rows, self.scale = rows, total_rows, scale
        try:
            yield
        finally:
            self.rows, self.scale = None, None

    def forward(self, patch: PatchedBlock, *args: object, **kwargs: object) -> torch.Tensor:
        block = patch.block
        rows = None if self.rows is None else self.rows.get(block)
        if rows is None or not torch.is_grad_enabled() or len(args) != 1 or kwargs:
            return patch.original(*args, **kwargs)  # outside an SBP step: the original block
        x = args[0]
        if x.shape[0] != self.total_rows:
            raise RuntimeError(
                f"block-level SBP expects the backbone to keep frames on the leading dim "
                f"(N = B*T = {self.total_rows}); {type(block).__name__} got {tuple(x.shape)}"
            )
        keep, drop = rows
        needs_stats = has_train_batchnorm(patch.norms)
        shift = getattr(block, "temporal_shift", None)  # TSM (videotrain.models.temporal_shift)

        def branch(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor) -> torch.Tensor:
            if shift is not None:  # every frame, with autograd, before the per-frame split
                z = shift(z)  # (N, C, H, W)
            twin = self._twin(block, fn) if needs_stats and self.lockstep else None
            if twin is not None:  # one pass: kept and dropped twins meet at the branch's BNs
                return lockstep_forward(twin, z, PartRows(keep, drop), self.scale)
            return split_forward(fn, z, keep, drop, self.norm, needs_stats, self.chunk, self.scale)

        return patch.adapter(block, x, branch)


class PatchedBlock:
    """Replaces ``forward`` on one block instance; a plain object so the model still pickles."""

    def __init__(self, owner: BlockSplitter, block: nn.Module) -> None:
        self.owner, self.block = owner, block
        self.adapter = block_adapter(block)
        self.norms = branch_norms(block)
        self.orig = block.__dict__.get("forward")  # None: the class's forward

    def original(self, *args: object, **kwargs: object) -> torch.Tensor:
        if self.orig is not None:
            return self.orig(*args, **kwargs)
        return type(self.block).forward(self.block, *args, **kwargs)

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.owner.forward(self, *args, **kwargs)
