"""``gpu_estimate`` (``../shared/tools/gpu_estimate``) with SBP's CUDA kept-rows BN backward.

The estimate traces a step on fake CPU tensors, so SBP's kept-rows BN backward
(``memory.sbp.kept_rows``) takes its CPU form there: ATen's BN backward with weight ``rho * w``
plus one ``addcmul_`` per BN. On CUDA it runs ``batch_norm_backward_reduce`` (reads ``g``, ``x``)
and ``batch_norm_backward_elemt`` (reads ``g``, ``x``, writes ``dx``), which have no CPU or fake
kernels. Here the CPU form's BN backward stands in for that pair and the ``addcmul_`` is left
out: the tool prices a channels_last ``native_batch_norm_backward`` as exactly those two kernels
(its ``bn_bwd_reduce`` and ``bn_bwd_elemt`` classes), with the same bytes. Values are wrong
(fake tensors have none); shapes, kernels and bytes are the ones CUDA runs. Kernel time, bytes
and kernel counts only, printed: ``--host`` (the host proxy runs real CPU code) and ``--json``
are refused.

The tool is code from outside this checkout: it runs only if each of its files matches the
digest below (the version this was written against), and from a private copy of those bytes,
so nothing else in ``TOOL_DIR`` (another module, a ``__pycache__``) can be imported.

    python -m benchmarks.gpu_estimate_cuda_bn ../shared/tools/gpu_estimate --rows resnet50/sbp-frame-0.5
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from videotrain.memory.sbp import kept_rows
from videotrain.untrusted import shown
from videotrain.untrusted.files import read_bytes, write_bytes

DIGESTS = {  # sha256 of the gpu_estimate files this runs (../shared/tools/gpu_estimate, 2026-12-02)
    "estimate_step.py": "6d0ddb8b5f07c88ae31218f60d65d6461f4cf51180755a814a9cf955ed52419c",
    "host_proxy.py": "6a196b17c9d8cf77d511f5be6172a3dffda7073b4c62723620f05763749a96e1",
    "roofline.py": "3bc178bedca32d01ee532f6f8221a2475a8ba216f8cd99324e601b7a2f24ab81",
    "rows.py": "d857ef7102b3e4bb05721f2c3331b392d3f48fa37f7f282cb58983d85126ba42",
    "step_trace.py": "991691ef77c2df39317a24e3f289f9b81b80c81a467ba57cd2f7da7487731f44",
    "vt.py": "fec8cf77b72a04889281ae9c8cd9f39f36ae00201b52055d6b58a69219d2599c",
    "calibration.json": "9285a8755e149ee9052d087fc4d98d4e441ec38adc62e3a9c69c95b49e4e71a6",
}


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
        print("error: name the tool's folder first: python -m benchmarks.gpu_estimate_cuda_bn "
              "TOOL_DIR [estimate_step options]", file=sys.stderr)
        return 2
    tool, args = Path(argv[0]), argv[1:]
    refused = {"--host": "runs real CPU code; run the tool itself for host figures",
               "--json": "would write where the tool writes, not through videotrain's writer"}
    for option, why in refused.items():
        if any(a == option or a.startswith(option + "=") for a in args):
            print(f"error: {option} {why}", file=sys.stderr)
            return 2
    files = {}
    for name, digest in DIGESTS.items():
        try:
            data = read_bytes(tool / name, 1 << 20, "gpu_estimate file", follow=True)
        except (OSError, ValueError) as err:
            print(f"error: {shown(tool / name)}: cannot read the gpu_estimate file "
                  f"({type(err).__name__})", file=sys.stderr)
            return 2
        if hashlib.sha256(data).hexdigest() != digest:
            print(f"error: {shown(tool / name)} is not the gpu_estimate file this was written "
                  "for (its sha256 differs): review the tool, then update DIGESTS", file=sys.stderr)
            return 2
        files[name] = data
    copy = Path(tempfile.mkdtemp(prefix="gpu_estimate-"))  # 0700: this user's alone
    try:
        for name, data in files.items():
            write_bytes(copy / name, data, root=copy)
        sys.dont_write_bytecode = True
        sys.path.insert(0, str(copy))
        import estimate_step  # the tool's entry point, from the checked copy

        kept_rows.split_bn_backward = cuda_kernels_bn_backward  # read by KeptRowsBatchNorm.backward
        return estimate_step.main(args)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
