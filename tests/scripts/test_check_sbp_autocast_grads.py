"""scripts/check_sbp_autocast_grads.py, the image's SBP + bf16 check: it passes on a case where
every parameter gets a gradient, and it counts (and fails on) a parameter left without one."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture(scope="module")
def check(load_script):
    return load_script("check_sbp_autocast_grads")


def test_every_parameter_gets_a_gradient_under_bf16(check, capsys) -> None:
    assert check.main(["vit-frame"]) == 0
    line = capsys.readouterr().out.splitlines()[-1].split()
    assert line[0] == "vit-frame" and line[-1] == "ok", line
    fp32, bf16 = line[2], line[4]  # "0/N"
    assert fp32 == bf16 and fp32.startswith("0/") and int(fp32[2:]) > 0, line


def test_a_parameter_without_gradient_is_counted_and_fails(check, monkeypatch, capsys) -> None:
    real = check.build_model

    def with_an_unused_parameter(*args, **kwargs):  # trainable, but not in the forward pass
        model = real(*args, **kwargs)
        model.head.unused = nn.Parameter(torch.zeros(3))
        return model

    monkeypatch.setattr(check, "build_model", with_an_unused_parameter)
    missing, total = check.missing_grads(check.CASES["vit-frame"], torch.bfloat16)
    assert missing == 1 and total > 1
    assert check.main(["vit-frame"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].split()[-1] == "FAIL"
