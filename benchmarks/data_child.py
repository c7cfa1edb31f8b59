"""One data row measured in its own process (``python -m benchmarks.data --child SPEC`` runs
``measure_data``): the loader ``python -m videotrain`` trains or validates with, or
pytorchvideo's ``LabeledVideoDataset`` on the same files, built from the row's config, and the
clips/s it delivers.

A row times a fixed number of clips (``timed_clips``), not a pass over the set, after the
first wave of batches (one per worker, started together, so including worker start-up; it is
reported apart as ``startup_s``). Batches go to workers round-robin, so the timed batches are
whole waves: every worker has delivered as many, and no prefetched batch is counted for free.
Test clips count ``data.val_clips`` per video (each with ``data.val_crops`` crops), so that
both loaders' figures are temporal clips per second.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

LOADERS = ("videotrain", "pytorchvideo")
# Clips timed per row by default (test: 6 videos of 10 clips), 5-25 s a row on 2 cores.
TIMED_CLIPS = {"train": 64, "test": 60}
# What every data row runs at, under the user's overrides: the training recipe of the paper
# experiments (16 frames at stride 4, RandomResizedCrop to 224; 10 x 3 views at test).
PIPELINE_OVERRIDES = (
    "data=kinetics",
    "data.num_frames=16",
    "data.sampling_rate=4",
    "data.short_side=256",
    "data.crop_size=224",
    "data.val_clips=10",
    "data.val_crops=3",
    "data.batch_size=4",
    "data.val_batch_size=1",
    "logger.wandb.mode=disabled",
)


def set_overrides(root: str, fps: float) -> list[str]:
    """The overrides that point the kinetics reader at a clip set (``clips.ensure_clip_set``)."""
    return [*PIPELINE_OVERRIDES, f"data.root={root}", f"data.fps={fps:g}"]


def unavailable(spec: dict[str, Any], data_cfg: Any) -> str | None:
    """Why a backend cannot run here (None: it can): its module does not import
    (``module``), or the data key its variant sets is not in this version's config
    (``needs``)."""
    module = spec.get("module")
    if module:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - ImportError, or a library that fails to load
            return f"not installed ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
    needs = spec.get("needs")
    if needs and needs not in data_cfg:
        return f"unavailable: this version has no data.{needs} option"
    return None



# ---------------------------------------------------------------------- the loaders
def videotrain_loader(cfg, pipeline: str, num_workers: int, pin_memory: bool):
    """The loader ``python -m videotrain`` trains (``train``) or validates (``test``) with.
    Returns ``(loader, start_epoch, videos, clips_per_item)``."""
    from videotrain.config.build import build_data_from_cfg

    device = torch.device("cuda" if pin_memory else "cpu")
    data, _ = build_data_from_cfg(cfg, device, num_workers=num_workers)
    if pipeline == "train":
        def start(epoch: int) -> None:
            data.train_sampler.set_epoch(epoch)
        return data.train, start, len(data.train.dataset), 1
    return data.val, lambda epoch: None, len(data.val.dataset), int(cfg.data.val_clips)


class _PeerTransform:
    """pytorchvideo sample dict -> the same clip tensor the project's loader yields."""

    def __init__(self, num_frames: int, transform) -> None:
        self.num_frames, self.transform = num_frames, transform

    def __call__(self, sample: dict) -> dict:
        from videotrain.data.clip_sampling import uniform_indices

        frames = sample["video"]  # (C, T_window, H, W) float in [0, 255]
        # what pytorchvideo.transforms.UniformTemporalSubsample does (that module cannot be
        # imported with this torchvision)
        frames = frames[:, uniform_indices(frames.shape[1], self.num_frames)]
        clip = frames.permute(1, 0, 2, 3).to(torch.uint8)  # (T, C, H, W)
        # train: (T, C, crop, crop); test: (crops, T, C, crop, crop)
        return {"video": self.transform(clip), "label": sample["label"]}


def pytorchvideo_loader(cfg, pipeline: str, num_workers: int, pin_memory: bool):
    """``pytorchvideo.data.Kinetics`` (a ``LabeledVideoDataset``) on the same files: a random
    clip per video (train), or ``ConstantClipsPerVideoSampler(clip_duration, val_clips)``, one
    item per clip with ``val_crops`` crops (test). Returns what ``videotrain_loader`` does."""
    from pytorchvideo.data import Kinetics, make_clip_sampler

    from videotrain.data.loaders import resolve_root
    from videotrain.data.transforms import eval_transform, train_transform

    d = cfg.data
    root = resolve_root(d.name, d.root, d.get("synthetic"), d.layout)
    clip_duration = d.num_frames * d.sampling_rate / d.fps
    if pipeline == "train":
        csv, sampler, video_sampler = "train.csv", make_clip_sampler("random", clip_duration), \
            torch.utils.data.RandomSampler
        transform = train_transform(d.short_side, d.crop_size, tuple(d.train_scale), d.hflip)
        batch_size = d.batch_size
    else:
        csv, video_sampler = "val.csv", torch.utils.data.SequentialSampler
        sampler = make_clip_sampler("constant_clips_per_video", clip_duration, d.val_clips)
        transform = eval_transform(d.short_side, d.crop_size, d.val_crops)
        batch_size = d.val_batch_size * d.val_clips  # as many clips as a videotrain batch
    dataset = Kinetics(
        data_path=str(root / csv), clip_sampler=sampler, video_sampler=video_sampler,
        transform=_PeerTransform(d.num_frames, transform), video_path_prefix=str(root),
        decode_audio=False, decoder="pyav",
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                         pin_memory=pin_memory, drop_last=False)
    return loader, lambda epoch: None, dataset.num_videos, 1


def batches(loader, start) -> Iterator[torch.Tensor]:
    """The loader's ``video`` tensors, epoch after epoch (a tiny set runs out)."""
    epoch = 0
    while True:
        start(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch["video"]
        if empty:
            raise RuntimeError("the loader yields no batches")
        epoch += 1


def stop_workers(loader, stream) -> None:
    """End the loader's worker processes now. Left to the interpreter's exit, a persistent
    iterator is collected late, and joining each worker then times out (5 s a worker)."""
    stream.close()
    it = getattr(loader, "_iterator", None)  # persistent_workers keeps the iterator here
    if it is not None and hasattr(it, "_shutdown_workers"):
        loader._iterator = None
        it._shutdown_workers()


def timed_batches(timed_clips: int, clips_per_batch: int, workers: int) -> int:
    """Batches to time: enough for ``timed_clips`` clips, in whole waves of ``workers``."""
    waves = math.ceil(timed_clips / (clips_per_batch * workers))
    return max(waves, 1) * workers


# ---------------------------------------------------------------------- one row
def measure_data(spec: dict[str, Any]) -> dict[str, Any]:
    """Child side of one data row: ``spec`` has ``loader``, ``pipeline``, ``num_workers``,
    ``overrides`` (the set's, the user's, the backend's), ``timed_clips`` and ``device``."""
    if spec["loader"] not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, got {spec['loader']!r}")
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    from videotrain.config.build import compose_cfg

    cfg = compose_cfg(spec["overrides"])
    reason = unavailable(spec, cfg.data)
    if reason:
        return {"unavailable": reason}
    pipeline, workers = spec.get("pipeline", "train"), int(spec["num_workers"])
    pin = str(spec["device"]).startswith("cuda")
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    build = videotrain_loader if spec["loader"] == "videotrain" else pytorchvideo_loader
    t0 = time.perf_counter()
    loader, start, videos, clips_per_item = build(cfg, pipeline, workers, pin)
    stream = batches(loader, start)
    wave = max(workers, 1)
    first = [next(stream) for _ in range(wave)]  # the first wave also starts the workers
    startup = time.perf_counter() - t0
    per_batch = first[0].shape[0] * clips_per_item
    n = timed_batches(int(spec.get("timed_clips") or TIMED_CLIPS[pipeline]), per_batch, wave)
    clips = 0
    t1 = time.perf_counter()
    for _ in range(n):
        clips += next(stream).shape[0] * clips_per_item
    elapsed = time.perf_counter() - t1
    # one clip as the model gets it: train (T, C, h, w); test (crops, T, C, h, w) per clip
    shape = tuple(first[0].shape[1:])
    if spec["loader"] == "videotrain" and pipeline == "test":
        shape = (shape[0] // clips_per_item, *shape[1:])
    stop_workers(loader, stream)
    return {
        "clips_per_s": clips / elapsed, "clips_per_s_per_worker": clips / elapsed / wave,
        "clips": clips, "batches": n, "elapsed_s": elapsed, "startup_s": startup,
        "clip_shape": shape, "videos": videos, "batch_size": int(first[0].shape[0]),
        "pin_memory": pin, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "device": str(spec["device"]), "load_avg_start": load_avg,
        "decoder": cfg.data.get("decoder"), "sampler": cfg.data.get("sampler"),
    }
