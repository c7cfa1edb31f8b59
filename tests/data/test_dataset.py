"""The map-style clip dataset, transforms, the resumable sampler, and ``build_data``. Frames
resized as they are decoded (to the transform's short side) give the items of before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ordinary_media import write_videos
from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

from videotrain.data import dataset, decode, media_budget
from videotrain.data.annotations import VideoIndex, kinetics_index
from videotrain.data.dataset import SampleKey, VideoClipDataset, collate
from videotrain.data.decode import VideoFile
from videotrain.data.loaders import ResumableSampler, build_data
from videotrain.data.transforms import (
    SpatialCrops,
    eval_transform,
    frame_short_side,
    train_transform,
)
from videotrain.untrusted.bounds import MAX_DECODED_BYTES

T, CROP = 4, 32
CLIP_SECONDS = 0.8  # 8 frames at 10 fps: the whole synthetic video


def _train_ds(root: Path, seed: int = 0) -> VideoClipDataset:
    return VideoClipDataset(kinetics_index(root, "train"), T, CLIP_SECONDS,
                            train_transform(40, CROP, (0.25, 1.0), hflip=True), train=True, seed=seed)


def test_train_item_is_one_clip(tiny_root: Path) -> None:
    item = _train_ds(tiny_root)[SampleKey(3, 0)]
    assert item["video"].shape == (T, 3, CROP, CROP)
    assert item["video"].dtype == torch.uint8  # normalized on the device (clips_to_device)
    assert item["label"] == kinetics_index(tiny_root, "train").labels[3]
    assert item["index"] == 3 and item["skipped"] == []


@pytest.mark.parametrize("clips,crops", [(1, 1), (2, 3)])
def test_val_item_stacks_clips_times_crops(tiny_root: Path, clips: int, crops: int) -> None:
    ds = VideoClipDataset(kinetics_index(tiny_root, "val"), T, 0.4, eval_transform(40, CROP, crops),
                          train=False, num_clips=clips)
    video = ds[SampleKey(1, 0)]["video"]
    assert video.shape == (clips * crops, T, 3, CROP, CROP)
    if crops == 3:  # left / centre / right crops of a 40x40 frame really differ
        assert not torch.equal(video[0], video[1]) and not torch.equal(video[1], video[2])
    if clips == 2:  # two clips spaced in time (0.4 s windows of a 0.8 s video) differ
        assert not torch.equal(video[0], video[crops])


def test_same_key_same_pixels_whatever_the_global_rng(tiny_root: Path) -> None:
    ds = _train_ds(tiny_root)
    torch.manual_seed(1)
    a = ds[SampleKey(5, 2)]["video"]
    torch.manual_seed(12345)
    _ = torch.rand(100)
    b = _train_ds(tiny_root)[SampleKey(5, 2)]["video"]  # a fresh dataset object, too
    assert torch.equal(a, b)
    assert torch.equal(ds[5]["video"], ds[SampleKey(5, 0)]["video"])  # int key == epoch 0


def test_augmentation_depends_on_epoch_and_seed(tiny_root: Path) -> None:
    ds = _train_ds(tiny_root)
    e0 = ds[SampleKey(5, 0)]["video"]
    assert not torch.equal(e0, ds[SampleKey(5, 1)]["video"])
    assert not torch.equal(e0, _train_ds(tiny_root, seed=1)[SampleKey(5, 0)]["video"])


def test_item_does_not_disturb_global_rng(tiny_root: Path) -> None:
    ds = _train_ds(tiny_root)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    ds[SampleKey(0, 0)]
    assert torch.equal(torch.rand(3), expected)


def test_item_gives_up_when_every_video_is_broken(tiny_copy: Path) -> None:
    for f in (tiny_copy / "train").rglob("*.mp4"):
        f.write_bytes(b"broken")
    ds = VideoClipDataset(kinetics_index(tiny_copy, "train"), T, CLIP_SECONDS,
                          train_transform(32, CROP), train=True, max_retries=3)
    with pytest.raises(RuntimeError, match=r"train\.csv: 4 videos in a row failed to decode; last: "):
        ds[SampleKey(0, 0)]


def test_collate() -> None:
    items = [
        {"video": torch.zeros(T, 3, 2, 2), "label": 1, "index": 0, "skipped": []},
        {"video": torch.ones(T, 3, 2, 2), "label": 3, "index": 7, "skipped": ["x.mp4", "y.mp4"]},
    ]
    batch = collate(items)
    assert batch["video"].shape == (2, T, 3, 2, 2)
    assert batch["label"].tolist() == [1, 3] and batch["index"].tolist() == [0, 7]
    assert batch["skipped"] == ["x.mp4", "y.mp4"]


def test_collate_gives_a_contiguous_batch_from_decoded_frames() -> None:
    """Decoded frames are (T, H, W, C) permuted to (T, C, H, W), C innermost; the batch is laid
    out NCHW whatever the clips' strides (the model lays out its input itself, and a CPU conv
    fed channels_last input would run the slower NHWC kernels and hold more memory)."""
    clips = [torch.rand(T, 4, 5, 3).permute(0, 3, 1, 2) for _ in range(2)]  # (T, C, H, W) views
    assert not clips[0].is_contiguous()
    batch = collate([{"video": c, "label": 0, "index": i, "skipped": []} for i, c in enumerate(clips)])
    assert batch["video"].is_contiguous() and torch.equal(batch["video"], torch.stack(clips))


# ------------------------------------------------------------------- transforms


def test_spatial_crops_positions() -> None:
    clip = torch.arange(6 * 10).view(1, 1, 6, 10).float()  # (T, C, H, W) with W > H
    crops = SpatialCrops(6, 3)(clip)
    assert crops.shape == (3, 1, 1, 6, 6)
    assert [int(c[0, 0, 0, 0]) for c in crops] == [0, 2, 4]  # left, centre, right columns
    tall = clip.transpose(-1, -2).contiguous()  # H > W: crops move down
    tall_crops = SpatialCrops(6, 3)(tall)
    for i, y in enumerate((0, 2, 4)):
        assert torch.equal(tall_crops[i], tall[..., y : y + 6, :])
    assert int(SpatialCrops(4, 1)(clip)[0, 0, 0, 0, 0]) == 1 * 10 + 3  # centre crop
    with pytest.raises(ValueError, match="data.val_crops"):
        SpatialCrops(4, 0)


def test_eval_transform_rejects_crop_larger_than_short_side() -> None:
    with pytest.raises(ValueError, match="data.crop_size=64 exceeds data.short_side=32"):
        eval_transform(32, 64)


def test_train_transform_same_crop_for_every_frame() -> None:
    torch.manual_seed(0)
    frame = torch.randint(0, 255, (1, 3, 40, 40), dtype=torch.uint8)
    out = train_transform(40, 16, (0.1, 0.3), hflip=True)(frame.repeat(4, 1, 1, 1))
    assert out.shape == (4, 3, 16, 16)
    for t in range(1, 4):  # identical frames in, identical frames out: one crop for the clip
        assert torch.equal(out[0], out[t])


# ------------------------------------------------------------------- sampler and loaders


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_resumable_sampler_skips_what_was_consumed() -> None:
    sampler = ResumableSampler(_Sized(10), shuffle=True, seed=3)
    sampler.set_epoch(1)
    full = list(sampler)
    assert sorted(k.index for k in full) == list(range(10))
    assert all(k.epoch == 1 for k in full)
    sampler.set_epoch(1, skip=4)
    assert list(sampler) == full[4:] and len(sampler) == 6
    sampler.set_epoch(2)
    assert [k.index for k in sampler] != [k.index for k in full]  # reshuffled per epoch
    again = ResumableSampler(_Sized(10), shuffle=True, seed=3)
    again.set_epoch(1)
    assert list(again) == full  # a function of (seed, epoch) only


def test_resumable_sampler_shards_ranks() -> None:
    keys = []
    for rank in range(2):
        s = ResumableSampler(_Sized(10), shuffle=True, seed=0, rank=rank, world_size=2, drop_last=True)
        s.set_epoch(0)
        keys.append({k.index for k in s})
    assert len(keys[0]) == len(keys[1]) == 5 and not keys[0] & keys[1]


def _build(root: Path | None, **kw):
    args = dict(name="kinetics", layout="kinetics", root=root and str(root), num_frames=T, sampling_rate=2,
                fps=10, short_side=32, crop_size=CROP, train_scale=(0.5, 1.0), hflip=False,
                batch_size=4, val_batch_size=3, num_workers=0, val_clips=2, val_crops=1,
                max_bad_fraction=0.1)
    return build_data(**{**args, **kw})


def test_build_data_batches(tiny_root: Path) -> None:
    data, bad = _build(tiny_root)
    assert bad == [] and data.num_classes == 4 and data.root == tiny_root
    assert len(data.train) == 4  # 16 videos / batch 4
    data.train_sampler.set_epoch(0)
    batch = next(iter(data.train))
    assert batch["video"].shape == (4, T, 3, CROP, CROP)
    val = next(iter(data.val))
    assert val["video"].shape == (3, 2, T, 3, CROP, CROP)  # (B, V = clips * crops, T, C, H, W)


def test_batches_do_not_depend_on_worker_count(tiny_root: Path) -> None:
    batches = []
    for workers in (0, 2):
        data, _ = _build(tiny_root, num_workers=workers)
        data.train_sampler.set_epoch(1, skip=4)  # a resumed epoch, too
        batches.append(next(iter(data.train)))
    assert torch.equal(batches[0]["index"], batches[1]["index"])
    assert torch.equal(batches[0]["video"], batches[1]["video"])


def test_build_data_folder_layout(tiny_root: Path) -> None:
    data, _ = _build(tiny_root, name="folder", layout="folder")
    assert data.class_names == sorted(data.class_names) and data.num_classes == 4


def test_build_data_folder_class_mismatch(tiny_copy: Path) -> None:
    (tiny_copy / "val" / "extra_class").mkdir()
    with pytest.raises(ValueError, match="class folders differ from train"):
        _build(tiny_copy, name="folder", layout="folder")


def test_build_data_folder_layout_checks_num_classes(tiny_root: Path) -> None:
    """The class folders are the classes: a ``data.num_classes`` that differs is an error
    naming both counts (it was accepted, and the head got the wrong width)."""
    assert _build(tiny_root, name="folder", layout="folder", num_classes=4)[0].num_classes == 4
    with pytest.raises(ValueError, match=r"train holds 4 classes, but data.num_classes=5"):
        _build(tiny_root, name="folder", layout="folder", num_classes=5)


def test_build_data_batch_larger_than_dataset(tiny_root: Path) -> None:
    with pytest.raises(ValueError, match="data.batch_size=32 exceeds the 16 training videos"):
        _build(tiny_root, batch_size=32)


def test_build_data_bad_layout_and_root(tiny_root: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.layout"):
        _build(tiny_root, layout="csv")
    with pytest.raises(FileNotFoundError, match="data.root"):
        _build(tmp_path / "nope")
    with pytest.raises(ValueError, match="data.root must be set"):
        _build(None)


def test_val_label_beyond_train_classes(tiny_copy: Path) -> None:
    (tiny_copy / "classes.txt").unlink()
    csv = tiny_copy / "train.csv"  # train only has labels 0..2 -> 3 classes
    csv.write_text("".join(ln + "\n" for ln in csv.read_text().splitlines() if not ln.endswith(" 3")))
    with pytest.raises(ValueError, match=r"val\.csv: label 3 .* outside num_classes=3"):
        _build(tiny_copy)


def test_val_class_absent_from_train(tiny_copy: Path) -> None:
    csv = tiny_copy / "train.csv"  # classes.txt lists 4 classes; train loses every label 3
    csv.write_text("".join(ln + "\n" for ln in csv.read_text().splitlines() if not ln.endswith(" 3")))
    with pytest.raises(ValueError) as err:
        _build(tiny_copy, batch_size=2)
    msg = str(err.value)
    assert msg.startswith(f"{tiny_copy / 'val.csv'}: 1 class(es) have val videos but no training videos")
    assert "label 3" in msg and str(tiny_copy / "train.csv") in msg
    assert "left_then_up" not in msg and "data.drop_classes=[3]" in msg  # by label, never by name


def test_reader_options_must_belong_to_the_layout(tiny_root: Path) -> None:
    with pytest.raises(ValueError, match=r"data.fold is not used by data.layout=kinetics \(it takes "
                                         r"data.train_file, data.val_file"):
        _build(tiny_root, fold=2)
    with pytest.raises(ValueError, match="data.worker_timeout must be >= 0"):
        _build(tiny_root, worker_timeout=-1)


@pytest.mark.parametrize("layout", ["ucf101", "hmdb51", "ssv2"])
def test_synthetic_data_in_any_layout(layout: str, tmp_path: Path) -> None:
    """``data=synthetic data.layout=...`` generates the clips in that layout and reads them."""
    data, _ = _build(str(tmp_path), name="synthetic", layout=layout, batch_size=2,
                     synthetic=dict(train_per_class=1, val_per_class=1, num_frames=8, size=32))
    assert data.root.name.startswith(f"synthetic-{layout}-") and data.num_classes == 4
    data.train_sampler.set_epoch(0)
    assert next(iter(data.train))["video"].shape == (2, T, 3, CROP, CROP)


def test_loaders_keep_workers_and_pin_memory(tiny_root: Path) -> None:
    data, _ = _build(tiny_root, num_workers=2, pin_memory=True, worker_timeout=30)
    for loader in (data.train, data.val):
        assert loader.num_workers == 2 and loader.persistent_workers and loader.pin_memory
        assert loader.timeout == 30
    data, _ = _build(tiny_root, worker_timeout=30)  # no workers: nothing to time out
    assert not data.train.persistent_workers and data.train.timeout == 0


# ------------------------------------------ frames resized as they are decoded: the same items
SIZES = {"1080p": (1920, 1080), "small": (320, 240), "at_target": (170, 128),
         "portrait": (240, 320), "upscaled": (100, 80)}


@pytest.fixture(scope="module")
def ordinary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_videos(tmp_path_factory.mktemp("ordinary"),
                        {name: (w, h, 3.0) for name, (w, h) in SIZES.items()})


def _items(path: Path, train: bool, sampler: str, decoder: str, whole_frames: bool,
           monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """An item's views of ``path`` at the defaults (8 frames, stride 8, 30 fps, short side 128,
    crop 112), 2 clips; ``whole_frames``: as before, the transform resizing full-size clips."""
    monkeypatch.setattr(dataset, "frame_short_side",
                        (lambda t: None) if whole_frames else frame_short_side)
    for module in (media_budget, decode):  # full-size frames at 1080p need more than the budget
        monkeypatch.setattr(module, "MAX_DECODED_BYTES", 2**31 if whole_frames else MAX_DECODED_BYTES)
    transform = (train_transform(128, 112, (0.25, 1.0), hflip=True, randaugment=(2, 9))
                 if train else eval_transform(128, 112, 3))
    ds = VideoClipDataset(VideoIndex(LabeledVideoPaths([(str(path), 0)]), ["a"], "t"),
                          8, 8 * 8 / 30, transform, train=train, num_clips=2, decoder=decoder,
                          sampler=sampler)
    assert ds.short_side == (None if whole_frames else 128)
    return ds[SampleKey(0, 3)]["video"]


@pytest.mark.parametrize("decoder", ["pyav", "torchcodec"])
@pytest.mark.parametrize("sampler", ["random", "segment"])
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("size", list(SIZES))
def test_items_are_those_of_full_size_frames(size: str, train: bool, sampler: str, decoder: str,
                                             ordinary: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                             request: pytest.FixtureRequest) -> None:
    """The decoders scale each kept frame to the transform's short side as it becomes RGB;
    the items (evaluation's views, training's augmented clip) are the ones the transform made
    of full-size frames, bit for bit, at 1080p, smaller, at the target already, portrait and
    upscaled, with either sampler and decoder."""
    if decoder == "torchcodec":
        request.getfixturevalue("torchcodec")  # skips where it cannot run
    arrived = []  # reads whose kept frames were chosen as they arrived (1080p's windows)
    real = VideoFile._clips_as_they_come
    monkeypatch.setattr(VideoFile, "_clips_as_they_come",
                        lambda self, *a: arrived.append(a) or real(self, *a))
    resized = _items(ordinary[size], train, sampler, decoder, False, monkeypatch)
    assert bool(arrived) == (size == "1080p" and sampler == "random" and decoder == "pyav")
    whole = _items(ordinary[size], train, sampler, decoder, True, monkeypatch)
    assert resized.shape == whole.shape == ((8, 3, 112, 112) if train else (6, 8, 3, 112, 112))
    assert torch.equal(resized, whole)
