"""Frame SBP's gradients under CPU autocast (bf16, fp16): as close to the exact masked reference as
that reference computed in the same precision; on CUDA too (``device``: the gpu-marked twin).

The reference is e2e with the dropped frames' activations held constant (their rows detached at
every BN input, every temporal-shift input and at the backbone's output), computed by plain
autograd; in fp32 SBP equals it to rounding (``test_sbp.py``, ``test_sbp_temporal_shift.py``).
Under autocast the two round differently (kept and dropped frames run as separate batches, the
BN rows are reduced in another order), and on these tiny BN models rounding moves gradients by
percents, so the check is relative: SBP in low precision is no further from the exact (fp32)
gradient than the reference in low precision is, up to 25%. Where nothing couples the frames
(frozen BN, LayerNorm) SBP and the reference run the same kernels on the kept rows: equal."""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
from torch import nn

from videotrain.memory import StochasticBackprop
from videotrain.memory.sampling import keep_mask
from videotrain.models.backbones import resnet
from videotrain.models.temporal_shift import TemporalShift
from videotrain.models.video import VideoClassifier

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _pair(kit, backbone: str, strategy: StochasticBackprop,
          device: torch.device) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    bb = resnet(layers=[1, 1, 1, 1], temporal_shift=0.25) if backbone == "resnet_shift" else kit.BACKBONES[backbone]()
    head = kit.make_head(bb.feature_dim, "mean")  # a BN head's gradient is ill-conditioned here
    ref = VideoClassifier(copy.deepcopy(bb), copy.deepcopy(head))
    return ref.to(device).train(), VideoClassifier(bb, head, strategy).to(device).train()


def _exact_fp32(device: torch.device) -> AbstractContextManager:
    """fp32 as fp32: no TF32 convolutions or matmuls on CUDA."""
    if device.type != "cuda":
        return nullcontext()
    return torch.backends.cudnn.flags(enabled=True, allow_tf32=False)


def _grads(kit, backbone: str, policy: str, dtype: torch.dtype | None,
           x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(SBP's, the masked reference's) gradients of all parameters, flattened, in fp32."""
    strategy = StochasticBackprop(keep_ratio=0.5, bn_policy=policy, seed=0, rank=0)
    ref, model = _pair(kit, backbone, strategy, x.device)
    labels = kit.labels()[: x.shape[0]].to(x.device)
    with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        nn.functional.cross_entropy(model(x).float(), labels).backward()
        rows = keep_mask(strategy.last_keep, x.shape[1]).flatten()  # (N,)

        def detach_dropped(_m: nn.Module, args: tuple) -> tuple:
            return (kit.row_detach(args[0], rows),)

        for m in ref.backbone.modules():
            is_bn = isinstance(m, nn.modules.batchnorm._BatchNorm)
            if isinstance(m, TemporalShift) or (is_bn and policy == "full_batch"):
                m.register_forward_pre_hook(detach_dropped)
            if is_bn and policy == "frozen":
                m.eval()
        ref.backbone.register_forward_hook(lambda _m, _a, out: kit.row_detach(out, rows))
        nn.functional.cross_entropy(ref(x).float(), labels).backward()
    return tuple(torch.cat([p.grad.flatten().float() for p in m.parameters()]) for m in (model, ref))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("backbone", "policy"), [
    ("resnet", "full_batch"), ("resnet", "frozen"), ("resnet_shift", "full_batch"),
    ("resnet_shift", "frozen"), ("vit", "full_batch"),
])
def test_autocast_gradients_are_as_exact_as_the_reference(kit, device: torch.device, backbone: str,
                                                          policy: str, dtype: str) -> None:
    x = kit.video() if backbone == "vit" or device.type == "cuda" else kit.video()[:1]  # slow CPU bf16
    x = x.to(device)
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with _exact_fp32(device):
            exact, ref_exact = _grads(kit, backbone, policy, None, x)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    torch.testing.assert_close(exact, ref_exact, rtol=1e-4, atol=1e-6)  # fp32: the spec
    low, ref_low = _grads(kit, backbone, policy, DTYPES[dtype], x)
    assert torch.isfinite(low).all()
    if device.type == "cpu" and (policy == "frozen" or backbone == "vit"):
        # the same kernels on the kept rows (cuDNN may pick its algorithm by batch size)
        torch.testing.assert_close(low, ref_low, rtol=1e-3, atol=1e-5)
    ours, theirs = _rel(low, exact), _rel(ref_low, ref_exact)
    assert ours <= 1.25 * theirs + 1e-3, (ours, theirs)
