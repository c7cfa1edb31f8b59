"""Under autocast every strategy gives every trainable parameter a gradient, as in fp32.

A parameter that silently gets no gradient under mixed precision trains not at all, and nothing
else in a run says so. It happened to SBP on torch releases without PyTorch's autocast-cache fix
(docs/cluster.md, "SBP and mixed precision"): a weight cast cached under ``no_grad`` (the dropped
frames) was reused by the kept frames' forward. This test runs one training step per strategy and backbone family in fp32
and under bf16 and fp16 CPU autocast, and compares which parameters received a gradient; the
floor job of ``.ci/run`` runs it on the oldest torch that pyproject accepts, and ``pytest -m gpu``
runs its CUDA twin (CUDA autocast) on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from videotrain.memory import EndToEnd, FrameDropout, Recompute, StochasticBackprop

# name -> the strategy, from the memory tests' kit (kit.RecordApply: SBP on record/apply)
STRATEGIES = {
    "e2e": lambda kit: EndToEnd(),
    "frame_dropout": lambda kit: FrameDropout(keep_ratio=0.5),
    "sbp_frame": lambda kit: StochasticBackprop(keep_ratio=0.5, sampler="uniform"),
    "sbp_frame_frozen_bn": lambda kit: StochasticBackprop(keep_ratio=0.5, bn_policy="frozen"),
    "sbp_frame_record": lambda kit: kit.RecordApply(keep_ratio=0.5),
    "sbp_recompute": lambda kit: StochasticBackprop(keep_ratio=0.5, recompute="blocks"),
    "recompute_blocks": lambda kit: Recompute("blocks"),
    "recompute_sqrt": lambda kit: Recompute("sqrt"),
    "recompute_optimal": lambda kit: Recompute("optimal", objective="memory"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FP32: dict[tuple[str, str, str], set[str]] = {}  # (backbone, strategy, device) -> fp32's set


def _params_with_grad(kit, backbone: str, strategy: str, dtype: torch.dtype | None,
                      device: torch.device) -> set[str]:
    """One cross-entropy step of a fresh model; the names of the parameters given a gradient."""
    _, model = kit.model_pair(backbone, STRATEGIES[strategy](kit), head="mean")
    model.to(device)
    x = kit.video()[:1, :4].to(device)  # (1, 4, C, H, W): bf16 convolutions are slow on some CPUs
    ctx = torch.autocast(device.type, dtype=dtype) if dtype is not None else torch.autocast(
        device.type, enabled=False)
    with ctx:
        logits = model(x)
    assert logits.dtype == (dtype or torch.float32)
    nn.functional.cross_entropy(logits.float(), kit.labels()[:1].to(device)).backward()
    return {n for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", ["resnet", "vit", "timm_resnet", "timm_convnext", "timm_vit"])
def test_autocast_gives_every_parameter_its_gradient(kit, backbone: str, strategy: str,
                                                     dtype: str, device: torch.device) -> None:
    _, model = kit.model_pair(backbone, EndToEnd(), head="mean")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    key = (backbone, strategy, device.type)
    if key not in _FP32:
        _FP32[key] = _params_with_grad(kit, backbone, strategy, None, device)
    fp32 = _FP32[key]
    assert fp32 == trainable, sorted(trainable - fp32)
    mixed = _params_with_grad(kit, backbone, strategy, DTYPES[dtype], device)
    missing = sorted(fp32 - mixed)
    assert not missing, f"{len(missing)} of {len(fp32)} parameters got no gradient: {missing[:6]}"


def test_sbp_runs_with_the_autocast_cache_and_folds_linears(kit, device: torch.device) -> None:
    """SBP's kept and dropped forwards run in the caller's autocast, cache on as in e2e (since
    PyTorch's fix, a cast cached under ``no_grad`` keeps its history: the test above). With the
    cache off, a weight cast under ``no_grad`` did not require grad, so ``matmul`` ran
    ``nn.MultiheadAttention``'s transposed in-projection input as ``bmm`` over a stride-0
    expanded weight (copied out on a CPU) instead of one ``mm``: a ViT's SBP step dispatches no
    ``bmm`` that e2e's does not."""
    from videotrain.metrics.dispatch import aten_ops

    seen: list[tuple[bool, bool]] = []
    _, model = kit.model_pair("vit", StochasticBackprop(keep_ratio=0.5), head="mean")
    first_layer = next(m for m in model.to(device).backbone.modules() if isinstance(m, torch.nn.Conv2d))
    first_layer.register_forward_hook(  # a layer: lockstep SBP runs the backbone's code, not its module
        lambda *_: seen.append((torch.is_grad_enabled(), torch.is_autocast_cache_enabled())))
    counts = {}
    for name, strategy in (("sbp", None), ("e2e", EndToEnd())):
        if strategy is not None:
            _, model = kit.model_pair("vit", strategy, head="mean")
            model.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16), aten_ops() as ops:
            model(kit.video()[:1, :4].to(device))
        counts[name] = ops
    assert {grad for grad, _ in seen} == {True, False}  # kept and dropped frames both ran
    assert all(cache for _, cache in seen), seen
    assert counts["sbp"].get("aten.bmm", 0) == counts["e2e"].get("aten.bmm", 0) == 0
    assert counts["sbp"].get("aten.mm", 0) + counts["sbp"].get("aten.addmm", 0) > 0
