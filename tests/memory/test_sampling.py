"""Frame selection: counts, reproducibility, per-rank streams, frequencies, resume."""

from __future__ import annotations

import pytest
import torch

from videotrain.memory.sampling import SAMPLERS, FrameSampler, flat_rows, keep_mask, n_keep

RATIOS = (0.3, 0.4, 0.6, 0.75)


@pytest.mark.parametrize(
    ("num_frames", "expected"),
    [
        (8, {0.3: 2, 0.4: 3, 0.6: 5, 0.75: 6}),  # 2.4, 3.2, 4.8, 6.0
        (10, {0.3: 3, 0.4: 4, 0.6: 6, 0.75: 8}),  # 7.5 rounds half up
        (16, {0.3: 5, 0.4: 6, 0.6: 10, 0.75: 12}),  # 4.8, 6.4, 9.6, 12
    ],
)
def test_n_keep_is_clamped_rounded_count(num_frames: int, expected: dict[float, int]) -> None:
    for r, n in expected.items():
        assert n_keep(r, num_frames) == n
    assert n_keep(1 / num_frames, num_frames) == 1
    assert n_keep(1.0, num_frames) == num_frames
    assert n_keep(1e-6, num_frames) == 1  # clamped from below


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01])
def test_n_keep_rejects_ratios_outside_unit_interval(bad: float) -> None:
    with pytest.raises(ValueError, match="keep_ratio"):
        n_keep(bad, 8)


def test_unknown_sampler_is_rejected() -> None:
    with pytest.raises(ValueError, match="uniform_jitter"):
        FrameSampler("strided")


@pytest.mark.parametrize("kind", SAMPLERS)
@pytest.mark.parametrize("num_frames", [8, 10, 13])
def test_exact_count_sorted_distinct_in_range(kind: str, num_frames: int) -> None:
    sampler = FrameSampler(kind, seed=3, rank=0)
    for r in (*RATIOS, 1 / num_frames, 1.0):
        n = n_keep(r, num_frames)
        for _ in range(20):
            idx = sampler.sample(4, num_frames, n)
            assert idx.shape == (4, n) and idx.dtype == torch.long
            assert int(idx.min()) >= 0 and int(idx.max()) < num_frames
            assert bool((idx[:, 1:] > idx[:, :-1]).all()), "sorted and distinct"
            assert keep_mask(idx, num_frames).sum(1).eq(n).all()


@pytest.mark.parametrize("kind", SAMPLERS)
def test_reproducible_from_seed_and_different_per_rank(kind: str) -> None:
    def stream(seed: int, rank: int) -> torch.Tensor:
        s = FrameSampler(kind, seed=seed, rank=rank)
        return torch.stack([s.sample(4, 16, 5) for _ in range(5)])

    assert torch.equal(stream(0, 0), stream(0, 0))
    assert not torch.equal(stream(0, 0), stream(0, 1))
    assert not torch.equal(stream(0, 0), stream(1, 0))


def test_rank_comes_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    assert FrameSampler().rank == 3
    monkeypatch.delenv("RANK")
    assert FrameSampler().rank == 0


# uniform_jitter keeps one frame per chunk, so its per-position frequency is r only when the
# chunks are equal (n_keep divides T); uneven chunks are covered by the one-per-chunk test.
FREQ_CASES = [(k, n) for k in SAMPLERS for n in (2, 4, 3) if not (k == "uniform_jitter" and 8 % n)]


@pytest.mark.parametrize(("kind", "keep"), FREQ_CASES)
def test_per_position_frequency_matches_ratio(kind: str, keep: int) -> None:
    num_frames = 8
    sampler = FrameSampler(kind, seed=11, rank=0)
    hits = torch.zeros(num_frames)
    draws = 400
    for _ in range(draws):
        hits += keep_mask(sampler.sample(16, num_frames, keep), num_frames).sum(0)
    freq = hits / (draws * 16)  # (T,)
    torch.testing.assert_close(freq, torch.full((num_frames,), keep / num_frames), atol=0.02, rtol=0)


def test_uniform_is_evenly_spaced_and_jitter_one_per_chunk() -> None:
    idx = FrameSampler("uniform", seed=0).sample(64, 12, 4)
    assert set(torch.diff(idx, dim=1).unique().tolist()) == {3}
    jit = FrameSampler("uniform_jitter", seed=0).sample(64, 12, 4)
    assert torch.equal(jit // 3, torch.arange(4).expand(64, 4))


def test_state_dict_round_trip_reproduces_next_mask() -> None:
    a = FrameSampler("random", seed=5, rank=1)
    for _ in range(3):
        a.sample(2, 8, 4)
    state = a.state_dict()
    expected = a.sample(2, 8, 4)
    b = FrameSampler("random", seed=5, rank=1)
    b.load_state_dict(state)
    assert torch.equal(b.sample(2, 8, 4), expected)
    # a rank that loads rank 0's checkpoint resumes its *own* stream (ranks share one file)
    c = FrameSampler("random", seed=5, rank=2)
    c_ref = FrameSampler("random", seed=5, rank=2)
    for _ in range(3):
        c_ref.sample(2, 8, 4)
    c.load_state_dict(state)
    assert torch.equal(c.sample(2, 8, 4), c_ref.sample(2, 8, 4))


def test_flat_rows_partition_the_flattened_batch() -> None:
    idx = torch.tensor([[1, 3], [0, 2]])
    kept, dropped = flat_rows(idx, 4)
    assert kept.tolist() == [1, 3, 4, 6]
    assert dropped.tolist() == [0, 2, 5, 7]


@pytest.mark.parametrize("seed", range(5))
def test_flat_rows_are_the_mask_rows_in_order(seed: int) -> None:
    """Kept and dropped rows of ``video.flatten(0, 1)`` equal the mask's nonzero rows (the
    definition), without a data-dependent op."""
    g = torch.Generator().manual_seed(seed)
    b, t, n = 3, 7, 3
    idx = torch.stack([torch.randperm(t, generator=g)[:n] for _ in range(b)])  # (B, n), unsorted
    kept, dropped = flat_rows(idx, t)
    mask = keep_mask(idx, t).flatten()
    assert torch.equal(kept, mask.nonzero().squeeze(1))
    assert torch.equal(dropped, (~mask).nonzero().squeeze(1))


@pytest.mark.parametrize("strategy", ["FrameDropout", "StochasticBackprop"])
def test_strategies_leave_the_sampler_check_to_the_sampler(strategy: str, monkeypatch) -> None:
    """One place says which samplers exist: the strategies pass the choice to FrameSampler."""
    import videotrain.memory as memory
    import videotrain.memory.sampling as sampling

    cls = getattr(memory, strategy)
    with pytest.raises(ValueError, match=r"memory\.sampler must be one of random, uniform, uniform_jitter; got 'tsn'"):
        cls(sampler="tsn")
    monkeypatch.setitem(sampling._DRAW, "tsn", sampling._random)  # the sampler's list, and only it
    assert cls(sampler="tsn").sampler.kind == "tsn"
