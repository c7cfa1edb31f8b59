"""``memory=auto``: give it a memory budget, get the best training plan that fits.

``AutoStrategy`` decides before training (``plan``, called by ``config.build.plan_memory`` and
``python -m videotrain.plan``), says why, and checks itself while training. Each candidate
reached is estimated on fake tensors as ``plan --fit`` estimates a row (``choice.py``), and
ranked by ``candidates.py``; nothing is profiled or timed.

Invariants: the budget is on the trainer's ``train_peak_mem_mb`` scale, whichever key set it;
the first training step is not re-checked (it allocates gradients and optimizer state); a later
step over the budget by more than ``RECHECK_TOLERANCE`` steps down to the next plan that fits the
budget less the active plan's misestimate. Strategies hold no parameters, so a step-down swaps
strategies (:func:`unprepare`, then ``prepare``) with the optimizer untouched.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from videotrain.memory.auto.candidates import (
    MB,
    Candidate,
    NoPlanFits,
    Options,
    build_candidates,
    ranked,
    reason,
    render_table,
    round_up,
)
from videotrain.memory.auto.choice import INFEASIBLE, choose
from videotrain.memory.base import FrameFeatures, MemoryStrategy, mixes_frames
from videotrain.memory.compiled import compile_strategy
from videotrain.memory.estimate import CUDA_CONTEXT_GIB, GIB, UNSEEN_FRAC, StepMemory, usable_bytes
from videotrain.memory.recompute.execute import RecomputedForward
from videotrain.memory.recompute.planner import InfeasibleBudget
from videotrain.memory.registry import STRATEGIES as REGISTRY
from videotrain.memory.sampling import SAMPLERS
from videotrain.memory.sbp.split import PatchedBN

log = logging.getLogger(__name__)

__all__ = ["AutoStrategy", "NoPlanFits", "build_strategy"]

# a candidate's kind -> the registered strategy that runs it (videotrain.memory.registry)
STRATEGIES: dict[str, str] = {"e2e": "e2e", "recompute": "recompute", "sbp": "sbp",
                              "sbp_recompute": "sbp", "frame_dropout": "frame_dropout"}
RECHECK_TOLERANCE = 0.02  # a measured step more than this fraction over the budget steps down

Estimate = Callable[[dict[str, Any]], StepMemory]  # a memory: node -> the run's step, estimated


def build_strategy(c: Candidate, rank: int | None = None) -> MemoryStrategy:
    """The concrete strategy of a candidate (a new, unprepared instance)."""
    if c.kind not in STRATEGIES:
        raise ValueError(f"unknown memory=auto candidate kind {c.kind!r}")
    ranked_kw = {} if c.kind in ("e2e", "recompute") else {"rank": rank}
    return REGISTRY[STRATEGIES[c.kind]].cls(**c.params, **ranked_kw)


def memory_node(c: Candidate) -> dict[str, Any]:
    """The candidate as a ``memory:`` config node (what an estimating process instantiates)."""
    return {"_target_": REGISTRY[STRATEGIES[c.kind]].target, **c.params}


def unprepare(backbone: nn.Module) -> nn.Module:
    """Undo, in place, what the strategies' ``prepare`` did to ``backbone`` (SBP's BatchNorm
    patches, per-block recompute wrappers), so that another strategy can be prepared on it."""
    for module in backbone.modules():
        while True:
            fwd = module.__dict__.get("forward")
            if isinstance(fwd, PatchedBN):
                original = fwd.orig
            elif isinstance(fwd, RecomputedForward):
                original = fwd.original
            else:
                break
            if original is None or (getattr(original, "__self__", None) is module
                                    and getattr(original, "__func__", None) is type(module).forward):
                del module.forward  # the class's forward again
            else:
                module.forward = original  # an instance-level forward someone set before us
    return backbone


def device_free_bytes(device: torch.device) -> float:
    """Memory the run could still take: CUDA free + cached-but-unallocated; CPU MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(free + cached)
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    if not m:
        raise RuntimeError("memory=auto: cannot read MemAvailable; set memory.budget_mb")
    return float(m.group(1)) * 1024


def _mb(x: float | None) -> float | None:
    return None if x is None else x / MB


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
        sampler: str = "uniform",
        seed: int = 0,
        rank: int | None = None,
    ) -> None:
        if sum(b is not None for b in (budget_mb, budget_frac, budget_gb)) > 1:
            raise ValueError("set at most one of memory.budget_gb, memory.budget_mb and memory.budget_frac")
        for key, value, what in (("budget_gb", budget_gb, " (the device's memory in GiB)"),
                                 ("budget_mb", budget_mb, ""),
                                 ("budget_frac", budget_frac, " (a fraction of e2e's estimated step peak)")):
            if value is not None and not value > 0:
                raise ValueError(f"memory.{key} must be > 0{what}, got {value}")
        if not 0 < free_frac <= 1:
            raise ValueError(f"memory.free_frac must be in (0, 1], got {free_frac}")
        if sampler not in SAMPLERS:
            raise ValueError(f"memory.sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}")
        self.budget_mb, self.budget_frac, self.free_frac = budget_mb, budget_frac, free_frac
        self.budget_gb = None if budget_gb is None else float(budget_gb)
        self.options = Options(allow_frame_dropout=bool(allow_frame_dropout),
                               allow_frozen_bn=bool(allow_frozen_bn), sampler=sampler, seed=int(seed))
        self.rank = rank
        self.backbone: nn.Module | None = None
        self.candidates: list[Candidate] = []
        self.budget: float | None = None  # bytes, on the trainer's scale
        self.budget_source = ""
        self.chosen: Candidate | None = None  # the plan decided before training
        self.active: Candidate | None = None  # the plan running now (after step-downs)
        self.inner: MemoryStrategy | None = None
        self._compiler: Any = None  # trainer.compile, for the plans swapped in
        self.reason = ""
        self.step_downs: list[dict[str, Any]] = []
        self.recheck: dict[str, Any] | None = None  # the first comparison of measured vs estimated
        self.observed_max: dict[str, float] = {}  # plan name -> largest measured step peak (MB)
        self._observed = 0
        self._estimate: Callable[[Candidate], None] | None = None  # kept for step-downs

    # ------------------------------------------------------------------ the decision
    def _usable(self, device: torch.device) -> tuple[float, str]:
        """(bytes the allocator may use, where that came from), for budget_gb and free_frac."""
        if self.budget_gb is not None:
            context = f" less {CUDA_CONTEXT_GIB:g} GiB of CUDA context" if device.type == "cuda" else ""
            return usable_bytes(self.budget_gb, device.type), f"memory.budget_gb={self.budget_gb:g}{context}"
        if device.type == "cuda":  # what the allocator can still get, and what it holds (weights)
            in_use = float(torch.cuda.memory_allocated(device))
        else:  # MemAvailable leaves out the model, already built in this process
            assert self.backbone is not None
            in_use = float(sum(t.numel() * t.element_size() for t in
                               [*self.backbone.parameters(), *self.backbone.buffers()]))
        return (self.free_frac * (device_free_bytes(device) + in_use),
                f"memory.free_frac={self.free_frac} x free {device.type} memory")

    def plan(self, estimate: Estimate, num_frames: int, device: torch.device) -> dict[str, Any]:
        """Estimate, choose and switch to the chosen plan, before anything runs on the device.
        ``estimate(memory_node)`` estimates the configured run with that ``memory:`` node on
        fake tensors for ``device``'s type. Raises :class:`NoPlanFits` when no plan fits."""
        assert self.backbone is not None, "prepare(backbone) comes first (VideoClassifier does it)"
        # SBP + recompute runs record/apply, which cannot run a backbone whose frames meet
        self.options.sbp_recompute_error = ("sbp + recompute: the backbone's temporal shift mixes "
                                            "frames" if mixes_frames(self.backbone) else None)
        has_bn = any(isinstance(m, _BatchNorm) for m in self.backbone.modules())
        self.candidates = build_candidates(num_frames, has_bn, self.options)
        base = 0.0  # what e2e holds between steps less the batch: the trainer's meter starts there

        def run(c: Candidate) -> StepMemory | None:
            try:
                mem = estimate(memory_node(c))
            except Exception as err:  # one candidate's failure must not stop the decision
                text = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
                # in this process, or reported by an estimating process as "InfeasibleBudget: ..."
                prefix = InfeasibleBudget.__name__ + ": "
                infeasible = isinstance(err, InfeasibleBudget) or text.startswith(prefix)
                c.skip = (f"{INFEASIBLE} ({text.removeprefix(prefix)})" if infeasible
                          else f"its estimate failed: {text}")
                if not infeasible:
                    log.warning("memory=auto: %s: %s", c.name, c.skip)
                return None
            c.estimated_peak = max(mem.train_peak, mem.eval_peak or 0) - base
            c.extra.update({"estimated_train_peak_gb": round(mem.train_peak / GIB, 3),
                            "estimated_eval_peak_gb": round((mem.eval_peak or 0) / GIB, 3)})
            return mem

        e2e = self.candidates[0]
        held = run(e2e)
        if held is None:
            raise ValueError(f"memory=auto: the configured run cannot be estimated ({e2e.skip})")
        base = held.held - held.batch
        e2e.estimated_peak -= base
        self.budget, self.budget_source, advice = self._budget(e2e, base, device)
        chosen = choose(self.candidates, self.budget, run, advice=advice)
        self._estimate = run
        self.chosen, self.reason = chosen, reason(chosen, self.candidates, self.budget)
        self._activate(chosen)
        log.info("memory=auto decision (%s):\n%s\nchosen: %s", self.budget_source,
                 render_table(self.candidates, self.budget, chosen), self.reason)
        return self.plan_report()

    def _budget(self, e2e: Candidate, base: float, device: torch.device
                ) -> tuple[float, str, Callable[[float], str]]:
        """(budget bytes on the trainer's scale, where it came from, the advice for a need)."""
        if self.budget_mb is not None:
            return (float(self.budget_mb) * MB, f"memory.budget_mb={self.budget_mb:g}",
                    lambda need: f"set memory.budget_mb={round_up(need / MB):.1f} or more")
        if self.budget_frac is not None:
            assert e2e.need is not None
            return (self.budget_frac * e2e.need,
                    f"memory.budget_frac={self.budget_frac:g} x e2e's estimated step peak "
                    f"{e2e.need / MB:.1f} MB (its estimate + {UNSEEN_FRAC:.0%})",
                    lambda need: f"set memory.budget_frac={round_up(need / e2e.need, 2):.2f} or more")
        usable, source = self._usable(device)
        # fits when (step + base) x (1 + UNSEEN_FRAC) <= usable, as plan --fit decides
        budget = usable - base * (1 + UNSEEN_FRAC)
        context_gb = (self.budget_gb - usable / GIB) if self.budget_gb is not None else 0.0
        source += (f": {usable / GIB:.2f} GiB for the allocator, less {base * (1 + UNSEEN_FRAC) / GIB:.2f} "
                   f"GiB held between steps (weights, gradients, optimizer state, + {UNSEEN_FRAC:.0%})")
        return budget, source, lambda need: (
            f"set memory.budget_gb={round_up((need + base * (1 + UNSEEN_FRAC)) / GIB + context_gb):.1f} or more")

    def _activate(self, c: Candidate) -> None:
        strategy = build_strategy(c, self.rank)
        if self.backbone is not None:
            strategy.prepare(unprepare(self.backbone))
            if self._compiler is not None:  # trainer.compile: a step-down compiles its plan once
                compile_strategy(strategy, self.backbone, self._compiler)
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
            raise RuntimeError("memory=auto has no plan yet: call AutoStrategy.plan(...) before "
                               "training (videotrain.config.build.plan_memory does)")
        return self.inner.encode(backbone, video)

    def compile(self, backbone: nn.Module, compiler: Any) -> None:
        """``trainer.compile``: the active plan compiles what it runs, and so does each plan a
        step-down swaps in (``videotrain.memory.compiled``)."""
        self._compiler = compiler
        if self.inner is not None:
            compile_strategy(self.inner, backbone, compiler)

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
        need = active.need or 0.0
        if self.recheck is None:
            self.recheck = {"step": step, "plan": active.name, "measured_peak_mb": peak_mb,
                            "estimated_peak_mb": _mb(active.estimated_peak), "need_mb": _mb(active.need),
                            "budget_mb": self.budget / MB}
            log.info("memory=auto re-check at step %d: %s measured %.1f MB in training; estimated "
                     "%.1f MB (%.1f with headroom); budget %.1f MB", step, active.name, peak_mb,
                     (active.estimated_peak or 0) / MB, need / MB, self.budget / MB)
        if peak <= self.budget * (1 + RECHECK_TOLERANCE):
            return
        shift = max(peak - need, 0.0)
        nxt = self._next_estimated(shift) or self.next_plan(shift)
        record = {"step": step, "from": active.name, "measured_peak_mb": peak_mb,
                  "estimated_peak_mb": _mb(active.estimated_peak), "need_mb": need / MB,
                  "budget_mb": self.budget / MB, "to": nxt.name if nxt else None,
                  "to_need_mb": _mb(nxt.need) if nxt else None}
        self.step_downs.append(record)
        if nxt is None:
            log.warning("memory=auto: step %d measured %.1f MB > budget %.1f MB with %s, and no plan "
                        "with a smaller peak is left; continuing over budget", step, peak_mb,
                        self.budget / MB, active.name)
            return
        log.warning("memory=auto: step %d measured %.1f MB > budget %.1f MB (%.1f MB with headroom for %s); "
                    "stepping down to %s (%.1f MB with headroom)", step, peak_mb, self.budget / MB,
                    need / MB, active.name, nxt.name, nxt.need / MB)
        self._activate(nxt)

    def _next_estimated(self, shift: float) -> Candidate | None:
        """The walk again over the plans ranked after the active one, estimating those it
        reaches, for the budget less the active plan's misestimate ``shift``."""
        assert self.active is not None and self.budget is not None
        if self._estimate is None:  # resumed without a decision of its own
            return None
        order = ranked(self.candidates)
        rest = order[order.index(self.active) + 1:] if self.active in order else order
        for c in rest:
            if c.note.startswith("not needed"):
                c.note = ""
        log.info("memory=auto: estimating the plans after %s for %.1f MB (the budget less its "
                 "misestimate)", self.active.name, (self.budget - shift) / MB)
        try:
            return choose(rest, self.budget - shift, self._estimate)
        except NoPlanFits:
            return None

    def next_plan(self, shift: float = 0.0) -> Candidate | None:
        """The next plan in the ranking with a smaller known need that fits the budget when
        raised by ``shift``; failing that, the one with the smallest known need below the
        active plan's."""
        assert self.active is not None and self.budget is not None
        order = ranked(self.candidates)
        start = order.index(self.active) + 1 if self.active in order else 0
        current = self.active.need if self.active.need is not None else float("inf")
        smaller = [c for c in order[start:] if not c.skip and c.need is not None and c.need < current]
        for c in smaller:
            if c.need + shift <= self.budget:
                return c
        return min(smaller, key=lambda c: c.need, default=None)

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
        c = {c.name: c for c in self.candidates}.get(state["active"])
        if c is None:  # the candidates differ: rebuild the saved plan as it was
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
            "chosen": self.chosen.name,
            "reason": self.reason,
            "active": self.active.name if self.active else None,
            "estimated_peak_mb": _mb(self.chosen.estimated_peak),
            "need_mb": _mb(self.chosen.need),
            "candidates": [c.to_dict() for c in ranked(self.candidates)],
            "table": render_table(self.candidates, self.budget, self.chosen),
            "recheck": self.recheck,
            "observed_peak_mb": dict(self.observed_max),
            "step_downs": list(self.step_downs),
        }
