"""torch's sac_milp planner beside the package (``benchmarks/sac_peer.py``, its rows and
command line in ``benchmarks/sac_milp.py``): the plan keeps e2e's gradients, the adaptations
it needs, its rows through the package's runner with this suite's child, and that the package
itself neither has these rows nor applies them."""

from __future__ import annotations

import subprocess

import pytest
import torch

from benchmarks.sac_milp import ROWS, SUITE, main, run_sac_bench
from videotrain.bench import SUITES
from videotrain.bench.row_setup import prepare_row
from videotrain.bench.suites import CHILD_KEYS, resolve
from videotrain.metrics.saved import saved_activation_bytes
from videotrain.models.backbones import resnet

TINY = dict(batch_size=1, frames=4, size=32, steps=2, warmup=1, device="cpu", threads=1)


def test_sac_rows_are_the_labs_and_the_package_refuses_them() -> None:
    """The three rows keep the names they were measured under; no suite of the package has a
    peer row, and the package's own child refuses one rather than measure e2e under its name."""
    names = [s["name"] for s in resolve(ROWS, [], [])]
    assert names == ["resnet18/e2e", "resnet18/e2e-sac_milp-b0.7", "resnet18/e2e-sac_milp-b0.5",
                     "resnet18/e2e-sac_milp-bmin"]
    assert "peer" in CHILD_KEYS and SUITE not in SUITES
    assert not [r for rows in SUITES.values() for r in rows if r.get("peer") is not None
                or r.get("policy") == "sac_milp"]
    with pytest.raises(ValueError, match="its own suite's child"):
        prepare_row(torch.nn.Module(), None, {"peer": 0.5}, torch.device("cpu"), None)


def test_command_line_refuses_before_any_row(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("spawned a row"))
    assert main(["--only", "no-such-row", "--device", "cpu"]) == 2
    assert "no rows left" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pulp 3.x, as torch calls it
def test_sac_milp_plan_keeps_e2e_gradients() -> None:
    """torch's planner at its smallest feasible budget checkpoints some modules; gradients
    stay e2e's and the forward keeps fewer bytes."""
    pytest.importorskip("pulp")
    pytest.importorskip("pwlf")
    import contextlib
    import copy

    from benchmarks.sac_peer import apply_sac_milp

    def make() -> torch.nn.Module:
        return resnet(layers=[1, 1, 1, 1])

    torch.manual_seed(0)
    ref = make().train()
    sac = copy.deepcopy(ref)
    frames = torch.randn(8, 3, 32, 32)
    figures = apply_sac_milp(sac, make, tuple(frames.shape), torch.device("cpu"), "min",
                             contextlib.nullcontext)
    plan = figures["sac_milp_plan"]
    assert plan["modules"] and 0 < figures["min_budget_frac"] == plan["budget_frac"] <= 1
    assert plan["estimated_act_peak_mb"] <= plan["budget_frac"] * plan["estimated_e2e_act_mb"] + 1e-6
    assert saved_activation_bytes(sac, frames) < saved_activation_bytes(ref, frames)
    for m in (ref, sac):
        m(frames).square().sum().backward()
    for (name, a), (_, b) in zip(ref.named_parameters(), sac.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), name


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pulp 3.x, as torch calls it
def test_sac_milp_infeasible_budget_names_smallest() -> None:
    pytest.importorskip("pulp")
    pytest.importorskip("pwlf")
    import contextlib

    from benchmarks.sac_peer import SacMilpFailed, apply_sac_milp

    backbone = resnet(layers=[1, 1, 1, 1])
    with pytest.raises(SacMilpFailed, match=r"no plan at 0.1 x .*Infeasible.*smallest fraction "
                                            r"it solves 0\.\d+"):
        apply_sac_milp(backbone, lambda: resnet(layers=[1, 1, 1, 1]), (8, 3, 32, 32),
                       torch.device("cpu"), 0.1, contextlib.nullcontext)


def test_sac_first_calls_only_for_parameter_free_leaves() -> None:
    from benchmarks.sac_peer import SacMilpFailed, _first_calls

    def info(*order: str) -> dict:
        return {"mod_order": {k: list(order) for k in ("fw_pre_order", "bw_pre_order",
                                                       "fw_post_order", "bw_post_order")}}

    root = torch.nn.Module()
    root.relu, root.fc = torch.nn.ReLU(), torch.nn.Linear(2, 2)
    ok = info("Root", "Root.relu", "Root.relu")
    _first_calls(ok, root)
    assert ok["mod_order"]["fw_pre_order"] == ["Root", "Root.relu"]
    with pytest.raises(SacMilpFailed, match="Root.fc runs 2 times"):
        _first_calls(info("Root", "Root.fc", "Root.fc"), root)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pulp 3.x, as torch calls it
def test_sac_op_plan_on_batchnorm_ops() -> None:
    """torch's per-module MILP fails on a BatchNorm module as it stands (an op with no cost,
    an 8-byte in-place counter that must be saved); op_plan gives a plan even at keep 0."""
    pytest.importorskip("pulp")
    from torch.distributed._tools.sac_estimator import SACStats

    from benchmarks.sac_peer import op_plan

    stats = SACStats(  # conv, num_batches_tracked.add_, empty, batch_norm, relu_
        func_names=["convolution", "add_", "empty", "native_batch_norm", "relu_"],
        runtimes=[0.03, 1e-9, 0.0, 0.004, 0.004], memory=[100, 8, 0, 100, 100],
        view_like_ops=[], rand_ops=[], saved_autograd_ops=[],
        inplace_ops=[(1, 1), (4, 3)], force_store_random=False)
    save = op_plan(stats, 0.0)  # everything recomputed but the counter (and the free `empty`)
    assert len(save) == 5 and save[1] == 1 and save[0] == save[3] == save[4] == 0
    assert op_plan(stats, 1.0)[0] == 1


def test_sac_milp_row_tiny() -> None:
    """The suite's sac_milp row through the package's runner and this suite's child (fresh
    processes): its plan, measured like every row, with the budget it found."""
    pytest.importorskip("pulp")
    pytest.importorskip("pwlf")
    sac_min = next(r for r in ROWS if r.get("peer") == "min")
    rows, meta, table = run_sac_bench(rows=[sac_min], extra_overrides=["model/backbone=resnet10"],
                                      log=lambda *a, **k: None, **TINY)
    assert meta["setting"]["suite"] == "sac_milp"
    e2e, sac = rows
    assert e2e["name"] == "resnet10/e2e" and sac["name"] == "resnet10/e2e-sac_milp-bmin"
    assert not sac.get("error"), sac.get("error")
    plan = sac["sac_milp_plan"]
    assert plan["modules"] and sac["budget_frac"] == plan["budget_frac"] == sac["min_budget_frac"]
    assert sac["peak_mem_mb"] > 0 and sac["step_time_s"] > 0 and sac["mem_ratio"] is not None
    assert "| sac_milp |" in table
