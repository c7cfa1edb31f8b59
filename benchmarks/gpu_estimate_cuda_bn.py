"""``gpu_estimate`` (``../shared/tools/gpu_estimate``) with SBP's CUDA kept-rows BN backward.

The estimate traces a step on fake CPU tensors, so SBP's kept-rows BN backward
(``memory.sbp.kept_rows``) takes its CPU form there: ATen's BN backward with weight ``rho * w``
plus one ``addcmul_`` per BN. On CUDA it runs ``batch_norm_backward_reduce`` (reads ``g``, ``x``)
and ``batch_norm_backward_elemt`` (reads ``g``, ``x``, writes ``dx``), which have no CPU or fake
kernels. Here the CPU form's BN backward stands in for that pair and the ``addcmul_`` is left
out: the tool prices a channels_last ``native_batch_norm_backward`` as exactly those two kernels
(its ``bn_bwd_reduce`` and ``bn_bwd_elemt`` classes), with the same bytes. Values are wrong
(fake tensors have none); shapes, kernels and bytes are the ones CUDA runs. Kernel time, bytes
and kernel counts only: ``--host`` is refused (the host proxy runs real CPU code).

    python -m benchmarks.gpu_estimate_cuda_bn ../shared/tools/gpu_estimate --rows resnet50/sbp-frame-0.5
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from videotrain.memory.sbp import kept_rows


def cuda_kernels_bn_backward(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                             rstd: torch.Tensor, coefs: kept_rows.BatchNormCoefficients, index: int,
                             eps: float, mask: list[bool]) -> kept_rows.BNGrads:
    """What ``fused_bn_backward`` dispatches on CUDA, as the estimate prices it: one BN
    backward over the kept rows (the reduce and the elementwise kernel)."""
    w_rho, _ = coefs[index]
    return tuple(torch.ops.aten.native_batch_norm_backward(
        grad, x, w_rho, None, None, mean, rstd, True, eps, mask))


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: python -m benchmarks.gpu_estimate_cuda_bn TOOL_DIR [estimate_step options]",
              file=sys.stderr)
        return 2
    tool, args = Path(argv[0]), argv[1:]
    if "--host" in args:
        print("error: --host runs real CPU code; run the tool itself for host figures", file=sys.stderr)
        return 2
    if not (tool / "estimate_step.py").is_file():
        print(f"error: {tool} holds no estimate_step.py", file=sys.stderr)
        return 2
    sys.path.insert(0, str(tool.resolve()))
    import estimate_step  # the tool's entry point

    kept_rows.split_bn_backward = cuda_kernels_bn_backward  # read by KeptRowsBatchNorm.backward
    return estimate_step.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
