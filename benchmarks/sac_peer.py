"""torch's own budget planner for activation checkpointing, as a bench peer (the rows of
``python -m benchmarks.sac_milp``).

As in torch's test_sac_ilp.py, under ``FakeTensorMode``, torch's estimators (``MemTracker``,
``RuntimeEstimator``, ``SACEstimator``) feed ``torch.distributed._tools.sac_ilp.sac_milp``, which
picks the modules to checkpoint and the fraction of each one's activation memory to discard, at
the least estimated recompute time. The budget is ``frac`` x the e2e activation peak its
estimators report, plus the parameters and gradients it also counts, so ``frac`` means what it
means for ``memory.policy=optimal``. Each chosen module then runs under non-reentrant
``torch.utils.checkpoint`` with the selective policy torch derives. Needs ``pulp`` and ``pwlf``.

It runs on this project's ResNets and without CUDA only through a few adaptations (a module
called twice per forward, the roofline on CPU, ops with no cost, saved tensors mutated in place);
each, and why gradients stay e2e's: ``docs/design/internals.md``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn

GIB = 2**30
MIB = 2**20
CPU_GPU_TYPE = "NVIDIA H100"  # datasheet for the roofline runtime estimate on a CPU


class SacMilpFailed(RuntimeError):
    """The planner gave no plan: infeasible budget, or its pipeline failed on this model."""


def _runtime_mode(device: torch.device) -> tuple[str, str | None, contextlib.AbstractContextManager]:
    """(estimate mode, datasheet GPU, context) for torch's runtime estimators on ``device``."""
    if device.type == "cuda":
        return "operator-level-cost-model", None, contextlib.nullcontext()
    return ("operator-level-cost-model", CPU_GPU_TYPE,
            mock.patch("torch.accelerator.is_available", return_value=True))


def _first_calls(module_info: dict[str, Any], root: nn.Module) -> None:
    """Reduce the call orders to each module's first call, in place (see the module docstring);
    raise ``SacMilpFailed`` for a reused module that has parameters or children."""
    order = module_info["mod_order"]
    repeated = [fqn for fqn, n in Counter(order["fw_pre_order"]).items() if n > 1]
    for fqn in repeated:
        mod = root.get_submodule(fqn.split(".", 1)[1]) if "." in fqn else root
        if any(True for _ in mod.children()) or any(True for _ in mod.parameters()):
            raise SacMilpFailed(f"{fqn} runs {Counter(order['fw_pre_order'])[fqn]} times per "
                                "forward; sac_milp's module tree needs one call per module")
    for key in order:
        order[key] = list(dict.fromkeys(order[key]))


def _collect(make_backbone: Callable[[], nn.Module], frames_shape: tuple[int, ...],
             device: torch.device, autocast: Callable[[], contextlib.AbstractContextManager],
             free_grads: bool) -> tuple[Any, Any]:
    """Run torch's three estimators on a fake copy of the backbone (as torch's test does);
    returns (the module graph ``sac_milp`` takes, the SAC estimator with per-module stats)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    mode, gpu_type, patch = _runtime_mode(device)
    with FakeTensorMode(), torch.device(device), patch:
        model = make_backbone().train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        frames = torch.randn(frames_shape)

        def forward_backward() -> None:
            with autocast():
                loss = model(frames).float().sum()
            loss.backward()

        def update() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=free_grads)

        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            forward_backward()  # the first step allocates the optimizer state
            update()
            tracker.reset_mod_stats()
            forward_backward()
            last = tracker.get_tracker_snapshot("current")
            update()
        for stats in tracker.memory_tracking.values():  # as torch's test: modules whose inputs
            if _ModState.POST_BW not in stats.snapshots:  # need no grad miss their post-bw hook
                stats.snapshots.setdefault(_ModState.POST_BW, []).append(copy.deepcopy(last))
        runtime = RuntimeEstimator(gpu_type=gpu_type)
        with runtime(estimate_mode_type=mode):
            forward_backward()
            update()
        sac = SACEstimator(gpu_type=gpu_type)
        with sac(estimate_mode_type=mode), autocast():
            loss = model(frames).float().sum()
        loss.backward()
        info = aggregate_stats(model, tracker, runtime, sac, torch.device(device))
    _first_calls(info, model)
    return parse_module_info(info), sac


class _SolverLog(logging.Handler):
    """Collects what ``sac_milp`` logs when the solver fails (it returns no status)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _solve(graph: Any, offset: float, act_peak: float,
           frac: float) -> tuple[dict[str, float], float, int, str]:
    """``sac_milp`` at ``offset + frac * act_peak`` bytes: (decisions, recompute ms, peak
    bytes, -1 if no solution; the solver's failure message, or "")."""
    from torch.distributed._tools import sac_ilp

    handler = _SolverLog()
    sac_ilp.logger.addHandler(handler)
    try:
        decisions, recompute_ms, peak = sac_ilp.sac_milp(
            graph, memory_budget=(offset + frac * act_peak) / GIB)
    finally:
        sac_ilp.logger.removeHandler(handler)
    return decisions, recompute_ms, peak, "; ".join(handler.messages)


def smallest_feasible_frac(graph: Any, offset: float, act_peak: float, infeasible: float = 0.0,
                           steps: int = 8) -> float | None:
    """The smallest budget fraction the MILP solves, by bisection above ``infeasible`` (a
    fraction it does not solve) to within ``(1 - infeasible) / 2**steps``; None if not even 1."""
    lo, hi = infeasible, 1.0
    if _solve(graph, offset, act_peak, hi)[2] < 0:
        return None
    for _ in range(steps):
        mid = (lo + hi) / 2
        if _solve(graph, offset, act_peak, mid)[2] >= 0:
            hi = mid
        else:
            lo = mid
    return hi


class OpPolicy:
    """A selective-checkpoint policy from a per-op save list (1 = save), in the order the
    SAC estimator recorded the module's ops (it leaves out ``OPS_TO_ALWAYS_SKIP``)."""

    def __init__(self, save: list[int]) -> None:
        self.save, self.seen = save, 0

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP
        from torch.utils.checkpoint import CheckpointPolicy

        if func in OPS_TO_ALWAYS_SKIP:
            return CheckpointPolicy.PREFER_RECOMPUTE
        i, self.seen = self.seen, self.seen + 1
        keep = i < len(self.save) and self.save[i] == 1
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def op_plan(stats: Any, keep_frac: float) -> list[int]:
    """torch's per-module MILP: which ops of a checkpointed module to save (1) when it keeps
    ``keep_frac`` of its activation memory; zero-cost ops made visible to it (see above)."""
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    runtimes = [t if t or m else 1e-9 for t, m in zip(stats.runtimes, stats.memory, strict=True)]
    forced = sum(stats.memory[op] for op, parent in stats.inplace_ops if op == parent)
    floor = forced / max(sum(stats.memory), 1)
    save = get_optimal_checkpointing_policy_per_module(
        dataclasses.replace(stats, runtimes=runtimes), min(max(keep_frac, floor), 1.0))
    if not save:
        raise SacMilpFailed("get_optimal_checkpointing_policy_per_module found no solution")
    return save


def checkpoint_module(module: nn.Module, save: list[int], name: str) -> None:
    """Run ``module`` under non-reentrant checkpointing with ``OpPolicy(save)``; a forward
    whose op count differs from the plan's raises (the plan would be misapplied). The tensors
    the policy saves pass through saved-tensors hooks, so the bench's saved-activation counter
    (``videotrain.metrics.saved``) sees them."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    forward = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        policy = OpPolicy(save)
        out = checkpoint(forward, *args, use_reentrant=False, respect_saved_tensors_hooks=True,
                         context_fn=lambda: create_selective_checkpoint_contexts(
                             policy, allow_cache_entry_mutation=True), **kwargs)
        if torch.is_grad_enabled() and policy.seen != len(save):
            raise SacMilpFailed(f"{name}: the plan covers {len(save)} ops, the forward ran "
                                f"{policy.seen}")
        return out

    module.forward = run


def _modules(root: nn.Module, fqns: dict[str, float]) -> Iterator[tuple[str, nn.Module]]:
    for fqn in fqns:
        yield fqn, root.get_submodule(fqn.split(".", 1)[1]) if "." in fqn else root


def apply_sac_milp(backbone: nn.Module, make_backbone: Callable[[], nn.Module],
                   frames_shape: tuple[int, ...], device: torch.device, frac: float | str,
                   autocast: Callable[[], contextlib.AbstractContextManager],
                   free_grads: bool = False) -> dict[str, Any]:
    """Plan ``backbone`` (built again, fake, by ``make_backbone``) for ``frames_shape`` at
    ``frac`` of the estimated e2e activation peak (``"min"``: the smallest fraction the MILP
    solves), checkpoint the chosen modules of ``backbone`` in place, and return the plan's
    figures. Raises ``SacMilpFailed`` when the MILP finds no plan, naming the solver's status
    and the smallest fraction it solves."""
    graph, sac = _collect(make_backbone, frames_shape, device, autocast, free_grads)
    nodes = graph.nodes
    offset = max(nodes[0]["param_per_module"] + n["grad_total"] for n in nodes)
    act_peak = max(n["act_total"] + n["act_grad_per_module"] for n in nodes)
    smallest = smallest_feasible_frac(graph, offset, act_peak) if frac == "min" else None
    if frac == "min" and smallest is None:
        raise SacMilpFailed("sac_milp solves no budget up to the whole e2e activation estimate")
    value = smallest if frac == "min" else float(frac)
    decisions, recompute_ms, peak, failure = _solve(graph, offset, act_peak, value)
    budget_mb = (offset + value * act_peak) / MIB
    if peak < 0:
        smallest = smallest_feasible_frac(graph, offset, act_peak, value)
        raise SacMilpFailed(
            f"sac_milp found no plan at {value:g} x its e2e activation estimate "
            f"({value * act_peak / MIB:.1f} of {act_peak / MIB:.1f} MiB; budget {budget_mb:.1f} "
            f"MiB with parameters and gradients): {failure or 'no solution'}; smallest "
            + (f"fraction it solves {smallest:.3f}" if smallest else "fraction: none up to 1"))
    for fqn, module in _modules(backbone, decisions):
        checkpoint_module(module, op_plan(sac.sac_mod_stats[fqn], 1.0 - decisions[fqn]), fqn)
    mode, gpu_type, _ = _runtime_mode(device)
    figures = {
        "budget_frac": value, "budget_mb": budget_mb,
        "estimated_e2e_act_mb": act_peak / MIB,
        "params_and_grads_mb": offset / MIB,
        "estimated_act_peak_mb": (peak - offset) / MIB,
        "estimated_recompute_ms": recompute_ms,
        "runtime_estimate": mode + (f" on a {gpu_type} datasheet" if gpu_type else ""),
        "modules": {fqn.split(".", 1)[1] if "." in fqn else fqn: r
                    for fqn, r in decisions.items()},
        "module_count": len(nodes),
    }
    return {"sac_milp_plan": figures, **({"min_budget_frac": value} if frac == "min" else {})}
