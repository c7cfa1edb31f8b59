"""``memory=sbp``: Stochastic Backpropagation (Cheng et al., CVPR 2022; Fang et al., NeurIPS 2022).

The forward pass covers every frame; the backward pass runs through the backbone for a random
subset of ``n_keep = clamp(round(r*T), 1, T)`` frames per clip, and the activations of the
other frames are never stored. Training memory for the backbone therefore scales with ``r``.

Granularity
-----------
``auto`` (default): ``frame``, resolved by ``prepare``; ``block`` only on a backbone that mixes
frames (TSM's temporal shift) and that ``torch.fx`` cannot trace (or with ``lockstep=false``).

``frame`` (tree model): kept frames run through the backbone with autograd, dropped frames
under ``no_grad`` (one pass; in chunks of ``nograd_chunk`` frames when set and nothing couples
the frames), and both are put back into one ``(B, T, D)`` tensor; positions are all frames. No
recompute in backward. Specification: the head's gradients equal e2e's; the backbone's
gradients equal e2e's with the dropped frames' activations held constant at every layer (the
gradient paths through dropped frames cut: for BN-free per-frame backbones, e2e with the dropped
frames' *features* detached); the input gradient is exactly zero on dropped frames.

With TSM's temporal shift (``model.backbone.temporal_shift``) the frames meet inside the
backbone. Frame granularity runs the lockstep code (``videotrain.memory.sbp.lockstep``): at each
shift, a frame reads its neighbours' channels from both parts, the dropped neighbours as
constants. The gradient is then e2e's with the dropped frames' activations detached at every
shift input, every BN input and the backbone's output: a kept frame's gradient reaches its kept
neighbours through the shift, never a dropped one. That is not e2e's gradient on the kept frames
(e2e would also carry gradient through the dropped frames' activations, which SBP never
stores); the accuracy suite has not been rerun with it (issue 45).

``block`` (graph model): inside each selected residual block (default: the first 2/3 of
``backbone.blocks()``), the residual *branch* runs with autograd for a per-block random subset
of frames and under ``no_grad`` for the rest, while the skip path carries gradient for every
frame. With TSM's temporal shift (``model.backbone.temporal_shift``) the shift
runs on the block input of *all* frames with autograd (it stores nothing) before the branch is
split, so the branch stays per-frame and the kept frames' gradient reaches their neighbours.
See ``videotrain.memory.sbp.blocks`` for how branches are found. Savings are smaller
than at frame granularity: the skip path's tensors (a ResNet block's final ReLU output) stay
for every frame, and each split branch saves its own copy of the kept input rows where e2e
shares the block input with the previous layer (docs/benchmarks.md has the measured ratios).

BatchNorm policy (``bn_policy``)
--------------------------------
Two separate forwards (kept, dropped) would give two different batch statistics and update
running statistics twice. The policies:

``full_batch`` (default): forward output equals e2e's and running statistics update exactly
once per step. Every BN normalizes all frames with the batch statistics of all frames, computed
by the layer's own training forward (e2e's forward, so the running statistics update once), and
its backward is e2e's BN backward with the dropped frames held constant: gradients flow through
the kept frames' share of the batch mean and variance, not through the dropped frames' share
(their activations do not exist). So with BN the gradient differs from "e2e with the dropped
*features* detached", which would also differentiate the dropped frames' activations through
the statistics. Not supported with SyncBatchNorm. Two ways to compute it, the same values:

- ``lockstep=true`` (default, frame granularity): one forward. The backbone is traced with
  ``torch.fx`` once and rewritten into code with kept (autograd) and dropped (``no_grad``)
  twins of every op, the two parts as contiguous row blocks; at every BN they meet in one
  training-mode BN kernel over all rows (``videotrain.memory.sbp.lockstep``).
- block granularity: the same lockstep code per residual branch (``blocks.BlockSplitter``).
- record/apply (``lockstep=false``; composed with ``recompute``; a
  backbone ``torch.fx`` cannot trace): the split unit (the backbone, or one residual branch)
  first runs under ``no_grad`` over *all* frames, recording each BN's statistics, and the
  dropped frames' outputs come from that pass; the kept frames then rerun with autograd,
  normalized with the recorded statistics (equal to e2e's up to float rounding). Cost: an
  extra forward of the kept frames (F(1+r) instead of F), which lockstep avoids.

Neither can chunk the dropped frames (exact statistics need every frame at every layer), so
the transient is that of a plain no_grad forward over all B*T frames.

``frozen``: BN layers run in eval mode inside ``encode`` (running statistics normalize and are
never updated), the official code's choice for pretrained backbones. Every frame is then
independent: the plain scheme, dropped frames under ``no_grad`` in one pass (``nograd_chunk``
frames at a time when set), kept frames in one pass, nothing recomputed. Note that the
forward equals e2e's only against an e2e run with frozen BN too.

LayerNorm models (ViT) need no policy. At ``keep_ratio=1`` ``encode`` is plain e2e
(``encode_all_frames``), so it reproduces e2e exactly (under ``frozen``: e2e with frozen BN).

Composition with recomputation (``recompute=blocks|sqrt|optimal``, frame granularity; the
deprecated spelling ``checkpoint=`` still works, ``videotrain.memory.renamed``): the kept frames'
backbone pass is recomputed in backward with ``memory=recompute``'s policy (for ``optimal``,
``recompute_budget_frac`` of that path's estimated e2e peak; null: the smallest feasible). Gradients, logits and BN statistics equal plain SBP's: the recompute in backward
re-enters the BN policy's forward state (``recompute.replay_on_recompute``).

Everything is a no-op in eval mode and under ``no_grad``; bf16 and fp16 autocast work, with
autocast's weight-cast cache on as in e2e: since PyTorch's fix (pytorch #112583, PR #165068; every
torch this project supports) a cast cached under ``no_grad`` keeps its autograd history, so the
dropped frames' casts serve the kept frames too. With the cache off, each use cast afresh, and a
cast made under ``no_grad`` does not require grad, so ``matmul`` did not fold a transposed 3-D
input (``nn.MultiheadAttention``'s in-projection) into one ``mm``: it ran ``bmm`` over a
stride-0 expanded weight, which the CPU copies out (a ViT-B/16 step 6x e2e's in bf16).
Recompute replays the autocast state.

Gradient scale (``grad_scale``)
-------------------------------
``inverse_keep`` multiplies the kept frames' (block: kept branches') gradient by ``T/n_keep``
without changing the forward value; ``none`` leaves it (the paper's code). ``auto`` (default),
resolved by ``prepare``: ``inverse_keep`` at block granularity, ``none`` at frame granularity.
At frame granularity every backbone gradient is a sum over the kept frames, about ``r`` times
e2e's in expectation: the scale changes the step's size, not its direction, and the paper's
recipes (SGD) were tuned without it. At block granularity the gradient that reaches earlier
layers is the skip path's (every frame) plus the kept branches': unscaled, the branches count
``r`` times less than in e2e, a bias in direction that compounds over the split blocks; scaled,
the sum is e2e's in expectation. On the accuracy suite (default model, keep 0.5, 36 runs) the
mean loss is about the same (-5.4 against -6.6 points), more runs match e2e (24 of 36 within
2 points, unscaled 19), and a few seeds learn slowly (docs/benchmarks.md).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from videotrain.memory.base import (
    FrameFeatures,
    all_positions,
    encode_all_frames,
    mixes_frames,
    set_clip_length,
)
from videotrain.memory.recompute.execute import replay_on_recompute
from videotrain.memory.recompute.strategy import Recompute
from videotrain.memory.renamed import renamed_argument
from videotrain.memory.sampling import SAMPLERS, FrameSampler, SamplerStateMixin, flat_rows, n_keep
from videotrain.memory.sbp.blocks import BlockSplitter, PatchedBlock, select_blocks
from videotrain.memory.sbp.lockstep import PartRows, lockstep_forward, lockstep_graph
from videotrain.memory.sbp.split import (
    BN_POLICIES,
    FullBatchNorm,
    frozen_batchnorm,
    has_train_batchnorm,
    is_patched_bn,
    split_forward,
)

GRANULARITIES = ("auto", "frame", "block")
GRAD_SCALES = ("auto", "none", "inverse_keep")


def check_nograd_chunk(value: Any) -> None:
    """``memory.nograd_chunk``: ``auto`` or an integer >= 1 (SBP's, and ``memory=auto``'s)."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"memory.nograd_chunk must be auto or an integer >= 1, got {value!r}")


class StochasticBackprop(SamplerStateMixin):
    """SBP memory strategy. See the module docstring for the options and the BN policy."""

    name = "sbp"

    def __init__(
        self,
        keep_ratio: float = 0.5,
        sampler: str = "uniform",
        granularity: str = "auto",
        nograd_chunk: int | str = "auto",
        grad_scale: str = "auto",
        blocks: float | list[int] | None = None,
        bn_policy: str = "full_batch",
        seed: int = 0,
        rank: int | None = None,
        recompute: str | None = None,
        recompute_budget_frac: float | None = None,
        lockstep: bool = True,
        checkpoint: str | None = None,
        checkpoint_budget_frac: float | None = None,
    ) -> None:
        # deprecated spellings (videotrain.memory.renamed): checkpoint -> recompute
        recompute = renamed_argument("checkpoint", checkpoint, "recompute", recompute, None)
        recompute_budget_frac = renamed_argument("checkpoint_budget_frac", checkpoint_budget_frac,
                                                 "recompute_budget_frac", recompute_budget_frac, None)
        n_keep(keep_ratio, 1)  # validates the ratio
        for key, value, allowed in (
            ("sampler", sampler, SAMPLERS),
            ("granularity", granularity, GRANULARITIES),
            ("grad_scale", grad_scale, GRAD_SCALES),
            ("bn_policy", bn_policy, BN_POLICIES),
        ):
            if value not in allowed:
                raise ValueError(f"memory.{key} must be one of {', '.join(allowed)}; got {value!r}")
        if not isinstance(lockstep, bool):
            raise ValueError(f"memory.lockstep must be true or false, got {lockstep!r}")
        check_nograd_chunk(nograd_chunk)
        if recompute is not None and granularity == "block":
            raise ValueError("memory.recompute composes with memory.granularity=frame only "
                             f"(got granularity={granularity!r})")
        if recompute_budget_frac is not None and recompute != "optimal":
            raise ValueError("memory.recompute_budget_frac needs memory.recompute=optimal")
        # the kept-frame path's recomputation (memory=recompute's policies), or None
        self.recompute = None if recompute is None else Recompute(
            recompute, budget_frac=recompute_budget_frac)
        self.keep_ratio = float(keep_ratio)
        self.granularity = granularity
        # frames per no_grad piece of the dropped frames; auto (None): one pass over all of them
        self.nograd_chunk: int | None = None if nograd_chunk == "auto" else int(nograd_chunk)
        self.grad_scale = grad_scale
        self.blocks_spec = blocks if blocks is None or isinstance(blocks, int | float) else list(blocks)
        self.bn_policy = bn_policy
        self.lockstep = lockstep
        # (the backbone, its lockstep twin module or None when untraceable), built at first use
        self._traced: tuple[weakref.ref[nn.Module], fx.GraphModule | None] | None = None
        # the backbone checked as prepared and its BN layers, so that a step walks no modules
        self._prepared: tuple[weakref.ref[nn.Module], list[_BatchNorm]] | None = None
        self.sampler = FrameSampler(sampler, seed, rank)
        self.norm = FullBatchNorm()
        self.splitter = BlockSplitter(self.norm, self.nograd_chunk)
        self.block_indices: list[int] = []  # resolved by prepare() for granularity=block
        self._wrapped: list[nn.Module] = []
        # the masks of the last SBP step, for inspection and tests: frame -> (B, n) kept frame
        # indices; block -> {block index: (B, n)}
        self.last_keep: torch.Tensor | None = None
        self.last_block_keep: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ setup
    def prepare(self, backbone: nn.Module) -> nn.Module:
        """Patch BN layers (``full_batch``) and wrap the selected blocks (``block``), in place.
        ``granularity=auto`` becomes ``frame``, or ``block`` on a backbone that mixes frames
        (temporal shift) where the lockstep code cannot run (untraceable, ``lockstep=false``);
        then ``grad_scale=auto`` becomes ``inverse_keep`` at block granularity, ``none`` at
        frame. Frame granularity on a backbone that mixes frames needs the lockstep code."""
        mixes = mixes_frames(backbone)
        if mixes and self.granularity != "block" and self.recompute is not None:
            raise ValueError(
                "memory.recompute does not compose with SBP on a backbone whose frames meet "
                "(model.backbone.temporal_shift > 0): set memory.recompute=null, or "
                "model.backbone.temporal_shift=0")
        lockstep_ok = not mixes or (self.lockstep and self._lockstep_graph(backbone) is not None)
        if self.granularity == "auto":
            self.granularity = "frame" if lockstep_ok else "block"
        if self.grad_scale == "auto":  # unbiased skip + branch sums at block granularity
            self.grad_scale = "inverse_keep" if self.granularity == "block" else "none"
        if self.granularity == "frame" and not lockstep_ok:
            raise ValueError(
                "memory.granularity=frame with model.backbone.temporal_shift > 0 needs the lockstep "
                "code (memory.lockstep=true and a backbone torch.fx can trace): the shift makes "
                "frames meet inside the backbone. Use memory.granularity=block")
        if self.bn_policy == "full_batch":
            self.norm.patch(backbone)
        if self.recompute is not None:
            self.recompute.prepare(backbone)  # policy=blocks wraps the blocks' forward
        if self.granularity == "block":
            if not callable(getattr(backbone, "blocks", None)):
                raise TypeError("memory.granularity=block needs a backbone with .blocks()")
            all_blocks = backbone.blocks()
            self.block_indices = select_blocks(len(all_blocks), self.blocks_spec)
            self._wrapped = [all_blocks[i] for i in self.block_indices]
            self.splitter.lockstep = self.lockstep
            self.splitter.tracer = getattr(backbone, "fx_tracer", None)
            self.splitter.wrap(self._wrapped)
        return backbone

    # ------------------------------------------------------------------ training forward
    def encode(self, backbone: nn.Module, video: torch.Tensor) -> FrameFeatures:
        """``video (B, T, C, H, W) -> features (B, T, D)`` at positions ``(B, T)``."""
        if not (torch.is_grad_enabled() and backbone.training):
            return encode_all_frames(backbone, video)  # eval / no_grad: plain forward
        self._check_prepared(backbone)
        freeze, replay = nullcontext(), nullcontext()
        if self.bn_policy == "frozen":
            freeze = frozen_batchnorm(backbone)
            replay = replay_on_recompute(lambda: lambda: frozen_batchnorm(backbone))
        with freeze, replay:
            b, t = video.shape[:2]
            keep = n_keep(self.keep_ratio, t)
            if keep == t:  # r=1: exactly e2e (recomputed, when composed)
                if self.recompute is not None:
                    return self.recompute.encode(backbone, video)
                return encode_all_frames(backbone, video)
            scale = t / keep if self.grad_scale == "inverse_keep" else None
            if self.granularity == "frame":
                return self._encode_frames(backbone, video, keep, scale)
            return self._encode_blocks(backbone, video, keep, scale)

    def _encode_frames(
        self, backbone: nn.Module, video: torch.Tensor, keep: int, scale: float | None
    ) -> FrameFeatures:
        b, t = video.shape[:2]
        idx = self.sampler.sample(b, t, keep, video.device)  # (B, n)
        keep_rows, drop_rows = flat_rows(idx, t)  # (B*n,), (B*(T-n),)
        self.last_keep = idx
        frames = video.flatten(0, 1)  # (B*T, C, H, W)
        needs_stats = self.bn_policy == "full_batch" and has_train_batchnorm(self._bn_layers())
        # one pass of the lockstep code unless record/apply (BN statistics) or chunks are asked for
        use_twin = self.recompute is None and self.lockstep and (
            mixes_frames(backbone) or needs_stats or self.nograd_chunk is None)
        twin = self._lockstep_graph(backbone) if use_twin else None
        if twin is None and mixes_frames(backbone):  # e.g. a torch.compile'd backbone
            raise RuntimeError("frame-granularity SBP on a backbone whose frames meet needs the "
                               "lockstep code, and this backbone cannot be traced: use "
                               "memory.granularity=block")
        if twin is not None:
            set_clip_length(backbone, t)  # a temporal shift reads T when it runs
            feats = lockstep_forward(twin, frames, PartRows(keep_rows, drop_rows), scale)
            return FrameFeatures(feats.view(b, t, -1), all_positions(video))  # (B, T, D)
        kept_fn = None
        if self.recompute is not None:  # recompute the kept path (traced for its shape)
            kept_fn = self.recompute.kept_path(backbone, frames[: b * keep])
        feats = split_forward(
            backbone, frames, keep_rows, drop_rows, self.norm, needs_stats=needs_stats,
            chunk=self.nograd_chunk, scale=scale, kept_fn=kept_fn,
        )  # (B*T, D)
        return FrameFeatures(feats.view(b, t, -1), all_positions(video))

    def _encode_blocks(
        self, backbone: nn.Module, video: torch.Tensor, keep: int, scale: float | None
    ) -> FrameFeatures:
        b, t = video.shape[:2]
        rows: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_block_keep = {}
        for i, blk in zip(self.block_indices, self._wrapped, strict=True):
            idx = self.sampler.sample(b, t, keep, video.device)  # (B, n), one draw per block
            rows[blk] = flat_rows(idx, t)
            self.last_block_keep[i] = idx
        with self.splitter.step(b * t, rows, scale):
            return encode_all_frames(backbone, video)  # wrapped blocks split their branches

    def _lockstep_graph(self, backbone: nn.Module) -> fx.GraphModule | None:
        """The lockstep twin module of ``backbone`` (built once per backbone object), or
        ``None``: ``lockstep=False`` with BN statistics to record, or an untraceable backbone."""
        if self._traced is None or self._traced[0]() is not backbone:
            twin = lockstep_graph(backbone, full_batch=self.bn_policy == "full_batch")
            self._traced = (weakref.ref(backbone), twin)
        return self._traced[1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_traced"] = None  # a weak reference does not pickle; copies trace their own
        state["_prepared"] = None  # and check their own backbone once
        return state

    def _bn_layers(self) -> list[_BatchNorm]:
        """The BN layers of the backbone ``_check_prepared`` last accepted."""
        assert self._prepared is not None
        return self._prepared[1]

    def _check_prepared(self, backbone: nn.Module) -> None:
        """Refuse a backbone ``prepare`` did not patch; the module walk runs once per backbone
        object, not every step."""
        if self._prepared is not None and self._prepared[0]() is backbone:
            return
        modules = list(backbone.modules())
        bn_ok = self.bn_policy != "full_batch" or all(
            is_patched_bn(m) for m in modules if isinstance(m, _BatchNorm)
        )
        blocks_ok = self.granularity != "block" or any(
            isinstance(p := m.__dict__.get("forward"), PatchedBlock) and p.owner is self.splitter
            for m in modules
        )
        if not (bn_ok and blocks_ok):
            raise RuntimeError("StochasticBackprop.encode: call strategy.prepare(backbone) first")
        self._prepared = (weakref.ref(backbone), [m for m in modules if isinstance(m, _BatchNorm)])

    # ------------------------------------------------------------------ report (state: SamplerStateMixin)
    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "keep_ratio": self.keep_ratio,
            "granularity": self.granularity,
            "sampler": self.sampler.kind,
            "nograd_chunk": "auto" if self.nograd_chunk is None else self.nograd_chunk,
            "grad_scale": self.grad_scale,
            "bn_policy": self.bn_policy,
            "blocks": self.block_indices if self.granularity == "block" else None,
            "seed": self.sampler.seed,
            "recompute": None if self.recompute is None else self.recompute.policy,
            "lockstep": self.lockstep,
        }
