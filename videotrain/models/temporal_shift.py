"""TSM's residual temporal shift (Lin et al., ICCV 2019) inside a per-frame ResNet's blocks.

In each residual block the branch's input has ``fold = int(C * fraction)`` channels from the
next frame and ``fold`` from the previous one (zero at the clip ends); the identity path is
unshifted. The backbone sees ``(N = B*T, C, H, W)``, so every strategy sets ``T`` before each
call (``set_clip_length``) and it stays on the modules, so a recompute in backward shifts
alike; fx traces keep the shift a leaf (:class:`FrameTracer`). Blocks are re-expressed through
residual-branch adapters (:func:`block_adapter`); SBP's lockstep code meets its kept and
dropped frames at each shift (:meth:`TemporalShift.lockstep_parts`). Why:
docs/design/internals.md#the-temporal-shift."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import fx, nn

# branch(fn, x) -> fn(x) with whatever the caller does around it (here: shift x first)
Branch = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]
Adapter = Callable[[nn.Module, torch.Tensor, Branch], torch.Tensor]

_RESNET_ATTRS = ("conv1", "bn1", "conv2", "bn2", "relu", "downsample")


def resnet_block_forward(block: nn.Module, x: torch.Tensor, branch: Branch) -> torch.Tensor:
    """torchvision ``BasicBlock``/``Bottleneck``'s forward with its residual branch through
    ``branch``. ``x (N, C, H, W)``."""

    def residual(z: torch.Tensor) -> torch.Tensor:  # conv1 .. bn2 (BasicBlock) / bn3
        out = block.relu(block.bn1(block.conv1(z)))
        out = block.bn2(block.conv2(out))
        if hasattr(block, "conv3"):  # Bottleneck
            out = block.bn3(block.conv3(block.relu(out)))
        return out

    identity = x if block.downsample is None else block.downsample(x)
    return block.relu(branch(residual, x) + identity)  # (N, C', H', W')


def timm_resnet_block_forward(block: nn.Module, x: torch.Tensor, branch: Branch) -> torch.Tensor:
    """timm ``BasicBlock``/``Bottleneck``'s forward with its residual branch through ``branch``.
    ``x (N, C, H, W)``."""
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

    shortcut = x if block.downsample is None else block.downsample(x)
    act = block.act3 if bottleneck else block.act2
    return act(branch(residual, x) + shortcut)


# (module, qualified name) of a block class's ``forward`` -> the adapter that re-expresses it:
# matched by the forward, not by attribute names alone, so that a look-alike whose forward
# differs is refused; every timm subclass that keeps that forward matches
_FORWARD_ADAPTERS: dict[tuple[str, str], Adapter] = {
    ("timm.models.resnet", "BasicBlock.forward"): timm_resnet_block_forward,
    ("timm.models.resnet", "Bottleneck.forward"): timm_resnet_block_forward,
}


def block_adapter(block: nn.Module) -> Adapter:
    """The adapter that knows where ``block``'s residual branch is: timm's ResNet blocks by
    their ``forward``, torchvision's (and look-alikes) by attribute names; a ``TypeError`` for
    any other block."""
    forward = getattr(type(block), "forward", None)
    key = (getattr(forward, "__module__", ""), getattr(forward, "__qualname__", ""))
    if key in _FORWARD_ADAPTERS:
        return _FORWARD_ADAPTERS[key]
    if all(hasattr(block, a) for a in _RESNET_ATTRS):
        return resnet_block_forward
    raise TypeError(f"no residual-branch adapter for {type(block).__name__}: ResNet blocks only "
                    f"(torchvision's with {', '.join(_RESNET_ATTRS)}; timm's BasicBlock and "
                    "Bottleneck)")


class Parts(Protocol):
    """The rows of one frame-SBP step as the lockstep code hands them to a module that meets
    both parts (``videotrain.memory.sbp.lockstep.PartRows``)."""

    n_keep: int

    def neighbours(self, num_frames: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def temporal_shift(x: torch.Tensor, num_frames: int, fraction: float) -> torch.Tensor:
    """Shift ``fraction`` of the channels of ``x (N = B*T, C, ...)`` one frame backward in time
    (frame ``t`` gets frame ``t+1``'s channels ``[0, fold)``) and as many one frame forward
    (frame ``t`` gets frame ``t-1``'s channels ``[fold, 2*fold)``), zeros at the clip ends."""
    n, c = x.shape[:2]
    fold = int(c * fraction)
    if fold == 0:
        return x
    if num_frames < 1 or n % num_frames:
        raise ValueError(f"temporal shift: {n} frames are not whole clips of {num_frames} frames "
                         "(the backbone must see every frame of each clip, in time order)")
    clip = x.unflatten(0, (-1, num_frames))  # (B, T, C, ...)
    out = torch.zeros_like(clip)
    out[:, :-1, :fold] = clip[:, 1:, :fold]  # from the next frame
    out[:, 1:, fold:2 * fold] = clip[:, :-1, fold:2 * fold]  # from the previous frame
    out[:, :, 2 * fold:] = clip[:, :, 2 * fold:]
    return out.flatten(0, 1)  # (N, C, ...)


def shift_parts(kept: torch.Tensor, dropped: torch.Tensor, rows: Parts, num_frames: int,
                fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`temporal_shift` of the frames ``[kept | dropped]`` (part rows, ``rows``), as the
    two parts: the shifted channels of every frame gathered from a ``(N + 1)``-row source (both
    parts' first ``2 * fold`` channels and a zero row for the clip ends). The dropped part is
    computed without autograd."""
    c = kept.shape[1]
    fold = int(c * fraction)
    if fold == 0:
        return kept, dropped
    nxt, prv = rows.neighbours(num_frames)  # (N,), (N,): part rows, N = the zero row
    zero = torch.zeros_like(kept[:1, : 2 * fold])  # (1, 2*fold, ...), kept's memory format
    src = torch.cat((kept[:, : 2 * fold], dropped[:, : 2 * fold].to(kept.dtype), zero))  # (N + 1, 2*fold, ...)
    n = rows.n_keep

    def part(x: torch.Tensor, at: slice) -> torch.Tensor:
        return torch.cat((src[:, :fold][nxt[at]], src[:, fold: 2 * fold][prv[at]], x[:, 2 * fold:]), dim=1)

    out_kept = part(kept, slice(0, n))  # (n, C, ...)
    with torch.no_grad():
        out_dropped = part(dropped, slice(n, None))  # (N - n, C, ...)
    return out_kept, out_dropped


class TemporalShift(nn.Module):
    """The shift of one residual block; ``num_frames`` is the clip length of the current call."""

    def __init__(self, fraction: float) -> None:
        super().__init__()
        self.fraction = float(fraction)
        self.num_frames: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, C, H, W)
        if self.num_frames is None:
            raise RuntimeError("temporal shift: the clip length is not set; call "
                               "backbone.set_clip_length(T) before calling the backbone on frames "
                               "(the memory strategies and encode_all_frames do)")
        return temporal_shift(x, self.num_frames, self.fraction)

    def lockstep_parts(self, kept: torch.Tensor, dropped: torch.Tensor,
                       rows: Parts) -> tuple[torch.Tensor, torch.Tensor]:
        """The shift in SBP's lockstep code (``videotrain.memory.sbp.lockstep``):
        ``kept (n, C, ...)`` with autograd and ``dropped (N - n, C, ...)`` without, the row blocks
        of ``rows``. Each frame reads its neighbours' channels from either part; a dropped
        neighbour is a constant, so a kept frame's gradient reaches its kept neighbours only."""
        if self.num_frames is None:
            raise RuntimeError("temporal shift: the clip length is not set")
        return shift_parts(kept, dropped, rows, self.num_frames, self.fraction)

    def extra_repr(self) -> str:
        return f"fraction={self.fraction}, num_frames={self.num_frames}"


class ShiftedForward:
    """Replaces ``forward`` on one block instance: ``skip(x) + branch(shift(x))``. A plain object,
    so parameters and ``state_dict`` keys do not change and the model still pickles."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.adapter = block_adapter(block)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shift = self.block.temporal_shift
        return self.adapter(self.block, x, lambda fn, z: fn(shift(z)))


def check_fraction(fraction: float) -> float:
    if isinstance(fraction, bool) or not 0.0 <= float(fraction) <= 0.5:
        raise ValueError(f"model.backbone.temporal_shift must be a fraction in [0, 0.5] of the "
                         f"channels shifted each way (TSM: 0.125; 0 = off), got {fraction!r}")
    return float(fraction)


def add_temporal_shift(blocks: list[nn.Module], fraction: float, model: str) -> None:
    """Give every block in ``blocks`` (ResNet blocks, torchvision or timm) a residual shift of
    ``fraction``; anything else raises a ``ValueError`` naming ``model``."""
    for blk in blocks:
        try:
            block_adapter(blk)
        except TypeError:
            raise ValueError(f"model.backbone.temporal_shift: {model} has {type(blk).__name__} "
                             "blocks; the temporal shift is implemented for ResNet blocks only "
                             "(resnet10/18/50, timm ResNets); set model.backbone.temporal_shift=0"
                             ) from None
    for blk in blocks:
        blk.temporal_shift = TemporalShift(fraction)
        blk.forward = ShiftedForward(blk)


def set_num_frames(module: nn.Module, num_frames: int) -> None:
    """Set the clip length on every temporal shift in ``module``."""
    for m in module.modules():
        if isinstance(m, TemporalShift):
            m.num_frames = int(num_frames)


class FrameTracer(fx.Tracer):
    """The backbones' ``torch.fx`` tracer: a temporal shift stays one ``call_module`` node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, TemporalShift) or super().is_leaf_module(m, module_qualified_name)
