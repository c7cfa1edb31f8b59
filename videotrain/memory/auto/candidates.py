"""``memory=auto``'s candidate plans, their estimated cost, their ranking and the decision table.

Everything here is decision logic over numbers (a :class:`~videotrain.memory.auto.profile.Profile`
and a budget in bytes), so it is tested on synthetic profiles without running a model.

Expected accuracy (the first sort key). Plans are grouped into tiers, best first:

0. **exact**: ``e2e`` and ``recompute`` (recomputation gives e2e's gradients exactly);
1. **sbp**: the backbone's backward runs through ``r`` of the frames (with or without
   recomputation of the kept path, which changes cost, not the gradients); larger ``r`` first;
2. **sbp with frozen BatchNorm**: as 1, but BN normalizes with its running statistics and never
   updates them (``bn_policy=frozen``; no full-batch record pass, so it goes lower). It changes
   the model being trained, so it comes after every full-batch SBP plan;
3. **frame dropout** (only with ``memory.allow_frame_dropout=true``): the head also trains on
   ``r`` of the frames, a train/test gap for temporal heads.

Within a tier and keep ratio the fastest estimated plan comes first. ``choice.walk`` walks
that ranking and takes the first plan whose peak fits the budget.

Estimated peak, on the trainer's ``train_peak_mem_mb`` scale (bytes). With the e2e profile's
step peak ``P``, saved activations ``A`` (backbone ``A_bb``, head ``A_head = A - A_bb``), the
overhead ``O = P - A`` (gradients in flight, optimizer temporaries), of which ``O_f`` grows with
the frames that backpropagate (measured on half the clips; a plan through ``r`` of the frames
holds ``O(r) = O - (1 - r) O_f``), input bytes ``X`` and the peak ``N`` of a ``no_grad`` backbone
forward over all frames:

- sbp at ``r = k/T``: ``max(O(r) + A_head + r*(A_bb + X), F)``. ``F``, the forward's transient:
  ``N * (1 + r/2) + r*X`` for the lockstep code with full-batch BN: at a BN it holds the kept
  block of the input beside the full input and output that a ``no_grad`` forward peaks at, and
  the kept frames' copy of the input (the dropped frames' is freed after their first op); ``N``
  for record/apply and for a backbone whose frames meet only at its temporal shift (one
  unchunked ``no_grad`` pass); frames that do not meet (frozen BN, no BN) in one pass: the
  lockstep pass ``L`` measured at ``r0 = 1/T``, ``F = (1 - r) (L - r0 X) / (1 - r0) + r X``;
  otherwise the dropped frames run in chunks of ``c`` frames and ``F = N * c / (B*T)``. ``r*X``:
  the kept frames are a new tensor that the first layer saves (e2e saves the input, which is not
  counted);
- frame dropout: ``O(r) + r*(A + X)``;
- recompute plans and sbp+recompute: no formula; one profiling step measures each (the
  planner's push-aware peak is a loose upper bound on another scale).

Estimated step time (seconds), from the profile's phase times with the backbone's share of the
forward ``s = t_fwd_backbone / t_fwd`` (the backward is split in the same proportion): e2e
``t_fwd + t_bwd + t_opt``; recompute adds ``overhead_frac * t_fwd_backbone``; sbp runs ``r`` of
the backbone's backward and its forward once, or ``1 + r`` times where full-batch BN statistics
are recorded by a separate pass (the backbone does not trace for lockstep, ``Profile.lockstep``,
and always for sbp+recompute, which adds ``r * t_fwd_backbone`` of recompute); frame dropout
is ``r`` of fwd+bwd. Times only break ties; memory decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from videotrain.memory.auto.profile import MB, Profile
from videotrain.memory.recompute.planner import InfeasibleBudget

TIER_EXACT, TIER_SBP, TIER_SBP_FROZEN, TIER_DROPOUT = 0, 1, 2, 3
TIER_NAMES = {
    TIER_EXACT: "exact (e2e gradients)",
    TIER_SBP: "sbp: backbone grad on r of frames",
    TIER_SBP_FROZEN: "sbp, BN frozen",
    TIER_DROPOUT: "frame dropout: head sees r of frames",
}


@dataclass
class Candidate:
    name: str
    kind: str  # e2e | recompute | sbp | sbp_recompute | frame_dropout
    params: dict[str, Any]  # the strategy's constructor arguments
    tier: int
    keep_ratio: float = 1.0
    estimated_peak: float | None = None  # bytes; None: only a profiling step can tell
    estimated_time: float | None = None  # seconds
    measured_peak: float | None = None  # bytes, from a profiling step
    measured_time: float | None = None
    isolated: bool = False  # profile on a fresh copy of the model
    skip: str | None = None  # why it is not considered at all
    note: str = ""  # what the decision made of it
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the recompute plan's segments
    seq: int = 0  # build order: the last tie-breaker (e.g. recompute plans from most to least memory)

    @property
    def peak(self) -> float | None:
        """The best estimate: measured if a profiling step ran, else estimated."""
        return self.measured_peak if self.measured_peak is not None else self.estimated_peak

    def rank_key(self) -> tuple:
        time_s = self.estimated_time if self.estimated_time is not None else math.inf
        return (self.tier, -self.keep_ratio, time_s, self.seq, self.name)

    def to_dict(self) -> dict[str, Any]:
        def mb(x: float | None) -> float | None:
            return None if x is None else round(x / MB, 3)

        return {
            "name": self.name, "kind": self.kind, "params": self.params, "tier": self.tier,
            "accuracy": TIER_NAMES[self.tier], "keep_ratio": self.keep_ratio,
            # results.json keys keep their names (memory_plan.candidates), as the bench's do
            "estimated_peak_mb": mb(self.estimated_peak), "measured_peak_mb": mb(self.measured_peak),
            "estimated_step_s": self.estimated_time, "measured_step_s": self.measured_time,
            "skip": self.skip, "note": self.note, **self.extra,
        }


class NoPlanFits(InfeasibleBudget):
    """No candidate fits the budget; ``min_budget`` is the smallest budget that would work."""

    def __init__(self, budget: float, min_budget: float | None, smallest: str | None, table: str,
                 advice: str | None = None) -> None:
        if min_budget is None:
            hint = "no candidate could be profiled"
        else:
            advice = advice or f"set memory.budget_mb={math.ceil(min_budget / MB * 10) / 10:.1f} or more"
            hint = f"the smallest budget that would work is {min_budget / MB:.1f} MB ({smallest}): {advice}"
        ValueError.__init__(
            self, f"memory=auto: no plan fits the budget of {budget / MB:.1f} MB; {hint}\n{table}"
        )
        self.budget, self.min_budget, self.smallest = budget, min_budget, smallest


# ---------------------------------------------------------------------- estimates
def _split(p: Profile) -> tuple[float, float, float, float]:
    """(backbone fwd, head fwd, backbone bwd, head bwd) seconds."""
    share = min(max(p.backbone_fwd_s / p.fwd_s, 0.0), 1.0) if p.fwd_s > 0 else 1.0
    return p.fwd_s * share, p.fwd_s * (1 - share), p.bwd_s * share, p.bwd_s * (1 - share)


def sbp_peak(p: Profile, keep: int, full_batch: bool, chunk: int) -> float:
    """Predicted step peak of frame-level SBP keeping ``keep`` of ``T`` frames (bytes);
    ``full_batch``: training-mode BN with ``bn_policy=full_batch``."""
    r = keep / p.num_frames
    stored = p.head_saved + r * (p.saved_backbone + p.input_bytes)
    if full_batch and p.lockstep:
        # one lockstep pass over both parts: beyond a no_grad forward's two full-size blocks at
        # its peak (a BN's input and output) it holds the kept block of one, and the kept input
        transient = p.nograd_peak * (1 + r / 2) + r * p.input_bytes
    elif full_batch or p.mixes_frames:
        # record/apply's no_grad pass over every frame before the kept rerun; or the lockstep
        # pass of frames that meet at a shift only, its dropped part in one no_grad pass
        transient = p.nograd_peak
    else:
        dropped = p.frames - keep * p.batch_size
        transient = p.nograd_peak * min(chunk, dropped) / p.frames
        if chunk >= dropped and p.twin_nograd_peak is not None:
            # one lockstep pass, measured keeping r0 = 1/T: the dropped part's share of it (its
            # forward and its input copy) scales with 1 - r, the kept input copy with r
            r0 = 1 / p.num_frames
            dropped_part = (p.twin_nograd_peak - r0 * p.input_bytes) / (1 - r0)
            transient = (1 - r) * dropped_part + r * p.input_bytes
    return max(p.overhead_at(r) + stored, transient)


def sbp_time(p: Profile, r: float, record_pass: bool) -> float:
    """Predicted SBP step (s); ``record_pass``: full-batch BN statistics recorded by an extra
    ``no_grad`` forward before the kept frames' forward (record/apply, not lockstep)."""
    fb, fh, bb, bh = _split(p)
    return fb * ((1 + r) if record_pass else 1.0) + fh + r * bb + bh + p.opt_s


def dropout_peak(p: Profile, keep: int) -> float:
    r = keep / p.num_frames
    return p.overhead_at(r) + r * (p.saved_total + p.input_bytes)


def dropout_time(p: Profile, r: float) -> float:
    return r * (p.fwd_s + p.bwd_s) + p.opt_s


def recompute_time(p: Profile, overhead_frac: float) -> float:
    return p.step_s + overhead_frac * _split(p)[0]


def keep_counts(num_frames: int) -> list[int]:
    """Frames kept per clip for the subset plans: every ``k`` from ``T-1`` down to 1."""
    return list(range(num_frames - 1, 0, -1))


@dataclass
class Options:
    """What the user allows and how subset plans are configured (see configs/memory/auto.yaml)."""

    allow_frame_dropout: bool = False
    allow_frozen_bn: bool = True
    sbp_recompute: str | None = "blocks"  # None: no sbp+recompute candidates
    sbp_recompute_error: str | None = None  # set when StochasticBackprop rejects `recompute`
    sampler: str = "uniform"  # the configs' default (configs/memory/*.yaml)
    nograd_chunk: int | str = "auto"  # auto: one no_grad pass unless the budget needs chunks
    seed: int = 0


def nograd_chunk_for(p: Profile, keep: int, chunk: int | str, budget: float | None) -> int | str:
    """The no_grad chunk of a frame-SBP candidate whose dropped frames run alone (frozen BN, or
    no BN; frames that do not meet): ``chunk`` when set; with ``auto`` one pass (``"auto"``,
    the fastest: one kernel per layer) unless only chunks make its estimate fit ``budget``;
    then the largest power-of-two chunk that does."""
    if chunk != "auto":
        return int(chunk)
    one_pass, smallest = sbp_peak(p, keep, False, p.frames), sbp_peak(p, keep, False, 1)
    if budget is None or one_pass <= budget or smallest > budget:
        return "auto"  # one pass fits, or no chunk would
    size = 1 << (p.frames.bit_length() - 1)  # the largest power of two below B*T
    while size > 1 and sbp_peak(p, keep, False, size) > budget:
        size //= 2
    return size


def build_candidates(p: Profile, recompute_plans: list[dict[str, Any]], opt: Options,
                     budget: float | None = None) -> list[Candidate]:
    """Every candidate with its estimates. ``recompute_plans``: ``{"params", "name",
    "overhead_frac", ...}`` per distinct recomputation plan (planned by the caller); ``budget``
    (bytes) sizes the no_grad chunks of ``nograd_chunk: auto`` (:func:`nograd_chunk_for`)."""
    t = p.num_frames
    measured = None if p.extrapolated else p.e2e_peak  # else its own profiling step must tell
    cands = [Candidate("e2e", "e2e", {}, TIER_EXACT, 1.0, p.e2e_peak, p.step_s, measured,
                       None if p.extrapolated else p.step_s)]
    for plan in recompute_plans:
        extra = {k: v for k, v in plan.items() if k not in ("params", "name", "overhead_frac")}
        cands.append(Candidate(plan["name"], "recompute", plan["params"], TIER_EXACT, 1.0, None,
                               recompute_time(p, plan["overhead_frac"]),
                               extra={"overhead_frac": plan["overhead_frac"], **extra}))
    common = {"sampler": opt.sampler, "seed": opt.seed}
    for k in keep_counts(t):
        r = k / t
        full = p.has_batchnorm  # full_batch BN needs the unchunked record pass
        # the dropped frames' own no_grad pass, where nothing makes them meet the kept ones
        alone = "auto" if p.mixes_frames else nograd_chunk_for(p, k, opt.nograd_chunk, budget)
        chunk = p.frames if alone == "auto" else alone
        cands.append(Candidate(f"sbp r={r:.3f}", "sbp", {"keep_ratio": r, "bn_policy": "full_batch",
                                                         "nograd_chunk": "auto" if full else alone, **common},
                               TIER_SBP, r, sbp_peak(p, k, full, chunk),
                               sbp_time(p, r, full and not p.lockstep)))
        if opt.sbp_recompute:
            c = Candidate(f"sbp+recompute r={r:.3f}", "sbp_recompute",
                          {"keep_ratio": r, "bn_policy": "full_batch", "recompute": opt.sbp_recompute,
                           "nograd_chunk": "auto" if full else alone, **common},
                          TIER_SBP, r, None, sbp_time(p, r, full) + r * _split(p)[0],  # record/apply
                          isolated=True)
            c.skip = opt.sbp_recompute_error
            cands.append(c)
        if p.has_batchnorm:
            c = Candidate(f"sbp r={r:.3f} bn=frozen", "sbp",
                          {"keep_ratio": r, "bn_policy": "frozen", "nograd_chunk": alone, **common},
                          TIER_SBP_FROZEN, r, sbp_peak(p, k, False, chunk), sbp_time(p, r, False))
            if not opt.allow_frozen_bn:
                c.skip = "sbp with frozen BN: not allowed (memory.allow_frozen_bn=false)"
            cands.append(c)
        c = Candidate(f"frame_dropout r={r:.3f}", "frame_dropout",
                      {"keep_ratio": r, "sampler": opt.sampler, "seed": opt.seed},
                      TIER_DROPOUT, r, dropout_peak(p, k), dropout_time(p, r))
        if not opt.allow_frame_dropout:
            c.skip = "frame dropout: not allowed, it changes what the head sees (memory.allow_frame_dropout=false)"
        cands.append(c)
    return cands


def estimated_candidates(num_frames: int, has_batchnorm: bool, recompute_fracs: list[float],
                         opt: Options, lower_set_cap: int = 500) -> list[Candidate]:
    """Every candidate of the profiled decision, with no peak or time yet: for the choice from
    simulations at full size (``choice.SimulatedPeaks``). Recomputation plans
    are specs (the planner plans each inside its estimate), from the largest budget down
    to the least-memory plan."""
    cands = [Candidate("e2e", "e2e", {}, TIER_EXACT, 1.0)]
    fracs = sorted({float(f) for f in recompute_fracs}, reverse=True)
    # estimated candidates are config nodes (checked against the recompute schema, which has no
    # lower_set_cap: the estimator's Recompute plans with its default cap)
    specs = [({"policy": "optimal", "budget_frac": f, "objective": "time"},
              f"budget_frac={f:g}") for f in fracs]
    specs.append(({"policy": "optimal", "objective": "memory"}, "least memory"))
    for seq, (params, label) in enumerate(specs, start=1):
        cands.append(Candidate(f"recompute optimal ({label})", "recompute", params, TIER_EXACT, 1.0,
                               seq=seq))
    common = {"sampler": opt.sampler, "seed": opt.seed, "nograd_chunk": opt.nograd_chunk}
    for k in keep_counts(num_frames):
        r = k / num_frames
        cands.append(Candidate(f"sbp r={r:.3f}", "sbp", {"keep_ratio": r, "bn_policy": "full_batch", **common},
                               TIER_SBP, r, seq=0))
        if opt.sbp_recompute:
            c = Candidate(f"sbp+recompute r={r:.3f}", "sbp_recompute",
                          {"keep_ratio": r, "bn_policy": "full_batch", "recompute": opt.sbp_recompute,
                           **common}, TIER_SBP, r, seq=1)
            c.skip = opt.sbp_recompute_error
            cands.append(c)
        if has_batchnorm:
            c = Candidate(f"sbp r={r:.3f} bn=frozen", "sbp", {"keep_ratio": r, "bn_policy": "frozen", **common},
                          TIER_SBP_FROZEN, r)
            if not opt.allow_frozen_bn:
                c.skip = "sbp with frozen BN: not allowed (memory.allow_frozen_bn=false)"
            cands.append(c)
        c = Candidate(f"frame_dropout r={r:.3f}", "frame_dropout",
                      {"keep_ratio": r, "sampler": opt.sampler, "seed": opt.seed}, TIER_DROPOUT, r)
        if not opt.allow_frame_dropout:
            c.skip = "frame dropout: not allowed, it changes what the head sees (memory.allow_frame_dropout=false)"
        cands.append(c)
    return cands


# ---------------------------------------------------------------------- ranking and report
def ranked(cands: list[Candidate]) -> list[Candidate]:
    return sorted(cands, key=Candidate.rank_key)


def reason(chosen: Candidate, cands: list[Candidate], budget: float) -> str:
    """Why ``chosen``, in one sentence for the log and results.json."""
    fits = f"{chosen.peak / MB:.1f} MB <= budget {budget / MB:.1f} MB"
    if chosen.kind == "e2e":
        return f"e2e fits ({fits}): exact gradients and no extra compute"
    better = [c for c in cands if not c.skip and c.rank_key() < chosen.rank_key() and c.peak is not None]
    closest = min(better, key=lambda c: c.peak, default=None)
    why_not = (f"no plan with better expected accuracy fits (the smallest of them, {closest.name}, "
               f"needs {closest.peak / MB:.1f} MB)" if closest else "the preferred plans were not profiled")
    what = {"recompute": "exact gradients at the least recompute that fits",
            "sbp": f"the largest keep ratio that fits (r={chosen.keep_ratio:.3f})",
            "sbp_recompute": f"the largest keep ratio that fits (r={chosen.keep_ratio:.3f}), with recomputation",
            "frame_dropout": f"frame dropout allowed, largest keep ratio that fits (r={chosen.keep_ratio:.3f})"}
    equals = [c for c in cands if c is not chosen and not c.skip and c.tier == chosen.tier
              and c.keep_ratio == chosen.keep_ratio]
    tie = "; the fastest of the plans with the same expected accuracy" if equals else ""
    return f"{chosen.name} ({fits}): {what[chosen.kind]}; {why_not}{tie}"


def render_table(cands: list[Candidate], budget: float, chosen: Candidate | None = None,
                 show_skipped: bool = False) -> str:
    """The decision as a markdown table (ranking order), for the log, the CLI and the README."""

    def mb(x: float | None) -> str:
        return "–" if x is None else f"{x / MB:.1f}"

    lines = [
        f"memory budget {budget / MB:.1f} MB (per-step peak, as train_peak_mem_mb)",
        "",
        "| # | plan | expected accuracy | estimated peak MB | measured peak MB | estimated step s | outcome |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [c for c in ranked(cands) if show_skipped or c.note or not c.skip]
    for i, c in enumerate(rows):
        outcome = c.note or (f"skipped: {c.skip}" if c.skip else "")
        if c is chosen:
            outcome = f"**{outcome}**"
        time_s = "–" if c.estimated_time is None else f"{c.estimated_time:.2f}"
        lines.append(f"| {i + 1} | {c.name} | {TIER_NAMES[c.tier]} | {mb(c.estimated_peak)} | "
                     f"{mb(c.measured_peak)} | {time_s} | {outcome} |")
    skipped = sorted({c.skip for c in cands if c.skip and not c.note and not show_skipped})
    for s in skipped:
        lines.append(f"(not considered: {s})")
    return "\n".join(lines)
