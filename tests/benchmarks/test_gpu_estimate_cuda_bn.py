"""The GPU estimate's CUDA BN emulation: one BN backward over the kept rows in place of the
CPU form's two ops, and a clear refusal where it cannot serve."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.gpu_estimate_cuda_bn import cuda_kernels_bn_backward, main
from videotrain.memory.sbp.kept_rows import BatchNormCoefficients, split_bn_backward
from videotrain.metrics.dispatch import aten_ops


def test_the_emulation_runs_one_bn_backward_where_the_cpu_form_runs_two_ops() -> None:
    g, x = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)  # (n, C, H, W) kept rows
    mean, rstd, w = torch.zeros(3), torch.ones(3), torch.ones(3)
    ops = {}
    for name, fn in (("cpu", split_bn_backward), ("cuda", cuda_kernels_bn_backward)):
        coefs = BatchNormCoefficients(2, 4)
        coefs.add(w, rstd)
        coefs[0]  # the per-channel factors, made before counting
        with aten_ops() as counts:
            fn(g, x, mean, rstd, coefs, 0, 1e-5, [True, True, True])
        ops[name] = dict(counts)
    assert ops["cpu"] == {"aten.native_batch_norm_backward": 1, "aten.addcmul_": 1}
    assert ops["cuda"] == {"aten.native_batch_norm_backward": 1}


def test_host_figures_and_a_missing_tool_are_refused(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main([str(tmp_path), "--rows", "resnet50/e2e", "--host"]) == 2
    assert main([str(tmp_path), "--rows", "resnet50/e2e"]) == 2
    assert "cannot read the gpu_estimate file" in capsys.readouterr().err
