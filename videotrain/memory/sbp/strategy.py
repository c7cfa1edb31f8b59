"""``memory=sbp``: Stochastic Backpropagation (Cheng et al., CVPR 2022; Fang et al., NeurIPS 2022).

Every frame runs forward; only ``n_keep`` frames per clip run the backbone's backward, so the
other frames' activations are never stored. What it computes and how it runs:
``docs/memory.md`` (``memory=sbp``). Invariants: under ``bn_policy=full_batch`` the forward
equals e2e's and running statistics update once per step; ``keep_ratio=1`` is e2e's code path;
the input gradient is zero on dropped frames. The implementation, the lockstep code or
record/apply where it cannot run, is decided once per backbone and logged with the reason; both
give the same values, statistics and gradients (tested against each other).
"""

from __future__ import annotations

import logging
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
from videotrain.memory.compiled import eagerly
from videotrain.memory.recompute.execute import replay_on_recompute
from videotrain.memory.recompute.strategy import Recompute
from videotrain.memory.sampling import FrameSampler, SamplerStateMixin, flat_rows, n_keep
from videotrain.memory.sbp.lockstep import (
    PartRows,
    compiled_lockstep,
    lockstep_forward,
    lockstep_graph,
)
from videotrain.memory.sbp.split import (
    BN_POLICIES,
    FullBatchNorm,
    frozen_batchnorm,
    has_train_batchnorm,
    is_patched_bn,
    split_forward,
)

log = logging.getLogger(__name__)

GRAD_SCALES = ("none", "inverse_keep")


def check_nograd_chunk(value: Any) -> None:
    """``memory.nograd_chunk`` (SBP): ``auto`` or an integer >= 1."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"memory.nograd_chunk must be auto or an integer >= 1, got {value!r}")


class StochasticBackprop(SamplerStateMixin):
    """SBP memory strategy. See the module docstring for the options and the BN policy."""

    name = "sbp"

    def __init__(
        self,
        keep_ratio: float = 0.5,
        sampler: str = "uniform",
        nograd_chunk: int | str = "auto",
        grad_scale: str = "none",
        bn_policy: str = "full_batch",
        seed: int = 0,
        rank: int | None = None,
        recompute: str | None = None,
        recompute_budget_frac: float | None = None,
    ) -> None:
        n_keep(keep_ratio, 1)  # validates the ratio
        self.sampler = FrameSampler(sampler, seed, rank)  # validates the sampler
        for key, value, allowed in (
            ("grad_scale", grad_scale, GRAD_SCALES),
            ("bn_policy", bn_policy, BN_POLICIES),
        ):
            if value not in allowed:
                raise ValueError(f"memory.{key} must be one of {', '.join(allowed)}; got {value!r}")
        check_nograd_chunk(nograd_chunk)
        if recompute_budget_frac is not None and recompute != "optimal":
            raise ValueError("memory.recompute_budget_frac needs memory.recompute=optimal")
        # the kept-frame path's recomputation (memory=recompute's policies), or None
        self.recompute = None if recompute is None else Recompute(
            recompute, budget_frac=recompute_budget_frac)
        self.keep_ratio = float(keep_ratio)
        # frames per no_grad piece of the dropped frames; auto (None): one pass over all of them
        self.nograd_chunk: int | None = None if nograd_chunk == "auto" else int(nograd_chunk)
        self.grad_scale = grad_scale
        self.bn_policy = bn_policy
        # (the backbone, its lockstep twin module or None: record/apply), decided at first use
        self._traced: tuple[weakref.ref[nn.Module], fx.GraphModule | None] | None = None
        # the backbone checked as prepared and its BN layers, so that a step walks no modules
        self._prepared: tuple[weakref.ref[nn.Module], list[_BatchNorm]] | None = None
        self._chunks_said = False  # the no_grad chunks outside the lockstep code, logged once
        self.norm = FullBatchNorm()
        self.last_keep: torch.Tensor | None = None  # the last step's (B, n) kept frame indices
        self._compiler: Any = None  # trainer.compile: the lockstep code is compiled when built

    # ------------------------------------------------------------------ setup
    def prepare(self, backbone: nn.Module) -> nn.Module:
        """Patch BN layers (``full_batch``) and the recomputed kept path, in place. A backbone
        whose frames meet (temporal shift) needs the lockstep code: it is built here, and a
        backbone that cannot have it, or SBP with recomputation on it, is refused."""
        if mixes_frames(backbone):
            if self.recompute is not None:
                raise ValueError(
                    "memory.recompute does not compose with SBP on a backbone whose frames meet "
                    "(model.backbone.temporal_shift > 0): set memory.recompute=null, or "
                    "model.backbone.temporal_shift=0")
            self._lockstep_graph(backbone)  # raises where it cannot be built
        if self.bn_policy == "full_batch":
            self.norm.patch(backbone)
        if self.recompute is not None:
            self.recompute.prepare(backbone)  # policy=blocks wraps the blocks' forward
        return backbone

    def compile(self, backbone: nn.Module, compiler: Any) -> None:
        """``trainer.compile``: the backbone (evaluation, ``keep_ratio=1``, record/apply's passes;
        recomputation's own hook when composed with it) and the lockstep code, region by region
        (``lockstep.compiled_lockstep``) when it is built."""
        self._compiler, self._traced = compiler, None
        if self.recompute is not None:
            self.recompute.compile(backbone, compiler)
        else:
            compiler(backbone)

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
            return self._encode_frames(backbone, video, keep, scale)

    def _encode_frames(
        self, backbone: nn.Module, video: torch.Tensor, keep: int, scale: float | None
    ) -> FrameFeatures:
        b, t = video.shape[:2]
        idx = self.sampler.sample(b, t, keep, video.device)  # (B, n)
        keep_rows, drop_rows = flat_rows(idx, t)  # (B*n,), (B*(T-n),)
        self.last_keep = idx
        frames = video.flatten(0, 1)  # (B*T, C, H, W)
        needs_stats = self.bn_policy == "full_batch" and has_train_batchnorm(self._bn_layers())
        # the dropped frames in no_grad pieces: only where nothing couples the frames
        chunked = self.nograd_chunk is not None and not needs_stats and not mixes_frames(backbone)
        if chunked and not self._chunks_said:
            log.info("memory=sbp: record/apply's plain scheme, since the dropped frames run in "
                     "no_grad chunks of %d (memory.nograd_chunk), which the lockstep code does not",
                     self.nograd_chunk)
            self._chunks_said = True
        twin = None if chunked else self._lockstep_graph(backbone)
        if twin is not None:
            set_clip_length(backbone, t)  # a temporal shift reads T when it runs
            feats = lockstep_forward(twin, frames, PartRows(keep_rows, drop_rows), scale)
            return FrameFeatures(feats.view(b, t, -1), all_positions(video))  # (B, T, D)
        kept_fn = None
        if self.recompute is not None:  # recompute the kept path (traced for its shape)
            kept_fn = self.recompute.kept_path(backbone, frames[: b * keep])
        run = backbone
        if needs_stats and self._compiler is not None:
            # BN phases break a graph at every BN: the passes run the backbone's code eagerly,
            # and only a recomputed kept path's own compiled segments stay compiled
            run = eagerly(backbone)
            kept_fn = kept_fn or run
        feats = split_forward(
            run, frames, keep_rows, drop_rows, self.norm, needs_stats=needs_stats,
            chunk=self.nograd_chunk, scale=scale, kept_fn=kept_fn,
        )  # (B*T, D)
        return FrameFeatures(feats.view(b, t, -1), all_positions(video))

    def _lockstep_graph(self, backbone: nn.Module) -> fx.GraphModule | None:
        """The lockstep twin module of ``backbone``, or ``None``: record/apply. Decided once per
        backbone object and logged with the reason; a backbone whose frames meet and that
        cannot have the lockstep code is refused (record/apply cannot shift)."""
        if self._traced is None or self._traced[0]() is not backbone:
            twin = None
            if self.recompute is not None:
                log.info("memory=sbp: record/apply, since memory.recompute=%s recomputes the kept "
                         "path, which the lockstep code does not", self.recompute.policy)
            else:
                twin = lockstep_graph(backbone, full_batch=self.bn_policy == "full_batch")
                if twin is None and mixes_frames(backbone):
                    raise ValueError(
                        "memory=sbp on a backbone whose frames meet (model.backbone.temporal_shift "
                        "> 0) needs the lockstep code, and it cannot be built for this backbone (the "
                        "reason is logged above): set model.backbone.temporal_shift=0, or use "
                        "memory=recompute or memory=e2e")
            if twin is not None and self._compiler is not None:
                twin = compiled_lockstep(twin, self._compiler)
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
        if self.bn_policy == "full_batch" and not all(
                is_patched_bn(m) for m in modules if isinstance(m, _BatchNorm)):
            raise RuntimeError("StochasticBackprop.encode: call strategy.prepare(backbone) first")
        self._prepared = (weakref.ref(backbone), [m for m in modules if isinstance(m, _BatchNorm)])

    # ------------------------------------------------------------------ report (state: SamplerStateMixin)
    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "keep_ratio": self.keep_ratio,
            "sampler": self.sampler.kind,
            "nograd_chunk": "auto" if self.nograd_chunk is None else self.nograd_chunk,
            "grad_scale": self.grad_scale,
            "bn_policy": self.bn_policy,
            "seed": self.sampler.seed,
            "recompute": None if self.recompute is None else self.recompute.policy,
        }
