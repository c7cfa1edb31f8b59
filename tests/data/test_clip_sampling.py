"""``data.sampler=random``'s frames in a window (``uniform_indices``), and
``data.sampler=segment`` (TSN): one frame from each of ``T`` equal segments of the whole video,
random within the segment at training time (deterministic per seed, epoch and index), the
centre at evaluation (evenly offset for several clips); with either decoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

from videotrain.data.annotations import VideoIndex
from videotrain.data.clip_sampling import check_sampler, segment_indices, uniform_indices
from videotrain.data.dataset import SampleKey, VideoClipDataset
from videotrain.data.synthetic import write_video

LENGTH, T = 40, 8  # a 4 s video at 10 fps; segments of 5 frames


def _segments(length: int, t: int) -> list[range]:
    bounds = [k * length // t for k in range(t + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(t)]


@pytest.mark.parametrize("length,t", [(40, 8), (41, 8), (300, 16), (7, 3), (8, 8)])
def test_segments_cover_the_video_one_frame_each(length: int, t: int) -> None:
    segments = _segments(length, t)
    assert [i for seg in segments for i in seg] == list(range(length))  # the whole video, once
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        (picks,) = segment_indices(length, t, train=True, generator=g)
        assert picks.shape == (t,) and picks.dtype == torch.long
        assert all(i in seg for i, seg in zip(picks.tolist(), segments, strict=True))


def test_training_frames_are_uniform_within_each_segment() -> None:
    g = torch.Generator().manual_seed(0)
    drawn = torch.stack([segment_indices(LENGTH, T, train=True, generator=g)[0] for _ in range(500)])
    assert set(drawn.flatten().tolist()) == set(range(LENGTH))  # every frame can be drawn
    counts = torch.bincount(drawn[:, 0], minlength=5)[:5]  # the first segment's 5 frames
    assert counts.min() > 60  # ~100 each


def test_training_frames_are_deterministic_per_seed() -> None:
    def draw(seed: int) -> list[int]:
        return segment_indices(LENGTH, T, True, generator=torch.Generator().manual_seed(seed))[0].tolist()

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
    torch.manual_seed(7)  # without a generator: the global one, which the dataset seeds per item
    a = segment_indices(LENGTH, T, True)[0]
    torch.manual_seed(7)
    assert torch.equal(a, segment_indices(LENGTH, T, True)[0])


def test_evaluation_takes_segment_centres_and_offsets_several_clips() -> None:
    (centre,) = segment_indices(LENGTH, T, train=False)
    assert centre.tolist() == [2, 7, 12, 17, 22, 27, 32, 37]
    two = segment_indices(LENGTH, T, train=False, num_clips=2)  # at 1/4 and 3/4 of each segment
    assert [c.tolist()[:2] for c in two] == [[1, 6], [3, 8]]
    five = torch.stack(segment_indices(LENGTH, T, train=False, num_clips=5))  # (5, T)
    assert torch.equal(five[:, 0], torch.arange(5))  # every frame of the segment, in order


def test_a_video_shorter_than_the_clip_repeats_frames() -> None:
    (centre,) = segment_indices(3, 8, train=False)
    assert centre.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    (picks,) = segment_indices(3, 8, train=True, generator=torch.Generator().manual_seed(0))
    assert picks.min() >= 0 and picks.max() <= 2 and sorted(picks.tolist()) == picks.tolist()
    with pytest.raises(ValueError, match="0 frames"):
        segment_indices(0, 8, train=False)


def test_unknown_sampler_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"data\.sampler must be one of random, segment, got 'tsn'"):
        check_sampler("tsn")


# ------------------------------------------------------------------------ through the dataset
def _index_video(path: Path) -> Path:
    """Frame ``i`` is flat grey ``10 + 6 i``, so a decoded frame says which frame it is."""
    frames = np.stack([np.full((16, 16, 3), 10 + 6 * i, np.uint8) for i in range(LENGTH)])
    write_video(path, frames, 10)
    return path


@pytest.fixture(scope="module")
def index_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _index_video(tmp_path_factory.mktemp("segment") / "ramp.mp4")


def _frame_numbers(clip: torch.Tensor) -> list[int]:
    """``(T, C, H, W)`` uint8 -> which frame each one is."""
    return ((clip.float().mean(dim=(1, 2, 3)) - 10) / 6).round().long().tolist()


def _dataset(path: Path, decoder: str, train: bool, clips: int = 1, seed: int = 0) -> VideoClipDataset:
    index = VideoIndex(LabeledVideoPaths([(str(path), 0)]), ["ramp"], "ramp.csv")
    return VideoClipDataset(index, T, 1.6, lambda clip: clip, train=train, num_clips=clips,
                            seed=seed, decoder=decoder, sampler="segment")  # uint8 (T, C, H, W)


@pytest.fixture(params=["pyav", "torchcodec"])
def decoder(request: pytest.FixtureRequest) -> str:
    if request.param == "torchcodec":
        request.getfixturevalue("torchcodec")  # skips where it is not installed
    return request.param


def test_dataset_segment_clip_spans_the_whole_video(index_video: Path, decoder: str) -> None:
    item = _dataset(index_video, decoder, train=True)[SampleKey(0, 0)]
    assert item["video"].shape == (T, 3, 16, 16) and item["skipped"] == []
    frames = _frame_numbers(item["video"])
    assert all(f in seg for f, seg in zip(frames, _segments(LENGTH, T), strict=True)), frames
    val = _dataset(index_video, decoder, train=False, clips=2)[SampleKey(0, 0)]["video"]
    assert val.shape == (2, T, 3, 16, 16)  # (clips, T, C, H, W)
    assert [_frame_numbers(v)[:3] for v in val] == [[1, 6, 11], [3, 8, 13]]
    centre = _dataset(index_video, decoder, train=False)[SampleKey(0, 0)]["video"]
    assert _frame_numbers(centre[0]) == [2, 7, 12, 17, 22, 27, 32, 37]


def test_dataset_segment_frames_depend_on_seed_epoch_and_index_only(index_video: Path,
                                                                    decoder: str) -> None:
    ds = _dataset(index_video, decoder, train=True)
    epochs = [_frame_numbers(ds[SampleKey(0, e)]["video"]) for e in range(4)]
    torch.manual_seed(123)  # the global state does not matter
    assert _frame_numbers(_dataset(index_video, decoder, train=True)[SampleKey(0, 2)]["video"]) == epochs[2]
    assert len({tuple(e) for e in epochs}) > 1  # a new draw each epoch
    other_seed = [_frame_numbers(_dataset(index_video, decoder, True, seed=1)[SampleKey(0, e)]["video"])
                  for e in range(4)]
    assert other_seed != epochs


def test_both_decoders_take_the_same_segment_frames(torchcodec: None, index_video: Path) -> None:
    for key in [SampleKey(0, e) for e in range(3)]:
        a = _dataset(index_video, "pyav", train=True)[key]["video"]
        b = _dataset(index_video, "torchcodec", train=True)[key]["video"]
        assert (a.float() - b.float()).abs().mean() < 3


def test_uniform_indices() -> None:
    assert uniform_indices(8, 4).tolist() == [0, 2, 5, 7]
    assert uniform_indices(3, 5).tolist() == [0, 0, 1, 2, 2]  # repeats when too short
    assert uniform_indices(1, 3).tolist() == [0, 0, 0]
