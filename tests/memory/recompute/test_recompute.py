"""The recompute primitive: inputs are let go once the recompute is done, and misuse is refused."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from videotrain.memory.recompute.execute import recompute_call
from videotrain.metrics.saved import collect_held


class Probe(torch.autograd.Function):
    """Identity that saves its input, so its backward triggers the segment's recompute, and
    then reports whether ``Probe.watched`` (a storage) is still alive."""

    watched: StorageWeakRef | None = None
    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (_,) = ctx.saved_tensors  # unpacking runs the recompute
        Probe.seen.append(Probe.watched.expired())
        return grad


def test_input_is_released_after_the_recompute_not_after_the_segment() -> None:
    """A segment's input that nothing inside saves dies right after the recompute, while the
    segment's backward is still running (torch.utils.checkpoint would hold it to the end)."""
    a = torch.randn(4, 8, requires_grad=True)
    x = a * 2  # mul by a constant saves nothing: only the checkpoint can hold x
    Probe.watched, Probe.seen = StorageWeakRef(x.untyped_storage()), []
    with collect_held() as held:
        y = recompute_call(lambda t: Probe.apply(t.relu()), [], x)  # relu saves its result, not t
        assert [h is x for h in held()] == [True]  # held between forward and recompute
        del x
        y.sum().backward()
        assert held() == []
    assert Probe.seen == [True]
    assert torch.equal(a.grad, 2 * (a > 0).float())


def test_plain_checkpoint_would_still_hold_the_input() -> None:
    """The same probe under torch.utils.checkpoint: the input is still alive, so the test above
    measures our release and not a property of the graph."""
    from torch.utils.checkpoint import checkpoint

    a = torch.randn(4, 8, requires_grad=True)
    x = a * 2
    Probe.watched, Probe.seen = StorageWeakRef(x.untyped_storage()), []
    y = checkpoint(lambda t: Probe.apply(t.relu()), x, use_reentrant=False)
    del x
    y.sum().backward()
    assert Probe.seen == [False]


def test_second_recompute_is_refused() -> None:
    a = torch.randn(4, 8, requires_grad=True)
    y = recompute_call(lambda t: t.sin(), [], a * 2)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recomputed twice"):
        y.sum().backward()


def test_in_place_change_of_an_input_is_refused() -> None:
    a = torch.randn(4, 8, requires_grad=True)
    x = a * 2
    y = recompute_call(lambda t: t.sin(), [], x)
    with torch.no_grad():
        x.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_gradients_match_plain_autograd_with_kwargs_and_non_tensors() -> None:
    a = torch.randn(3, 5, requires_grad=True)
    b = torch.randn(3, 5, requires_grad=True)

    def fn(x: torch.Tensor, scale: float, *, other: torch.Tensor) -> torch.Tensor:
        return (x.sin() * other).relu() * scale

    recompute_call(fn, [], a, 3.0, other=b).sum().backward()
    got = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    fn(a, 3.0, other=b).sum().backward()
    assert torch.allclose(got[0], a.grad) and torch.allclose(got[1], b.grad)
