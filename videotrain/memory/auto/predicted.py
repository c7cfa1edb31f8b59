"""``memory=auto`` at full size: choose from predictions, before anything runs on the device.

With ``memory.budget_gb`` (or on CUDA with no budget set), ``AutoStrategy`` does not profile
real steps, which at full size could run out of memory themselves: each candidate it reaches is
predicted on fake tensors (:func:`videotrain.simulate.step.simulate_step`, in a process of
its own, through ``videotrain.simulate.config_run``), its training step and validation forward together, as
``python -m videotrain.plan --fit GB`` predicts its rows. The first steps of training then
verify the choice, as for a profiled plan (``AutoStrategy.observe_step``).

The candidates are those of the profiled decision, without timings: nothing is timed, so the
ranking is expected accuracy (tier, then keep ratio), then the structural order of cost (e2e
before recomputation, recomputation plans from the largest planner budget down, plain SBP
before SBP with checkpointing). Predicting all of them at full size would take minutes, so
each *family* (the same plan at falling keep ratios, or the recomputation plans at falling
budgets) is searched by bisection: its peak falls along the family, so the first member that
fits is found in ``log2(n)`` predictions, and the members before it are over budget by
inference (noted as such in the table).

Peaks are on the trainer's ``train_peak_mem_mb`` scale (what a step adds to what is held
between steps: parameters, gradients, optimizer state), so the re-check compares like with
like: a candidate's peak is its larger of training step and validation forward, less what e2e
holds between steps; the budget is the usable device memory (``memory.budget_gb`` less the
CUDA context, less a share for what fake tensors cannot see), less the same.
"""

from __future__ import annotations

from collections.abc import Callable

from videotrain.memory.auto.candidates import (
    TIER_DROPOUT,
    TIER_EXACT,
    TIER_SBP,
    TIER_SBP_FROZEN,
    Candidate,
    NoPlanFits,
    Options,
    keep_counts,
    ranked,
    render_table,
)

INFEASIBLE = "its plan is infeasible"  # how a recomputation plan below the planner's least is skipped


def predicted_candidates(num_frames: int, has_batchnorm: bool, checkpoint_fracs: list[float],
                         opt: Options, lower_set_cap: int = 500) -> list[Candidate]:
    """Every candidate of the profiled decision, with no peak or time yet. Recomputation plans
    are specs (the planner plans each inside its prediction), from the largest budget down
    to the least-memory plan."""
    cands = [Candidate("e2e", "e2e", {}, TIER_EXACT, 1.0)]
    fracs = sorted({float(f) for f in checkpoint_fracs}, reverse=True)
    specs = [({"policy": "optimal", "budget_frac": f, "objective": "time", "lower_set_cap": lower_set_cap},
              f"budget_frac={f:g}") for f in fracs]
    specs.append(({"policy": "optimal", "objective": "memory", "lower_set_cap": lower_set_cap}, "least memory"))
    for seq, (params, label) in enumerate(specs, start=1):
        cands.append(Candidate(f"checkpoint optimal ({label})", "checkpoint", params, TIER_EXACT, 1.0,
                               seq=seq))
    common = {"sampler": opt.sampler, "seed": opt.seed, "nograd_chunk": opt.nograd_chunk}
    for k in keep_counts(num_frames):
        r = k / num_frames
        cands.append(Candidate(f"sbp r={r:.3f}", "sbp", {"keep_ratio": r, "bn_policy": "full_batch", **common},
                               TIER_SBP, r, seq=0))
        if opt.sbp_checkpoint:
            c = Candidate(f"sbp+checkpoint r={r:.3f}", "sbp_checkpoint",
                          {"keep_ratio": r, "bn_policy": "full_batch", "checkpoint": opt.sbp_checkpoint,
                           **common}, TIER_SBP, r, seq=1)
            c.skip = opt.sbp_checkpoint_error
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


def family_key(c: Candidate) -> tuple:
    """Candidates that differ only in keep ratio (or recomputation budget) share a family."""
    fixed = {k: v for k, v in c.params.items() if k not in ("keep_ratio", "budget_frac", "objective")}
    return (c.kind, c.tier, tuple(sorted((k, str(v)) for k, v in fixed.items())))


def choose_predicted(
    cands: list[Candidate],
    budget: float,
    predict: Callable[[Candidate], None],
    max_predictions: int = 16,
    advice: Callable[[float], str] | None = None,
) -> Candidate:
    """The first plan in :func:`ranked` order whose predicted peak fits ``budget`` (bytes).

    ``predict(c)`` sets ``c.predicted_peak`` (or ``c.skip``). On reaching a family not searched
    yet, the walk bisects the rest of it for its first member that fits (at most
    ``max_predictions`` calls in all); members before that one are over budget by inference.
    Raises :class:`NoPlanFits` with the smallest predicted peak (``advice`` words the budget
    that would work in the caller's units)."""
    calls = 0

    def fits(c: Candidate) -> bool:
        nonlocal calls
        if c.predicted_peak is None and not c.skip:
            if calls >= max_predictions:
                c.note = "not predicted (memory.max_profiles)"
                return False
            calls += 1
            predict(c)
        if c.skip or c.predicted_peak is None:
            c.note = c.note or f"skipped: {c.skip}"
            return False
        if c.predicted_peak > budget:
            c.note = "over budget (predicted)"
            return False
        return True

    order = [c for c in ranked(cands) if not c.skip]
    searched: set[tuple] = set()
    for i, c in enumerate(order):
        key = family_key(c)
        if key not in searched:
            searched.add(key)
            family = [m for m in order[i:] if family_key(m) == key]
            _bisect(family, fits)
        if c.note or c.skip or c.predicted_peak is None or c.predicted_peak > budget:
            c.note = c.note or (f"skipped: {c.skip}" if c.skip else "over budget (predicted)"
                                if c.predicted_peak is not None else "not predicted (memory.max_profiles)")
            continue
        c.note = "chosen"
        for later in order[i + 1:]:
            later.note = later.note or "not needed: a preferred plan fits"
        return c
    known = [c for c in cands if not c.skip and c.predicted_peak is not None]
    best = min(known, key=lambda c: c.predicted_peak, default=None)
    table = render_table(cands, budget)
    if best is None:
        raise NoPlanFits(budget, None, None, table)
    raise NoPlanFits(budget, best.predicted_peak, best.name, table,
                     advice=None if advice is None else advice(best.predicted_peak))


def _bisect(family: list[Candidate], fits: Callable[[Candidate], bool]) -> None:
    """Find the first member of ``family`` (peaks falling along it) that fits, by bisection;
    note the members before it that were not predicted as over budget by inference. A member
    that yields no figure (skipped, e.g. a recomputation budget below the planner's least, or
    past the prediction cap) says nothing about its neighbours: it leaves the search."""
    fam = list(family)
    lo, hi = 0, len(fam)  # fam[:lo] are over budget; fam[hi] fits (or hi is the end)
    while lo < hi:
        mid = (lo + hi) // 2
        ok = fits(fam[mid])
        if not ok and fam[mid].predicted_peak is None:
            gone = [fam[mid]]
            if (fam[mid].skip or "").startswith(INFEASIBLE):  # smaller planner budgets are too
                gone += [m for m in fam[mid + 1:hi] if "budget_frac" in m.params]
                for m in gone[1:]:
                    m.skip = f"{INFEASIBLE} (inferred: {fam[mid].name}'s is)"
            fam = [m for m in fam if m not in gone]
            hi -= len(gone)
        elif ok:
            hi = mid
        else:
            lo = mid + 1
    for j, m in enumerate(fam[:lo]):
        if m.predicted_peak is None and not m.note:
            # fam[lo - 1] was predicted over budget, and needs less than every member before it
            over = next(x for x in fam[j + 1:lo] if x.predicted_peak is not None)
            m.note = f"over budget (inferred: {over.name} is over and needs less)"
