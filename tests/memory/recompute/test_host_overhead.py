"""The recompute executor's host cost: a checkpointed segment adds no aten op beyond
the ops it recomputes, about the Python work of a plain ``torch.utils.checkpoint`` call, RNG
state only where it draws random numbers, no kernel for free boundary ops; and checkpoint
optimal at half memory dispatches at most 1.35x e2e's aten ops per step.

Counts, not wall time: the aten-op count is what a GPU launches (``metrics.dispatch``) and the
Python-call count is deterministic on a loaded 2-core CI machine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from videotrain.memory.recompute.execute import RecomputedForward, wrap_forward
from videotrain.memory.recompute.strategy import Recompute
from videotrain.metrics.dispatch import aten_ops

SEGMENTS = 8


def chain(bn: bool, dropout: float = 0.0) -> nn.Sequential:
    """``SEGMENTS`` blocks of Linear (+ BN) + ReLU (+ dropout) on (4, 16) rows."""
    torch.manual_seed(0)
    blocks = []
    for _ in range(SEGMENTS):
        layers: list[nn.Module] = [nn.Linear(16, 16)]
        layers += [nn.BatchNorm1d(16)] if bn else []
        layers += [nn.ReLU()]
        layers += [nn.Dropout(dropout)] if dropout else []
        blocks.append(nn.Sequential(*layers))
    return nn.Sequential(*blocks)


def step_ops(model: nn.Module, x: torch.Tensor) -> int:
    model(x).sum().backward()  # first step: probes, spares
    with aten_ops() as ops:
        model(x).sum().backward()
    return sum(ops.values())


@pytest.mark.parametrize("bn", [False, True])
def test_a_segment_adds_only_the_ops_it_recomputes(bn: bool) -> None:
    """Per block exactly the ops of its forward (Linear + ReLU: addmm, relu; with BN also its
    batch_norm, the step counter's add_ and what the kernel allocates, as this torch dispatches
    them). No clone of BN buffers, no anchor allocation, no RNG state copy."""
    x = torch.randn(4, 16)
    e2e = step_ops(chain(bn), x)
    block = chain(bn)[0]
    with aten_ops() as forward:
        block(x.requires_grad_())
    x = x.detach()
    model = chain(bn)
    for block in model:
        wrap_forward(block)
    per_segment = (step_ops(model, x) - e2e) / SEGMENTS
    assert per_segment == sum(forward.values()) >= (4 if bn else 2)  # 4 and 2 (allocations left out)
    with aten_ops() as ops:
        model(x).sum().backward()
    assert "aten.clone" not in ops


@pytest.mark.parametrize("bn", [False, True])
def test_python_work_per_segment_is_close_to_plain_checkpoint(bn: bool, kit) -> None:  # noqa: ANN001
    """Our segment (BN isolation, input release, replay hooks, RNG probe) costs at most 1.25x
    the Python calls of a plain non-reentrant checkpoint of the same block, plus 40."""
    x = torch.randn(4, 16)
    plain = chain(bn)
    ours = chain(bn)
    for block in ours:
        wrap_forward(block)

    def plain_step() -> None:
        y = x
        for block in plain:
            y = checkpoint(block, y, use_reentrant=False)
        y.sum().backward()

    def python_calls(fn: Callable[[], None]) -> int:  # after a first call (probes, spares)
        fn()
        return kit.python_calls(fn)

    base = python_calls(lambda: chain(bn)(x).sum().backward())
    plain_calls = (python_calls(plain_step) - base) / SEGMENTS
    our_calls = (python_calls(lambda: ours(x).sum().backward()) - base) / SEGMENTS
    assert our_calls <= 1.25 * plain_calls + 40, (our_calls, plain_calls)


def test_rng_state_is_kept_only_for_segments_that_draw(device: torch.device) -> None:
    """The probe's verdict per segment, and with dropout the recompute replays the mask:
    gradients equal e2e's under the same seed (on CUDA: the device generator's offset)."""
    x = torch.randn(4, 16, device=device, requires_grad=True)
    quiet, noisy = chain(bn=True).to(device), chain(bn=False, dropout=0.3).to(device)
    for block in [*quiet, *noisy]:
        wrap_forward(block)
    quiet(x).sum().backward()
    torch.manual_seed(1)
    noisy(x).sum().backward()
    assert [b.forward.rng.draws for b in quiet] == [False] * SEGMENTS
    assert [b.forward.rng.draws for b in noisy] == [True] * SEGMENTS
    got = [p.grad.clone() for p in noisy.parameters()]
    for p in noisy.parameters():
        p.grad = None
    for block in noisy:  # the second step already ran on the probe's verdict; compare it too
        assert isinstance(block.__dict__["forward"], RecomputedForward)
    torch.manual_seed(2)
    noisy(x).sum().backward()
    got2 = [p.grad.clone() for p in noisy.parameters()]
    reference = chain(bn=False, dropout=0.3).to(device)
    for seed, expect in ((1, got), (2, got2)):
        reference.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        reference(x).sum().backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(expect, reference.parameters(), strict=True))


class ConvChain(nn.Module):
    """conv -> BN -> ReLU, three times: cuts after a conv leave it a free boundary op."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.ModuleList(nn.Conv2d(4 if i else 3, 4, 3, padding=1) for i in range(3))
        self.bns = nn.ModuleList(nn.BatchNorm2d(4) for _ in range(3))
        self.feature_dim = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, 4)
        for conv, bn in zip(self.convs, self.bns, strict=True):
            x = F.relu(bn(conv(x)))
        return x.mean((2, 3))


def test_free_boundary_convs_run_no_kernel_in_the_recompute(device: torch.device) -> None:
    """The sqrt plan with every vertex cut: a segment that ends in a conv skips it when it is
    recomputed (one convolution less per such segment), and gradients and BN running
    statistics still equal e2e's (on CUDA: in channels_last, as the trainer runs a ResNet)."""
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    x = torch.randn(2, 3, 8, 8, device=device).contiguous(memory_format=fmt)
    ref = ConvChain().train().to(device, memory_format=fmt)
    ref(x).sum().backward()
    model = ConvChain().train().to(device, memory_format=fmt)
    strategy = Recompute("sqrt", segments=9)
    runner = strategy._runner(model, x)
    with aten_ops() as ops:
        runner(x).sum().backward()
    free_convs = sum(len(seg["nodes"]) == 1 and seg["nodes"][0].startswith("convs")
                     for seg in strategy.last_report["segments"][:-1])
    assert free_convs >= 2
    recomputed_convs = sum(seg["nodes"][0].startswith("convs") for seg in strategy.last_report["segments"][:-1]
                           if seg["kept"] != "all" and len(seg["nodes"]) > 1)
    # forward: 3; recompute: only the convs that are not alone at a segment's end
    assert ops["aten.convolution"] == 3 + recomputed_convs
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)
    for a, b in zip(ref.buffers(), model.buffers(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-6)


def test_checkpoint_optimal_at_half_memory_dispatches_at_most_1_35x_e2e_ops() -> None:
    """The step's aten ops (a GPU's kernel launches) on a ResNet-18: optimal at budget 0.5 and
    sqrt within 1.35x of e2e."""
    from videotrain.config.build import build_model, compose_cfg

    video = torch.randn(1, 4, 3, 64, 64)  # (B, T, C, H, W)
    counts = {}
    for name, ovs in {"e2e": ["memory=e2e"],
                      "sqrt": ["memory=recompute", "memory.policy=sqrt"],
                      "optimal": ["memory=recompute", "memory.policy=optimal", "memory.budget_frac=0.5"]}.items():
        cfg = compose_cfg(["model/backbone=resnet18", "model.backbone.temporal_shift=0", *ovs])
        torch.manual_seed(0)
        model = build_model(cfg, num_classes=3).train()
        counts[name] = step_ops(model, video)
    assert counts["optimal"] <= 1.35 * counts["e2e"], counts
    assert counts["sqrt"] <= 1.35 * counts["e2e"], counts


class TokenMlp(nn.Module):
    """Linear, LayerNorm, Linear on (N, L, D) tokens: a Linear on 3-D input runs as views
    around one addmm, the op its recompute skips."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)
        self.feature_dim = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, L, 8) -> (N, 8)
        return self.b(self.norm(self.a(x))).mean(1)


def test_token_linears_at_segment_ends_are_not_recomputed() -> None:
    x = torch.randn(4, 5, 8)
    ref = TokenMlp()
    ref(x).sum().backward()
    model = TokenMlp()
    strategy = Recompute("sqrt", segments=4)
    runner = strategy._runner(model, x)
    with aten_ops() as ops:
        runner(x).sum().backward()
    assert [s["nodes"] for s in strategy.last_report["segments"]] == [["a"], ["norm"], ["b"], ["mean"]]
    assert ops["aten.addmm"] == 2 and ops["aten.native_layer_norm"] == 2  # the LayerNorm is recomputed
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
