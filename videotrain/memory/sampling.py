"""Frame selection for the strategies that keep a subset of frames (frame dropout, SBP).

Invariants: ``n_keep = clamp(round(r * T), 1, T)`` for any ratio (a count, not the official
code's integer stride); every sampler keeps exactly ``n_keep`` distinct frames per clip, so a
step's memory does not depend on luck and the kept features stack into ``(B, n_keep, D)``; the
masks come from the sampler's own generator (not the global RNG), re-seeded before every draw
from ``(seed, rank, draw index)``: DDP ranks draw different masks, and the whole state is one
counter, which resumes every rank exactly. Why: docs/memory.md#frame-sampling-frame-dropout-and-sbp.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any

import torch

SAMPLERS = ("random", "uniform", "uniform_jitter")


def n_keep(keep_ratio: float, num_frames: int) -> int:
    """Frames kept out of ``num_frames``: ``clamp(round(r * T), 1, T)``, rounding half up."""
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"memory.keep_ratio must be in (0, 1], got {keep_ratio}")
    if num_frames < 1:
        raise ValueError(f"a clip needs at least one frame, got T={num_frames}")
    return min(num_frames, max(1, math.floor(keep_ratio * num_frames + 0.5)))


def env_rank() -> int:
    """The DDP rank from the ``RANK`` environment variable (set by torchrun); 0 when unset."""
    return int(os.environ.get("RANK", "0"))


def _derive_seed(seed: int, rank: int, draw: int) -> int:
    """A 63-bit seed that is a stable function of ``(seed, rank, draw)`` across runs/versions."""
    digest = hashlib.sha256(f"videotrain.sampling:{seed}:{rank}:{draw}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _random(batch: int, num_frames: int, keep: int, gen: torch.Generator) -> torch.Tensor:
    """Uniformly random ``keep``-subsets: argsort of i.i.d. uniforms -> (B, keep)."""
    return torch.rand(batch, num_frames, generator=gen).argsort(dim=1)[:, :keep]


def _uniform(batch: int, num_frames: int, keep: int, gen: torch.Generator) -> torch.Tensor:
    """Evenly spaced frames ``floor(u + i * T/keep)`` with a random offset ``u in [0, T/keep)``.

    A random shift of a lattice with spacing ``s = T/keep >= 1`` hits every unit interval
    with probability ``1/s``, so each position is kept with probability exactly ``keep/T``.
    """
    stride = num_frames / keep
    offset = torch.rand(batch, 1, generator=gen, dtype=torch.float64) * stride  # (B, 1)
    grid = torch.arange(keep, dtype=torch.float64) * stride  # (keep,)
    return (offset + grid).floor().long().clamp_(max=num_frames - 1)  # (B, keep)


def _uniform_jitter(batch: int, num_frames: int, keep: int, gen: torch.Generator) -> torch.Tensor:
    """One uniformly random frame inside each of ``keep`` contiguous chunks of the clip."""
    bounds = torch.tensor([(i * num_frames) // keep for i in range(keep + 1)])  # (keep + 1,)
    lo, size = bounds[:-1], bounds[1:] - bounds[:-1]  # (keep,), every chunk >= 1 frame
    u = torch.rand(batch, keep, generator=gen, dtype=torch.float64)  # (B, keep)
    return lo + (u * size).floor().long().clamp_(max=size - 1)


_DRAW = {"random": _random, "uniform": _uniform, "uniform_jitter": _uniform_jitter}


class FrameSampler:
    """Draws the kept frames of every clip: ``sample(B, T, n) -> (B, n)`` sorted long indices.

    ``rank`` defaults to the ``RANK`` environment variable so that every DDP process draws
    different masks from the same configured ``seed``.
    """

    def __init__(self, kind: str = "random", seed: int = 0, rank: int | None = None) -> None:
        if kind not in _DRAW:
            raise ValueError(f"memory.sampler must be one of {', '.join(SAMPLERS)}; got {kind!r}")
        self.kind = kind
        self.seed = int(seed)
        self.rank = env_rank() if rank is None else int(rank)
        self.draws = 0  # how many masks were drawn so far: the whole resumable state
        self.generator = torch.Generator(device="cpu")

    def sample(
        self, batch: int, num_frames: int, keep: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Kept frame indices ``(batch, keep)``, sorted within each clip, on ``device``."""
        if not 1 <= keep <= num_frames:
            raise ValueError(f"cannot keep {keep} of {num_frames} frames")
        self.generator.manual_seed(_derive_seed(self.seed, self.rank, self.draws))
        self.draws += 1
        idx = _DRAW[self.kind](batch, num_frames, keep, self.generator)  # (B, keep)
        return idx.sort(dim=1).values.to(device=device)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the mask stream; the rank stays this process's own (see module docstring)."""
        self.seed = int(state.get("seed", self.seed))
        self.draws = int(state["draws"])


class SamplerStateMixin:
    """Checkpoint state of a strategy whose only state is its ``FrameSampler`` (``self.sampler``)."""

    sampler: FrameSampler

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])


def keep_mask(keep_idx: torch.Tensor, num_frames: int) -> torch.Tensor:
    """Boolean ``(B, T)`` mask from kept indices ``(B, n)``."""
    mask = torch.zeros(keep_idx.shape[0], num_frames, dtype=torch.bool, device=keep_idx.device)
    return mask.scatter_(1, keep_idx, True)


def flat_rows(keep_idx: torch.Tensor, num_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``video.flatten(0, 1)`` (``N = B*T``) that are kept / dropped, both sorted.

    ``keep_idx (B, n) -> kept rows (B*n,), dropped rows (B*(T-n),)``.
    """
    b, n = keep_idx.shape
    offsets = torch.arange(b, device=keep_idx.device)[:, None] * num_frames  # (B, 1)
    kept = keep_idx.sort(dim=1).values + offsets  # (B, n)
    # a stable sort of the mask puts each clip's dropped frames (False) first, in frame order;
    # no nonzero(): its output shape depends on the data (a device sync on CUDA)
    mask = keep_mask(keep_idx, num_frames).to(torch.uint8)  # (B, T)
    dropped = torch.sort(mask, dim=1, stable=True).indices[:, : num_frames - n] + offsets
    return kept.flatten(), dropped.flatten()
