"""What a benchmark row does to the built model besides its memory strategy (bench/child.py):
the min-cut torch.compile peer, torch's ``sac_milp`` plan, ``memory=auto``'s planning, and
``trainer.compile`` as the trainer applies it."""

from __future__ import annotations

from typing import Any

import torch


def prepare_row(model: torch.nn.Module, cfg: Any, spec: dict[str, Any], device: torch.device,
                precision: Any) -> dict[str, Any]:
    """Apply the row's extras to ``model`` in place and return the figures to report.

    ``compile_budget``: torch.compile the backbone, min-cut partitioner at that activation
    budget; ``sac_milp``: torch's plan at that budget fraction (bench/sac_peer.py);
    ``memory=auto``: plan before the first step, as training does
    (``videotrain.config.build.plan_memory``; a no-op for other strategies); then
    ``trainer.compile`` (``videotrain.memory.compiled``), on the plan chosen."""
    if spec.get("compile_budget") is not None:  # the torch.compile peer: min-cut recompute
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = float(spec["compile_budget"])
    if spec.get("compile_budget") is not None:
        model.backbone = torch.compile(model.backbone)
    if spec.get("sac_milp") is not None:
        from hydra.utils import instantiate

        from videotrain.bench.sac_peer import apply_sac_milp

        shape = (spec["batch_size"] * spec["frames"], 3, spec["size"], spec["size"])
        return apply_sac_milp(model.backbone, lambda: instantiate(cfg.model.backbone), shape,
                              device, spec["sac_milp"], precision.autocast,
                              bool(spec.get("free_grads", False)))
    from videotrain.config.build import plan_memory
    from videotrain.config.estimate import ConfigEstimator
    from videotrain.memory.compiled import Compiler, compile_model, wants_compile

    plan = plan_memory(cfg, model, device, spec["num_classes"], ConfigEstimator)  # memory=auto only
    if wants_compile(cfg.trainer.compile, device.type):
        compile_model(model, Compiler(cfg.trainer.compile_mode))
    return {"auto_plan": {k: plan.get(k) for k in (
        "budget_mb", "chosen", "reason", "estimated_peak_mb", "need_mb")}} if plan else {}
