"""The planner's push-aware predicted peak upper-bounds the measured activation peak.

Measured: the largest total size of live tensor storages created during forward + backward of
the backbone (activations, recomputed activations and their gradients), polled after every
dispatched op; storages still alive at the end (parameter gradients, the output) are left out.
Parameters' ``.grad`` are cleared first so the first backward steals its buffers (no transient
accumulation copies). The model is deliberately conservative (it charges 2·M(V_i) for a block
whose tensors autograd partly frees early), so only the upper bound is asserted here; the
looseness is reported by ``test_report_looseness`` output (-s) and in the module's notes.
"""

from __future__ import annotations

import pytest
import torch
from test_checkpoint import SkipNet
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from videotrain.memory.checkpoint import Recompute
from videotrain.memory.graph import trace
from videotrain.memory.planner import evaluate


class LiveBytes(TorchDispatchMode):
    """Tracks storages produced by every op; records the live set after each op."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.timeline: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                ref = StorageWeakRef(s)
                if ref.cdata not in self.refs or self.refs[ref.cdata][0].expired():
                    self.refs[ref.cdata] = (ref, s.nbytes())
        self.timeline.append([k for k, (r, _) in self.refs.items() if not r.expired()])
        return out

    def peak(self) -> int:
        end = {k for k, (r, _) in self.refs.items() if not r.expired()}
        return max((sum(self.refs[k][1] for k in live if k not in end) for live in self.timeline), default=0)


def measured_peak(module: torch.nn.Module, run: torch.nn.Module, x: torch.Tensor) -> int:
    module.zero_grad(set_to_none=True)
    mode = LiveBytes()
    with mode:
        run(x).sum().backward()
    return mode.peak()


def backbones() -> dict:
    from videotrain.models.backbones import resnet, vit

    torch.manual_seed(0)
    return {
        "resnet": resnet(layers=[1, 1, 1, 1]),
        "vit": vit(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64),
        "skip": SkipNet(),
    }


@pytest.mark.parametrize("name", ["resnet", "vit", "skip"])
def test_predicted_peak_bounds_measured(name: str) -> None:
    bb = backbones()[name].train()
    x = torch.randn(8, 3, 32, 32)  # (N, C, H, W)
    _, g, _ = trace(bb, x)
    assert measured_peak(bb, bb, x) <= evaluate(g, [g.full])[0]  # e2e
    for policy, options in (("sqrt", {}), ("optimal", {}), ("optimal", {"budget_frac": 0.5})):
        strategy = Recompute(policy, **options)
        with torch.no_grad():
            runner = strategy._runner(bb, x)
        got = measured_peak(bb, runner, x)
        predicted = strategy.last_report["predicted_peak_bytes"]
        print(f"{name} {policy} {options}: measured {got} predicted {predicted:.0f} ({predicted / got:.2f}x)")
        assert got <= predicted
