"""The live-storage counter: exact bytes and peak on real tensors, where they are known."""

from __future__ import annotations

import torch

from videotrain.metrics.live_bytes import LiveStorageBytes

MB = 2**20


def test_counts_live_storages_and_their_peak() -> None:
    with LiveStorageBytes() as live:
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        view = b[: MB // 2]  # shares b's storage: not counted again
        assert live.now() == 3 * MB
        del a
        assert live.now() == 2 * MB
        c = torch.empty(MB // 4, dtype=torch.uint8)
        assert live.peak == 3 * MB  # a and b were alive together
        live.reset_peak()
        assert live.peak == 2 * MB + MB // 4
        del b
        assert live.now() == 2 * MB + MB // 4  # the view keeps b's storage
        del view, c
        assert live.now() == 0


def test_paused_ops_run_but_are_not_counted() -> None:
    with LiveStorageBytes() as live:
        kept = torch.ones(MB, dtype=torch.uint8)
        with live.paused():
            hidden = kept * 2
        assert live.now() == MB  # before anything else runs under the mode
        assert int(hidden.sum()) == 2 * MB
        del kept, hidden
        assert live.now() == 0


def test_tracked_tensors_created_outside_count() -> None:
    outside = torch.empty(MB, dtype=torch.uint8)
    with LiveStorageBytes() as live:
        live.track(outside)
        inside = outside + 1
        assert live.peak == live.now() == 2 * MB
        del inside


def test_peak_of_a_backward_is_the_known_one() -> None:
    """y = (x * 2).relu() saves one activation; its backward allocates grads one at a time."""
    x = torch.randn(MB // 4, requires_grad=True)  # 1 MB of float32
    with LiveStorageBytes() as live:
        live.track(x)
        y = (x * 2).relu()  # 2x keeps nothing, relu saves its output: x + y
        assert live.now() == 2 * MB
        y.sum().backward()  # grad of y (1) -> mask grad (1) -> x.grad (1): at most x, y + 2
        assert live.peak <= 4 * MB + 64 and live.peak >= 3 * MB
