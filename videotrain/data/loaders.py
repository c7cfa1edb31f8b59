"""Datasets and loaders for one run: readers by name, resumable sharded sampling, the class
checks (coverage.py) and the preflight (preflight.py) wired together in ``build_data``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from videotrain import (
    NEUTRAL_MARK,  # resume-neutral arguments (videotrain.engine.checkpoints.resume)
)
from videotrain.data import annotations
from videotrain.data.clip_sampling import check_sampler
from videotrain.data.coverage import check_classes, drop_override, dropped_labels, without
from videotrain.data.dataset import SampleKey, VideoClipDataset, collate
from videotrain.data.decode import check_decoder
from videotrain.data.layouts import default_cache_root, ensure_synthetic
from videotrain.data.preflight import preflight
from videotrain.data.split_files import FOLDS, hmdb51_index, ucf101_index
from videotrain.data.ssv2 import VIDEO_EXTS, ssv2_index
from videotrain.data.transforms import eval_transform, train_transform
from videotrain.untrusted import quoted, shown, shown_name

log = logging.getLogger(__name__)


class ResumableSampler(Sampler[SampleKey]):
    """``DistributedSampler`` order (shuffled per epoch from ``seed``), yielding
    ``SampleKey(index, epoch)`` and able to start part-way through an epoch on resume.

    ``pad=False`` (evaluation) gives rank ``r`` the items ``r, r + world_size, ...`` instead of
    ``DistributedSampler``'s equal shards, which repeat items to even the ranks out and would
    count those videos twice in accuracy reduced over ranks.
    """

    def __init__(self, dataset, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False, pad: bool = True) -> None:
        if not pad and (shuffle or drop_last):
            raise ValueError("pad=False is for ordered evaluation (shuffle=False, drop_last=False)")
        self.base = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                       shuffle=shuffle, seed=seed, drop_last=drop_last)
        if not pad:
            self.base = range(rank, len(dataset), world_size)
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's order and skip its first ``skip`` samples (already trained on)."""
        if isinstance(self.base, DistributedSampler):
            self.base.set_epoch(epoch)
        self.epoch, self.skip = epoch, skip

    def __iter__(self):
        for i, idx in enumerate(self.base):
            if i >= self.skip:
                yield SampleKey(int(idx), self.epoch)

    def __len__(self) -> int:
        return max(len(self.base) - self.skip, 0)


@dataclass
class DataBundle:
    train: DataLoader
    val: DataLoader
    train_sampler: ResumableSampler
    class_names: list[str]
    num_classes: int
    root: Path
    val_listed: int = 0  # val videos listed (data.drop_classes' left out); val holds those there
    dropped_classes: list[str] = field(default_factory=list)  # data.drop_classes


def resolve_root(name: str, root: str | None, synthetic: dict | None,
                 layout: str = "kinetics") -> Path:
    """The dataset root; for ``synthetic`` it is generated (in ``layout``) on first use, into
    ``root`` or the cache."""
    if name == "synthetic":
        return ensure_synthetic(root, layout=layout, **(synthetic or {}))
    if not root:
        raise ValueError(f"data.root must be set for data={name} (e.g. data.root=/data/{name})")
    path = Path(os.path.expanduser(root))
    if not path.is_dir():
        raise FileNotFoundError(f"data.root: directory not found: {path}")
    return path


# layout -> reader(root, split, num_classes, **options); options are the data keys it takes
READERS = {
    "kinetics": annotations.kinetics_index,
    "folder": lambda root, split, num_classes=None: annotations.folder_index(root, split),
    "ucf101": ucf101_index,
    "hmdb51": hmdb51_index,
    "ssv2": ssv2_index,
}
READER_OPTIONS = {
    "kinetics": ("train_file", "val_file", "path_prefix", "classes_file"),
    "folder": (),
    "ucf101": ("fold", "split_dir", "video_dir"),
    "hmdb51": ("fold", "split_dir", "video_dir"),
    "ssv2": ("labels_file", "train_file", "val_file", "video_dir", "video_ext"),
}


PREFETCH_CUDA = 4  # batches in flight per worker on CUDA (torch's default: 2)


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask: a cluster job's share, not the
    node's count), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return max(os.cpu_count() or 1, 1)


def auto_num_workers(device_type: str, world_size: int = 1, cpus: int | None = None) -> int:
    """``data.num_workers: auto``: decoding processes per training process.

    The cores this process may use are shared by the training processes on this node
    (``LOCAL_WORLD_SIZE``, set by torchrun; else ``world_size``). On CUDA the model runs on the
    GPU, so every core but one (the main process's, which launches kernels) decodes, up to 16.
    On a CPU the model's own threads need the cores: a quarter of them decode, at least one
    (the default job's 2 cores: 1 worker, as before)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or 1)
    per_process = max((cpus or usable_cpus()) // max(local, 1), 1)
    if device_type == "cuda":
        return max(min(per_process - 1, 16), 1)
    return max(per_process // 4, 1)


def resolve_num_workers(value: int | str, device_type: str, world_size: int = 1) -> int:
    """``data.num_workers``: an integer as given, ``auto`` by :func:`auto_num_workers`."""
    if value == "auto":
        return auto_num_workers(device_type, world_size)
    if not _is_int(value) or value < 0:
        raise ValueError(f"data.num_workers must be auto or an integer >= 0, got {value!r}")
    return int(value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# data key -> (check, what it must be). Every value is checked before any file is read, so a
# bad value is reported as itself (data.num_frames=0 would otherwise make every video "fail to
# decode", blaming the dataset). None (the key's "not set") always passes.
DATA_VALUE_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_frames": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "sampling_rate": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "fps": (lambda v: _is_number(v) and v > 0, "a number of frames per second > 0"),
    "short_side": (lambda v: _is_int(v) and v >= 1, "a number of pixels >= 1"),
    "crop_size": (lambda v: _is_int(v) and v >= 1, "a number of pixels >= 1"),
    "train_scale": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2
                    and all(_is_number(x) for x in v) and 0 < v[0] <= v[1] <= 1,
                    "[min, max] area fractions with 0 < min <= max <= 1"),
    "batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "val_batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "num_workers": (lambda v: v == "auto" or (_is_int(v) and v >= 0), "auto or an integer >= 0"),
    "val_clips": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "val_crops": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "max_bad_fraction": (lambda v: _is_number(v) and 0 <= v <= 1, "a fraction in [0, 1]"),
    "worker_timeout": (lambda v: _is_number(v) and v >= 0, ">= 0 seconds (0: none)"),
    "num_classes": (lambda v: _is_int(v) and v >= 1, "null or an integer >= 1"),
    "fold": (lambda v: v in FOLDS, "1, 2 or 3"),
    "video_ext": (lambda v: v in (*VIDEO_EXTS, "auto"), "webm, mp4 or auto"),
    "drop_classes": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
                     "a list of class names"),
    "hflip_label_map": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) and isinstance(x, str)
                                                               for k, x in v.items()),
                        "null or a mapping of class names to class names"),
}


def flip_label_indices(pairs: Mapping[str, str], class_names: Sequence[str]) -> dict[int, int]:
    """``data.hflip_label_map`` as label numbers, both ways: ``{a: b}`` maps a -> b and b -> a.
    A name that is not a class, or a class given two mirrors, is a ``ValueError`` naming it."""
    index = {name: k for k, name in enumerate(class_names)}
    out: dict[int, int] = {}
    for a, b in dict(pairs).items():  # the map's names are the config's; the dataset's never shown
        for name in (a, b):
            if name not in index:
                raise ValueError(f"data.hflip_label_map: {quoted(name)} is not a class of this "
                                 f"dataset (it has {len(class_names)})")
        for x, y, name in ((index[a], index[b], a), (index[b], index[a], b)):
            if out.setdefault(x, y) != y:
                raise ValueError(f"data.hflip_label_map: {quoted(name)} is mapped to two mirrors "
                                 f"(labels {out[x]} and {y})")
    return out


def check_data_values(values: dict[str, Any]) -> None:
    """Raise a ``ValueError`` naming the first ``data.*`` value outside its range
    (``DATA_VALUE_CHECKS``); keys without a check and None values pass."""
    for key, (ok, must) in DATA_VALUE_CHECKS.items():
        value = values.get(key)
        if value is not None and not ok(value):
            raise ValueError(f"data.{key} must be {must}, got {shown(value)}")


def read_index(layout: str, root: Path, split: str, num_classes: int | None,
               options: dict[str, Any] | None = None) -> annotations.VideoIndex:
    """The split's videos and labels, read by the layout's reader. ``options`` holds the
    reader's data keys (``data.fold``, ``data.path_prefix``, ...); a key the layout does not
    use is an error, so that a typo or a leftover key does not silently do nothing."""
    if layout not in READERS:
        raise ValueError(f"data.layout must be one of {', '.join(READERS)}, got {layout!r}")
    options = {k: v for k, v in (options or {}).items() if v is not None}
    unused = sorted(set(options) - set(READER_OPTIONS[layout]))
    if unused:
        raise ValueError(f"data.{unused[0]} is not used by data.layout={layout} (it takes "
                         f"{', '.join('data.' + k for k in READER_OPTIONS[layout]) or 'no options'})")
    return READERS[layout](root, split, num_classes, **options)


def check_val_classes(train: annotations.VideoIndex, val: annotations.VideoIndex,
                      drop: set[int] | None = None) -> None:
    """Every class in val must have training videos: a model cannot learn a class it never
    sees, and its val accuracy would silently count as errors. (Read from the lists alone,
    before any file is stat-ed; ``coverage.check_classes`` then counts the readable videos.)"""
    have = set(train.labels) | set(drop or ())
    missing = sorted(set(val.labels) - have)
    if missing:
        labels = ", ".join(f"label {k}" for k in missing[:5])  # a class's name is never echoed
        known = [k for k in missing if k < len(train.class_names)]
        hint = (f"; or leave them out of training and the metrics with "
                f"{drop_override(known, train.class_names)}" if len(known) == len(missing) else "")
        raise annotations.AnnotationError(
            f"{shown(Path(val.source))}: {len(missing)} class(es) have val videos but no training "
            f"videos in {shown(Path(train.source))}: {labels}{' ...' if len(missing) > 5 else ''}{hint}"
        )


def read_splits(layout: str, root: Path, num_classes: int | None, options: dict[str, Any],
                drop_classes: Sequence[str] | None,
                ) -> tuple[annotations.VideoIndex, annotations.VideoIndex, set[int]]:
    """Both splits' lists and the labels ``data.drop_classes`` leaves out, checked against each
    other from the lists alone (no video file is stat-ed yet)."""
    train_index = read_index(layout, root, "train", num_classes, options)
    val_index = read_index(layout, root, "val", num_classes or len(train_index.class_names), options)
    if layout == "folder":  # the class folders are the classes: a set data.num_classes agrees
        annotations.check_class_count(train_index.class_names, num_classes,
                                      str(Path(root) / "train"), verb="holds")
    if layout == "folder" and val_index.class_names != train_index.class_names:
        extra = len(set(val_index.class_names) - set(train_index.class_names))  # counted, not named
        raise annotations.AnnotationError(
            f"{shown(Path(val_index.source))}: class folders differ from train's "
            f"({f'{extra} not in train' if extra else 'some of train missing'})"
        )
    drop = dropped_labels(drop_classes, train_index.class_names, train_index.source)
    check_val_classes(train_index, val_index, drop)
    return train_index, val_index, drop


def find_bad(train_index: annotations.VideoIndex, val_index: annotations.VideoIndex,
             drop: set[int], max_bad_fraction: float, preflight_train: bool,
             report_dir: str | Path | None) -> list[str]:
    """The preflight (``preflight.preflight``): the listed videos that are missing or empty,
    training's too unless ``preflight_train`` is off; then every kept class must still have
    readable videos (``coverage.check_classes``)."""
    cache = default_cache_root()
    found = (preflight(train_index, max_bad_fraction, cache, "train", report_dir)
             if preflight_train else [])
    found += preflight(val_index, max_bad_fraction, cache, "val", report_dir)
    check_classes(train_index, val_index, set(found), drop, preflight_train, report_dir)
    return found


def kept_videos(train_index: annotations.VideoIndex, val_index: annotations.VideoIndex,
                known_bad: frozenset[str], drop: set[int],
                ) -> tuple[annotations.VideoIndex, annotations.VideoIndex, int]:
    """Both lists without the dropped classes, val also without its bad videos, and how many
    val videos were listed; says what is left out. Training replaces a bad video by another
    (batches stay full); evaluation scores only the videos that are there, never another video
    in place of a missing one."""
    val_listed = len(without(val_index, drop=drop))
    train_index = without(train_index, drop=drop)
    val_index = without(val_index, known_bad, drop)
    if drop:
        log.warning("data.drop_classes: %s left out of training and the metrics (%d classes "
                    "remain)", ", ".join(shown_name(train_index.class_names[k]) for k in sorted(drop)),
                    len(train_index.class_names) - len(drop))
    if val_listed != len(val_index):
        log.warning("%s: evaluating the %d of %d listed videos that are there", val_index.source,
                    len(val_index), val_listed)
    return train_index, val_index, val_listed


def checked_flip_labels(hflip_label_map: Mapping[str, str] | None, hflip: bool,
                        class_names: Sequence[str], drop: set[int]) -> dict[int, int] | None:
    """``data.hflip_label_map`` as label numbers (``flip_label_indices``), None when unset;
    refused when it mirrors a kept class into a dropped one, or when ``data.hflip`` is off."""
    flip_labels = flip_label_indices(hflip_label_map, class_names) if hflip_label_map else None
    for a, b in (flip_labels or {}).items():
        if (a in drop) != (b in drop):  # a flipped clip would train on a class the run leaves out
            kept, dropped = (a, b) if b in drop else (b, a)
            raise ValueError(f"data.hflip_label_map mirrors the class of label {kept} into that of "
                             f"label {dropped}, which data.drop_classes leaves out: drop both or "
                             "neither")
    if flip_labels is not None and not hflip:
        raise ValueError("data.hflip_label_map is set but data.hflip=false: set data.hflip=true "
                         "to flip with relabelling, or data.hflip_label_map=null")
    return flip_labels


def make_datasets(train_index: annotations.VideoIndex, val_index: annotations.VideoIndex,
                  known_bad: frozenset[str], flip_labels: dict[int, int] | None, *,
                  num_frames: int, clip_duration: float, short_side: int, crop_size: int,
                  train_scale: Sequence[float], hflip: bool, randaugment: tuple[int, int],
                  random_erasing: float, val_clips: int, val_crops: int, decoder: str,
                  sampler: str, seed: int) -> tuple[VideoClipDataset, VideoClipDataset]:
    """The train dataset (one augmented clip per video, a bad video replaced by another) and
    the val dataset (``val_clips x val_crops`` views per video). ``clip_duration``: the seconds
    of video one clip spans; with ``flip_labels`` the dataset flips and relabels the train
    clips, and the transform does not flip them again."""
    train_ds = VideoClipDataset(
        train_index, num_frames, clip_duration,
        train_transform(short_side, crop_size, tuple(train_scale), hflip and flip_labels is None,
                        randaugment=tuple(randaugment), random_erasing=random_erasing), train=True, seed=seed,
        decoder=decoder, sampler=sampler, known_bad=known_bad, flip_labels=flip_labels,
    )
    val_ds = VideoClipDataset(
        val_index, num_frames, clip_duration,
        eval_transform(short_side, crop_size, val_crops), train=False, num_clips=val_clips, seed=seed,
        decoder=decoder, sampler=sampler,
    )
    return train_ds, val_ds


def make_loaders(train_ds: VideoClipDataset, val_ds: VideoClipDataset, batch_size: int,
                 val_batch_size: int, *, seed: int, rank: int, world_size: int, workers: int,
                 worker_timeout: float, pin_memory: bool, device_type: str,
                 ) -> tuple[DataLoader, DataLoader, ResumableSampler]:
    """The train loader (shuffled per epoch, resumable, full batches only), the val loader
    (in order, each rank its share of the videos, none repeated) and the train sampler.

    Decoding runs in worker processes that live for the whole run (persistent_workers), and
    batches land in pinned memory on CUDA so the copy to the GPU overlaps compute; there each
    worker keeps PREFETCH_CUDA batches in flight, so a slow video does not stall the step."""
    train_sampler = ResumableSampler(train_ds, shuffle=True, seed=seed, rank=rank,
                                     world_size=world_size, drop_last=True)
    val_sampler = ResumableSampler(val_ds, shuffle=False, seed=seed, rank=rank, world_size=world_size,
                                   pad=False)
    common = dict(num_workers=workers, collate_fn=collate, pin_memory=pin_memory,
                  persistent_workers=workers > 0, timeout=worker_timeout if workers > 0 else 0)
    if workers > 0 and device_type == "cuda":
        common["prefetch_factor"] = PREFETCH_CUDA
    if len(train_ds) < batch_size * world_size:
        raise ValueError(f"data.batch_size={batch_size} exceeds the {len(train_ds)} training videos")
    # Own generators: a loader without one draws its worker base seed from the global torch RNG
    # each time an iterator starts, which a resumed run would replay differently (dropout, SBP).
    train = DataLoader(train_ds, batch_size=batch_size, sampler=train_sampler, drop_last=True,
                       generator=torch.Generator().manual_seed(seed), **common)
    val = DataLoader(val_ds, batch_size=val_batch_size, sampler=val_sampler,
                     generator=torch.Generator().manual_seed(seed), **common)
    return train, val, train_sampler


def build_data(
    *,
    name: str,
    layout: str,
    root: str | None,
    num_frames: int,
    sampling_rate: int,
    fps: float,
    short_side: int,
    crop_size: int,
    train_scale: Sequence[float],
    hflip: bool,
    batch_size: int,
    val_batch_size: Annotated[int, NEUTRAL_MARK],
    num_workers: Annotated[int | str, NEUTRAL_MARK],  # auto | N
    val_clips: int,
    val_crops: int,
    max_bad_fraction: Annotated[float, NEUTRAL_MARK],
    num_classes: int | None = None,
    synthetic: dict | None = None,
    fold: int | None = None,
    train_file: str | None = None,
    val_file: str | None = None,
    path_prefix: str | None = None,
    classes_file: str | None = None,
    split_dir: str | None = None,
    video_dir: str | None = None,
    labels_file: str | None = None,
    video_ext: str | None = None,
    worker_timeout: Annotated[float, NEUTRAL_MARK] = 600,
    decoder: str = "pyav",
    sampler: str = "random",
    randaugment: tuple[int, int] = (0, 9),
    random_erasing: float = 0.0,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: bool = False,
    device_type: str = "cpu",
    preflight_train: bool = True,
    shared: Callable[[Callable[[], Any]], Any] | None = None,
    drop_classes: Sequence[str] | None = None,
    report_dir: str | Path | None = None,
    hflip_label_map: Mapping[str, str] | None = None,
) -> tuple[DataBundle, list[str]]:
    """Build train/val loaders; returns the bundle and the paths found bad by preflight.

    ``fold`` ... ``video_ext`` are reader options (``READER_OPTIONS``; None = the reader's default);
    ``decoder`` reads the videos and ``sampler`` picks their frames (``random`` windows |
    ``segment``); ``randaugment`` (ops, magnitude) and ``random_erasing`` are the recipe's per-clip
    augmentations. ``worker_timeout`` (seconds, 0 = none) bounds the wait for one batch, so a hung
    decoder fails the run. ``preflight_train=False`` skips stat-ing the training files;
    ``shared(fn)`` runs ``fn`` once and gives every process its result (under DDP only rank 0 stats
    the files). ``drop_classes``: class names left out of both splits and the metrics (labels kept);
    otherwise a class without readable videos is an error. ``hflip_label_map`` (with ``hflip``):
    class -> its mirror's class (reverse pairs implied); flipped clips are relabelled.
    ``report_dir`` receives ``missing_videos_<split>.txt``, the full lists the log only counts.
    Validation holds only the val videos that are there.
    """
    options = dict(fold=fold, train_file=train_file, val_file=val_file, path_prefix=path_prefix,
                   classes_file=classes_file, split_dir=split_dir, video_dir=video_dir,
                   labels_file=labels_file, video_ext=video_ext)
    check_data_values({k: v for k, v in locals().items() if k in DATA_VALUE_CHECKS})
    check_decoder(decoder)  # before the files are read: a wrong name or a missing extra
    check_sampler(sampler)
    path = resolve_root(name, root, synthetic, layout)
    train_index, val_index, drop = read_splits(layout, path, num_classes, options, drop_classes)
    bad = (shared or (lambda fn: fn()))(
        lambda: find_bad(train_index, val_index, drop, max_bad_fraction, preflight_train, report_dir))
    known_bad = frozenset(bad)
    train_index, val_index, val_listed = kept_videos(train_index, val_index, known_bad, drop)
    flip_labels = checked_flip_labels(hflip_label_map, hflip, train_index.class_names, drop)
    train_ds, val_ds = make_datasets(
        train_index, val_index, known_bad, flip_labels, num_frames=num_frames,
        clip_duration=num_frames * sampling_rate / fps, short_side=short_side, crop_size=crop_size,
        train_scale=train_scale, hflip=hflip, randaugment=randaugment, random_erasing=random_erasing,
        val_clips=val_clips, val_crops=val_crops, decoder=decoder, sampler=sampler, seed=seed)
    train, val, train_sampler = make_loaders(
        train_ds, val_ds, batch_size, val_batch_size, seed=seed, rank=rank, world_size=world_size,
        workers=resolve_num_workers(num_workers, device_type, world_size),
        worker_timeout=worker_timeout, pin_memory=pin_memory, device_type=device_type)
    names = train_index.class_names
    bundle = DataBundle(train, val, train_sampler, names, len(names), path, val_listed,
                        [names[k] for k in sorted(drop)])
    return bundle, bad
