"""``memory=auto``: give it a memory budget, get the fastest training plan that fits.

A user facing an out-of-memory error otherwise guesses among batch size, recomputation and frame
sampling. ``AutoStrategy`` decides, says why, and checks itself:

1. **Profile** (``plan``, called by ``videotrain.config.build.plan_memory`` before training, and by
   ``python -m videotrain.plan``): one real e2e training step of the configured model and batch
   on a copy of the model (:mod:`videotrain.memory.auto.profile`), measured with the trainer's own
   per-step peak meter, so the budget means what ``train_peak_mem_mb`` means.
2. **Candidates** (:mod:`videotrain.memory.auto.candidates`): e2e; recomputation plans of the
   Kusumoto planner at several of its budgets; frame-level SBP at every keep ratio ``k/T``;
   SBP with recomputation of the kept path (when ``StochasticBackprop`` takes ``recompute``);
   SBP with frozen BatchNorm; frame dropout only when allowed. SBP and frame dropout peaks are
   estimated from the e2e profile; recomputation plans are measured by one profiling step each,
   when the walk reaches them.
3. **Choice**: the best expected accuracy that fits, the fastest among equals; the chosen plan
   is verified by one profiling step (``verify``). The decision table goes to the log and to
   ``results.json`` (``memory_plan``). If nothing fits, ``plan`` raises :class:`NoPlanFits`
   before training, naming the smallest budget that would work.
4. **Re-check**: the trainer reports every step's measured peak (``observe_step``). The first
   one is skipped (it allocates the gradient buffers and optimizer state). A later step over the
   budget (by more than ``recheck_tolerance``) steps down to the next plan in the ranking that
   fits, shifting the estimates by the observed misestimate, and the step-down is logged
   and recorded. Strategies hold no parameters, so the optimizer is untouched.

The concrete strategy is swapped in place: :func:`~videotrain.memory.auto.profile.unprepare` undoes
the previous one's ``prepare`` on the backbone, then the next one is prepared.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from videotrain.memory.auto.candidates import (
    Candidate,
    NoPlanFits,
    Options,
    build_candidates,
    estimated_candidates,
    ranked,
    reason,
    render_table,
)
from videotrain.memory.auto.choice import INFEASIBLE, choose, choose_estimated
from videotrain.memory.auto.profile import MB, Profile, StepProbe, device_free_bytes, unprepare
from videotrain.memory.base import FrameFeatures, MemoryStrategy, mixes_frames
from videotrain.memory.e2e import EndToEnd
from videotrain.memory.estimate import (
    CUDA_CONTEXT_GIB,
    GIB,
    UNSEEN_FRAC,
    StepMemory,
    usable_bytes,
)
from videotrain.memory.frame_dropout import FrameDropout
from videotrain.memory.recompute.planner import InfeasibleBudget
from videotrain.memory.recompute.strategy import Recompute
from videotrain.memory.sampling import SAMPLERS
from videotrain.memory.sbp.strategy import StochasticBackprop, check_nograd_chunk

log = logging.getLogger(__name__)

__all__ = ["AutoStrategy", "NoPlanFits", "build_strategy"]


STRATEGIES: dict[str, type] = {"e2e": EndToEnd, "recompute": Recompute, "sbp": StochasticBackprop,
                                "sbp_recompute": StochasticBackprop, "frame_dropout": FrameDropout}
RECOMPUTE_FRACS = (0.9, 0.75, 0.6, 0.5, 0.4)  # the default planner budgets of recompute plans


def build_strategy(c: Candidate, rank: int | None = None) -> MemoryStrategy:
    """The concrete strategy of a candidate (a new, unprepared instance)."""
    if c.kind not in STRATEGIES:
        raise ValueError(f"unknown memory=auto candidate kind {c.kind!r}")
    ranked_kw = {} if c.kind in ("e2e", "recompute") else {"rank": rank}
    return STRATEGIES[c.kind](**c.params, **ranked_kw)


def memory_node(c: Candidate) -> dict[str, Any]:
    """The candidate as a ``memory:`` config node (what an estimating process instantiates)."""
    cls = STRATEGIES[c.kind]
    return {"_target_": f"{cls.__module__}.{cls.__qualname__}", **c.params}


def recompute_plans(backbone: nn.Module, frames: torch.Tensor, fracs: list[float],
                     cap: int) -> list[dict[str, Any]]:
    """Distinct recomputation plans: the planner's least-recompute plan at each of ``fracs`` x
    its own e2e peak estimate, plus its least-memory plan. Plans of one segment are e2e."""
    specs = [{"policy": "optimal", "budget_frac": f, "objective": "time", "lower_set_cap": cap} for f in fracs]
    specs.append({"policy": "optimal", "objective": "memory", "lower_set_cap": cap})
    seen: set[tuple[int, ...]] = set()
    plans = []
    for spec in specs:
        try:
            with torch.no_grad():
                _, _, chosen, report = Recompute(**spec).make_plan(backbone, frames)  # (N, C, H, W)
        except InfeasibleBudget:
            continue
        chain = tuple(chosen.chain)
        if len(chain) <= 1 or chain in seen:
            continue
        seen.add(chain)
        label = f"budget_frac={spec['budget_frac']}" if "budget_frac" in spec else "least memory"
        plans.append({
            "params": spec, "overhead_frac": report["overhead_frac_of_forward"],
            "name": f"recompute optimal ({label}, {len(chain)} segments)",
            "segments": len(chain), "planner_peak_mb": report["estimated_peak_bytes"] / MB,
        })
    return plans


def _mb(x: float | None) -> float | None:
    return None if x is None else x / MB


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x / MB:.1f}"


class AutoStrategy:
    """Chooses and runs a concrete strategy for a memory budget; see the module docstring."""

    name = "auto"

    def __init__(
        self,
        budget_mb: float | None = None,
        budget_frac: float | None = None,
        budget_gb: float | None = None,
        free_frac: float = 0.9,
        allow_frame_dropout: bool = False,
        allow_frozen_bn: bool = True,
        sbp_recompute: str | None = "blocks",
        recompute_fracs: list[float] | tuple[float, ...] = RECOMPUTE_FRACS,
        verify: bool = True,
        max_profiles: int = 16,
        recheck_tolerance: float = 0.02,
        sampler: str = "uniform",
        nograd_chunk: int | str = "auto",
        lower_set_cap: int = 500,
        seed: int = 0,
        rank: int | None = None,
    ) -> None:
        if sum(b is not None for b in (budget_mb, budget_frac, budget_gb)) > 1:
            raise ValueError("set at most one of memory.budget_gb, memory.budget_mb and memory.budget_frac")
        if budget_gb is not None and not budget_gb > 0:
            raise ValueError(f"memory.budget_gb must be > 0 (the device's memory in GiB), got {budget_gb}")
        if budget_mb is not None and not budget_mb > 0:
            raise ValueError(f"memory.budget_mb must be > 0, got {budget_mb}")
        if budget_frac is not None and not budget_frac > 0:
            raise ValueError(f"memory.budget_frac must be > 0 (a fraction of the measured e2e peak), got {budget_frac}")
        if not 0 < free_frac <= 1:
            raise ValueError(f"memory.free_frac must be in (0, 1], got {free_frac}")
        if any(not 0 < f for f in recompute_fracs):
            raise ValueError(f"memory.recompute_fracs must be positive fractions, got {list(recompute_fracs)}")
        if max_profiles < 0:
            raise ValueError(f"memory.max_profiles must be >= 0, got {max_profiles}")
        if recheck_tolerance < 0:
            raise ValueError(f"memory.recheck_tolerance must be >= 0, got {recheck_tolerance}")
        if sampler not in SAMPLERS:
            raise ValueError(f"memory.sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}")
        if sbp_recompute not in (None, "blocks", "sqrt"):
            raise ValueError(f"memory.sbp_recompute must be null, blocks or sqrt; got {sbp_recompute!r}")
        check_nograd_chunk(nograd_chunk)
        self.budget_mb, self.budget_frac, self.free_frac = budget_mb, budget_frac, free_frac
        self.budget_gb = None if budget_gb is None else float(budget_gb)
        self.mode = ""  # profiled (real steps) | estimated (fake-tensor steps), once planned
        self.options = Options(allow_frame_dropout=bool(allow_frame_dropout),
                               allow_frozen_bn=bool(allow_frozen_bn), sbp_recompute=sbp_recompute,
                               sampler=sampler, nograd_chunk=nograd_chunk, seed=int(seed))
        self.recompute_fracs = [float(f) for f in recompute_fracs]
        self.verify, self.max_profiles = bool(verify), int(max_profiles)
        self.recheck_tolerance, self.lower_set_cap, self.rank = float(recheck_tolerance), int(lower_set_cap), rank
        self.backbone: nn.Module | None = None
        self.candidates: list[Candidate] = []
        self.budget: float | None = None  # bytes
        self.budget_source = ""
        self.profile: Profile | None = None
        self.chosen: Candidate | None = None  # the plan decided before training
        self.active: Candidate | None = None  # the plan running now (after step-downs)
        self.inner: MemoryStrategy | None = None
        self.reason = ""
        self.step_downs: list[dict[str, Any]] = []
        self.recheck: dict[str, Any] | None = None  # the first comparison of measured vs estimated
        self.observed_max: dict[str, float] = {}  # plan name -> largest measured step peak (MB)
        self._observed = 0
        self._estimate: Callable[[Candidate], None] | None = None  # estimated mode: for step-downs

    # ------------------------------------------------------------------ the decision
    def resolve_budget(self, profile: Profile, free_bytes: float | None) -> tuple[float, str]:
        """(budget bytes, where it came from). ``free_bytes``: the device's free memory before
        profiling (only needed when neither budget key is set)."""
        if self.budget_mb is not None:
            return float(self.budget_mb) * MB, f"memory.budget_mb={self.budget_mb}"
        if self.budget_frac is not None:
            return (self.budget_frac * profile.e2e_peak,
                    f"memory.budget_frac={self.budget_frac} x measured e2e peak {profile.e2e_peak / MB:.1f} MB")
        if free_bytes is None:
            raise ValueError("memory=auto needs memory.budget_mb, memory.budget_frac or the device's free memory")
        # the run will also hold gradient buffers and optimizer state, which are not allocated yet
        usable = max(free_bytes - profile.held_growth, 0.0)
        return (self.free_frac * usable,
                f"memory.free_frac={self.free_frac} x (free device memory {free_bytes / MB:.0f} MB - "
                f"gradients and optimizer state {profile.held_growth / MB:.1f} MB)")

    def _sbp_recompute_error(self, backbone: nn.Module) -> str | None:
        """Why the SBP + recompute candidates are skipped, or ``None``. Record/apply, which they
        run, cannot run a backbone whose frames meet (TSM's temporal shift;
        ``StochasticBackprop.prepare`` refuses it); frame SBP itself runs there, lockstep."""
        if not self.options.sbp_recompute:
            return "sbp+recompute: disabled (memory.sbp_recompute=null)"
        if mixes_frames(backbone):
            return "sbp + recompute: the backbone's temporal shift mixes frames"
        return None

    def _measure(self, probe: StepProbe, c: Candidate) -> None:
        try:
            got = probe.measure(build_strategy(c, self.rank), isolated=c.isolated)
        except torch.cuda.OutOfMemoryError:
            c.skip = "out of memory in its profiling step"
            return
        except InfeasibleBudget as err:  # its plan, re-made for the profiling step, has no room
            c.skip = f"its plan is infeasible in the profiling step ({err})"
            log.warning("memory=auto: %s: %s", c.name, c.skip)
            return
        except Exception as err:  # an experimental composition must not stop the decision
            if c.kind != "sbp_recompute":
                raise
            c.skip = f"failed in its profiling step: {type(err).__name__}: {err}"
            log.warning("memory=auto: %s %s", c.name, c.skip)
            return
        c.measured_peak, c.measured_time = got.peak, got.time_s

    def plan(self, probe: StepProbe) -> dict[str, Any]:
        """Profile, build the candidates, choose, and switch to the chosen plan. Raises
        :class:`NoPlanFits` (a ``ValueError``) when no plan fits the budget."""
        free = None
        if self.budget_mb is None and self.budget_frac is None:
            free = device_free_bytes(probe.device)
        self.mode = "profiled"
        try:
            self.profile = profile = probe.profile()
            self.budget, self.budget_source = self.resolve_budget(profile, free)
            self.options.sbp_recompute_error = self._sbp_recompute_error(probe.model.backbone)
            with probe.precision.autocast():  # planned as the profiling steps will re-plan
                plans = recompute_plans(probe.model.backbone, probe.frames(),
                                        self.recompute_fracs, self.lower_set_cap)
            self.candidates = build_candidates(profile, plans, self.options, self.budget)
            # NoPlanFits carries the table in its message
            chosen = choose(self.candidates, self.budget, lambda c: self._measure(probe, c),
                            verify=self.verify, max_profiles=self.max_profiles)
        finally:
            probe.close()
        self.chosen, self.reason = chosen, reason(chosen, self.candidates, self.budget)
        self._activate(chosen)
        log.info("memory=auto decision (%s):\n%s\nchosen: %s", self.budget_source,
                 render_table(self.candidates, self.budget, chosen), self.reason)
        return self.plan_report()

    def estimates(self, device: torch.device) -> bool:
        """Whether to plan from estimates (:meth:`plan_estimated`) instead of profiling real
        steps: with ``memory.budget_gb``, and on CUDA when no budget is set (a full-size
        profiling step could itself run out of memory)."""
        unset = self.budget_mb is None and self.budget_frac is None
        return self.budget_gb is not None or (unset and device.type == "cuda")

    def plan_estimated(self, estimate: Callable[[dict[str, Any]], StepMemory], num_frames: int,
                       device: torch.device) -> dict[str, Any]:
        """Choose from fake-tensor estimates at full size, before anything runs on the device
        (:mod:`videotrain.memory.auto.choice`). ``estimate(memory_node)`` simulates the
        configured run with that ``memory:`` node. Raises :class:`NoPlanFits`."""
        target = device.type
        if self.budget_gb is not None:
            usable = usable_bytes(self.budget_gb, target)
            source = f"memory.budget_gb={self.budget_gb:g}"
        else:  # CUDA, no budget: a share of what the allocator can still get, weights included
            usable = self.free_frac * (device_free_bytes(device) + torch.cuda.memory_allocated(device))
            source = f"memory.free_frac={self.free_frac} x free device memory"
        assert self.backbone is not None, "prepare(backbone) comes first (VideoClassifier does it)"
        self.options.sbp_recompute_error = self._sbp_recompute_error(self.backbone)
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.backbone.modules())
        self.candidates = estimated_candidates(num_frames, has_bn, self.recompute_fracs, self.options,
                                               self.lower_set_cap)
        def run(c: Candidate) -> StepMemory | None:
            try:
                mem = estimate(memory_node(c))
            except Exception as err:  # one candidate's failure must not stop the decision
                text = str(err).splitlines()[0][:300]
                infeasible = text.startswith(InfeasibleBudget.__name__ + ": ")
                c.skip = (f"{INFEASIBLE} ({text.split(': ', 1)[1]})" if infeasible
                          else f"its estimate failed: {text}")
                if not infeasible:
                    log.warning("memory=auto: %s: %s", c.name, c.skip)
                return None
            c.estimated_peak = max(mem.train_peak, mem.eval_peak or 0) - base
            c.extra.update({"estimated_train_peak_gb": round(mem.train_peak / GIB, 3),
                            "estimated_eval_peak_gb": round((mem.eval_peak or 0) / GIB, 3)})
            return mem

        e2e, base = self.candidates[0], 0.0
        held = run(e2e)  # what e2e holds between steps (weights, gradients, optimizer state) sets the scale
        if held is not None:
            base = held.held - held.batch
            e2e.estimated_peak -= base
        # the trainer's scale: a step's peak over what is held between steps
        self.budget = usable / (1 + UNSEEN_FRAC) - base
        self.budget_source = (
            f"{source}: {usable / GIB:.2f} GiB for the allocator"
            + (f" (less {CUDA_CONTEXT_GIB:g} GiB of CUDA context)" if self.budget_gb is not None
               and target == "cuda" else "")
            + f", less {UNSEEN_FRAC:.0%} for workspaces and fragmentation, less {base / GIB:.2f} GiB "
            "held between steps (weights, gradients, optimizer state), estimated on fake tensors")
        self.mode = "estimated"

        def advice(peak: float) -> str:  # the memory.budget_gb that would hold a peak
            context_gb = self.budget_gb - usable / GIB if self.budget_gb is not None else 0.0
            need_gb = (peak + base) * (1 + UNSEEN_FRAC) / GIB + context_gb
            return f"set memory.budget_gb={math.ceil(need_gb * 10) / 10:.1f} or more"

        chosen = choose_estimated(self.candidates, self.budget, run, self.max_profiles, advice=advice)
        self._estimate = run
        self.chosen, self.reason = chosen, reason(chosen, self.candidates, self.budget)
        self._activate(chosen)
        log.info("memory=auto decision from estimates (%s):\n%s\nchosen: %s", self.budget_source,
                 render_table(self.candidates, self.budget, chosen), self.reason)
        return self.plan_report()

    def _activate(self, c: Candidate) -> None:
        strategy = build_strategy(c, self.rank)
        if self.backbone is not None:
            strategy.prepare(unprepare(self.backbone))
        self.inner, self.active = strategy, c

    # ------------------------------------------------------------------ the strategy seam
    def prepare(self, backbone: nn.Module) -> nn.Module:
        """Remember the backbone; the chosen plan prepares it when ``plan`` decides."""
        self.backbone = backbone
        if self.inner is not None:
            self.inner.prepare(unprepare(backbone))
        return backbone

    def encode(self, backbone: nn.Module, video: torch.Tensor) -> FrameFeatures:
        """``video (B, T, C, H, W)`` -> the active plan's features and positions."""
        if self.inner is None:
            raise RuntimeError("memory=auto has no plan yet: call AutoStrategy.plan(StepProbe(...)) "
                               "before training (videotrain.config.build.plan_memory does)")
        return self.inner.encode(backbone, video)

    # ------------------------------------------------------------------ the re-check
    def observe_step(self, step: int, peak_mb: float) -> None:
        """Compare a step's measured peak with the budget; step down if it is over."""
        if self.active is None or self.budget is None:
            return
        self._observed += 1
        if self._observed == 1:
            return  # the first step allocates gradient buffers and optimizer state
        active, peak = self.active, peak_mb * MB
        self.observed_max[active.name] = max(self.observed_max.get(active.name, 0.0), peak_mb)
        estimated = active.peak or 0.0  # the profiling step's figure where there was one
        if self.recheck is None:
            self.recheck = {
                "step": step, "plan": active.name, "measured_peak_mb": peak_mb,
                "estimated_peak_mb": _mb(active.estimated_peak), "profiled_peak_mb": _mb(active.measured_peak),
                "budget_mb": self.budget / MB,
            }
            log.info("memory=auto re-check at step %d: %s measured %.1f MB in training; estimated %s MB, "
                     "profiled %s MB; budget %.1f MB", step, active.name, peak_mb,
                     _fmt(active.estimated_peak), _fmt(active.measured_peak), self.budget / MB)
        if peak <= self.budget * (1 + self.recheck_tolerance):
            return
        shift = max(peak - estimated, 0.0)
        nxt = self._next_estimated(shift) if self._estimate is not None else None
        nxt = nxt or self.next_plan(shift=shift)
        record = {"step": step, "from": active.name, "measured_peak_mb": peak_mb,
                  "estimated_peak_mb": estimated / MB, "budget_mb": self.budget / MB,
                  "to": nxt.name if nxt else None,
                  "to_estimated_peak_mb": nxt.peak / MB if nxt else None}
        self.step_downs.append(record)
        if nxt is None:
            log.warning("memory=auto: step %d measured %.1f MB > budget %.1f MB with %s, and no plan "
                        "with a smaller peak is left; continuing over budget", step, peak_mb,
                        self.budget / MB, active.name)
            return
        log.warning("memory=auto: step %d measured %.1f MB > budget %.1f MB (estimated %.1f MB for %s); "
                    "stepping down to %s (estimated %.1f MB)", step, peak_mb, self.budget / MB,
                    estimated / MB, active.name, nxt.name, nxt.peak / MB)
        self._activate(nxt)

    def _next_estimated(self, shift: float) -> Candidate | None:
        """Estimated mode: the walk again over the plans ranked after the active one, estimating
        those it reaches, for the budget less the active plan's misestimate ``shift``."""
        assert self.active is not None and self.budget is not None and self._estimate is not None
        order = ranked(self.candidates)
        rest = order[order.index(self.active) + 1:] if self.active in order else order
        for c in rest:
            if c.note.startswith("not needed"):
                c.note = ""
        log.info("memory=auto: estimating the plans after %s for %.1f MB (the budget less its "
                 "misestimate)", self.active.name, (self.budget - shift) / MB)
        try:
            return choose_estimated(rest, self.budget - shift, self._estimate, self.max_profiles)
        except NoPlanFits:
            return None

    def next_plan(self, shift: float = 0.0) -> Candidate | None:
        """The next plan in the ranking with a smaller known peak that fits the budget when its
        estimate is raised by ``shift`` (the active plan's misestimate); failing that, the
        one with the smallest known peak below the active plan's."""
        assert self.active is not None and self.budget is not None
        order = ranked(self.candidates)
        start = order.index(self.active) + 1 if self.active in order else 0
        current = self.active.peak if self.active.peak is not None else float("inf")
        smaller = [c for c in order[start:] if not c.skip and c.peak is not None and c.peak < current]
        for c in smaller:
            if c.peak + shift <= self.budget:
                return c
        return min(smaller, key=lambda c: c.peak, default=None)

    # ------------------------------------------------------------------ state and reports
    def state_dict(self) -> dict[str, Any]:
        if self.active is None or self.inner is None:
            return {}
        return {"active": self.active.name, "kind": self.active.kind, "params": self.active.params,
                "inner": self.inner.state_dict(), "step_downs": list(self.step_downs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the plan that was running (after any step-downs), with its sampler state."""
        if not state:
            return
        by_name = {c.name: c for c in self.candidates}
        c = by_name.get(state["active"])
        if c is None:  # the re-profiled candidates differ: rebuild the saved plan as it was
            c = Candidate(state["active"], state["kind"], dict(state["params"]), tier=0)
        if self.active is None or c.name != self.active.name:
            log.info("memory=auto: resuming with %s (from the checkpoint)", c.name)
            self._activate(c)
        self.inner.load_state_dict(state["inner"])
        self.step_downs = list(state.get("step_downs", []))

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "budget_mb": None if self.budget is None else round(self.budget / MB, 3),
            "plan": None if self.active is None else self.active.name,
            "active": None if self.inner is None else self.inner.describe(),
        }

    def plan_report(self) -> dict[str, Any]:
        """What ``results.json`` records as ``memory_plan``."""
        if self.budget is None or self.chosen is None:
            return {}
        return {
            "budget_mb": self.budget / MB,
            "budget_source": self.budget_source,
            "mode": self.mode,
            "chosen": self.chosen.name,
            "reason": self.reason,
            "active": self.active.name if self.active else None,
            "estimated_peak_mb": _mb(self.chosen.estimated_peak),  # from the e2e profile
            "profiled_peak_mb": _mb(self.chosen.measured_peak),  # its own profiling step
            "profile": self.profile.as_dict() if self.profile else None,
            "candidates": [c.to_dict() for c in ranked(self.candidates)],
            "table": render_table(self.candidates, self.budget, self.chosen),
            "recheck": self.recheck,
            "observed_peak_mb": dict(self.observed_max),
            "step_downs": list(self.step_downs),
        }
