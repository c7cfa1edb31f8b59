"""What a benchmark row does to the built model besides its memory strategy (bench/child.py):
the min-cut torch.compile peer, ``memory=auto``'s planning, and ``trainer.compile`` as the
trainer applies it. A ``peer`` row is a suite's beside the package, which prepares it in its
own child (``benchmarks/sac_milp.py``)."""

from __future__ import annotations

from typing import Any

import torch


def prepare_row(model: torch.nn.Module, cfg: Any, spec: dict[str, Any], device: torch.device,
                precision: Any) -> dict[str, Any]:
    """Apply the row's extras to ``model`` in place and return the figures to report.

    ``compile_budget``: torch.compile the backbone, min-cut partitioner at that activation
    budget; ``memory=auto``: plan before the first step, as training does
    (``videotrain.config.build.plan_memory``; a no-op for other strategies); then
    ``trainer.compile`` (``videotrain.memory.compiled``), on the plan chosen. A ``peer`` row
    raises ``ValueError``: only its own suite's child applies the peer."""
    if spec.get("peer") is not None:
        raise ValueError(f"this row's peer ({spec['peer']!r}) is applied by its own suite's child "
                         "(benchmarks/), not by python -m videotrain.bench")
    if spec.get("compile_budget") is not None:  # the torch.compile peer: min-cut recompute
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = float(spec["compile_budget"])
    if spec.get("compile_budget") is not None:
        model.backbone = torch.compile(model.backbone)
    from videotrain.config.build import plan_memory
    from videotrain.config.estimate import ConfigEstimator
    from videotrain.memory.compiled import Compiler, compile_model, wants_compile

    plan = plan_memory(cfg, model, device, spec["num_classes"], ConfigEstimator)  # memory=auto only
    if wants_compile(cfg.trainer.compile, device.type):
        compile_model(model, Compiler(cfg.trainer.compile_mode))
    return {"auto_plan": {k: plan.get(k) for k in (
        "budget_mb", "chosen", "reason", "estimated_peak_mb", "need_mb")}} if plan else {}
