"""Does SBP under bf16 autocast give every trainable parameter a gradient, as fp32 does?

One training step (forward, cross-entropy, backward) of the same model, built from the same
config and seed, once in fp32 and once under ``torch.autocast(bf16)`` (the trainer's
``trainer.precision=bf16`` context, on CUDA when there is one, else CPU). For each case it counts
the trainable parameters whose ``.grad`` is None after the step; a case passes when both counts
are 0. Autocast's weight-cast cache on old torch made SBP's kept frames reuse casts made under
``no_grad``, leaving such parameters without a gradient, silently (docs/cluster.md, "SBP and
mixed precision").

    python scripts/check_sbp_autocast_grads.py            # every case below; exit 1 if one fails
    python scripts/check_sbp_autocast_grads.py vit-frame  # one case

scripts/build_image.sh runs it inside the image; tests/scripts/test_check_sbp_autocast_grads.py
runs it in the test suite.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from videotrain.config.build import build_model, compose_cfg

_TIMM_VIT = ["model/backbone=timm", "model.backbone.name=vit_tiny_patch16_224",
             "+model.backbone.kwargs={depth: 2, embed_dim: 32, num_heads: 2}"]
_TIMM_CONVNEXT = ["model/backbone=timm", "model.backbone.name=convnext_atto"]
# name -> config overrides (on top of memory=sbp); tiny models, 32 px frames
CASES: dict[str, list[str]] = {
    "vit-frame": ["model/backbone=vit_tiny"],
    "timm_vit-frame": _TIMM_VIT,
    "timm_convnext-frame": _TIMM_CONVNEXT,
    "resnet10-frame": ["model/backbone=resnet10"],  # with its temporal shift: the lockstep code
}
B, T, PX, K = 2, 8, 32, 4


def missing_grads(overrides: list[str], dtype: torch.dtype | None) -> tuple[int, int]:
    """(trainable parameters without a ``.grad`` after one step, trainable parameters);
    ``dtype`` None: fp32, else autocast to it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = compose_cfg(["memory=sbp", f"data.crop_size={PX}", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg, num_classes=K, init=False).to(device).train()
    g = torch.Generator().manual_seed(0)
    video = torch.randn(B, T, 3, PX, PX, generator=g).to(device)  # (B, T, C, H, W)
    labels = torch.arange(B, device=device) % K
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        logits = model(video)  # (B, K)
    nn.functional.cross_entropy(logits.float(), labels).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.grad is None for p in params), len(params)


def main(names: list[str]) -> int:
    failed = 0
    print(f"torch {torch.__version__}; SBP, one step; trainable parameters without a gradient:")
    for name in names or list(CASES):
        fp32, total = missing_grads(CASES[name], None)
        bf16, _ = missing_grads(CASES[name], torch.bfloat16)
        ok = fp32 == 0 and bf16 == 0
        failed += not ok
        print(f"  {name:<20} fp32 {fp32}/{total}  bf16 {bf16}/{total}  {'ok' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
