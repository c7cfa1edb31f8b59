"""The data suite (``python -m videotrain.bench --suite data``): decoded training clips per
second through the loaders, measured in a fresh process per row like the model rows.

Rows: this project's loader (map-style ``VideoClipDataset``, PyAV decoding that seeks per
window and converts only kept frames) with 0, 1 and 2 worker processes, and pytorchvideo's own
``LabeledVideoDataset`` pipeline (``pytorchvideo.data.Kinetics`` over the same ``train.csv``,
its PyAV ``EncodedVideo`` decoder, the same random clip window, frame count and torchvision
transforms) as the peer. Both read the same synthetic files and produce the same tensors: a
batch of ``(B, T, C, crop, crop)`` float clips.

A row times one pass over the training set after its first batch (which includes starting the
workers and is reported apart as ``startup_s``); clips/s is the clips of those batches over
that time.
"""

from __future__ import annotations

import time
from typing import Any

import torch

PIPELINES = ("videotrain", "pytorchvideo")


def videotrain_loader(cfg, num_workers: int, pin_memory: bool):
    """The training loader ``python -m videotrain`` builds for ``cfg``."""
    from videotrain.build import build_data_from_cfg

    device = torch.device("cuda" if pin_memory else "cpu")
    data, _ = build_data_from_cfg(cfg, device, num_workers=num_workers)
    data.train_sampler.set_epoch(0)
    return data.train, data.root, len(data.train.dataset)


class _PeerTransform:
    """pytorchvideo sample dict -> the same clip tensor the project's loader yields."""

    def __init__(self, num_frames: int, transform) -> None:
        self.num_frames, self.transform = num_frames, transform

    def __call__(self, sample: dict) -> dict:
        from videotrain.data.decode import uniform_indices

        frames = sample["video"]  # (C, T_window, H, W) float in [0, 255]
        # what pytorchvideo.transforms.UniformTemporalSubsample does (that module cannot be
        # imported with this torchvision)
        frames = frames[:, uniform_indices(frames.shape[1], self.num_frames)]
        clip = frames.permute(1, 0, 2, 3).to(torch.uint8)  # (T, C, H, W)
        return {"video": self.transform(clip), "label": sample["label"]}


def pytorchvideo_loader(cfg, num_workers: int, pin_memory: bool):
    """``pytorchvideo.data.Kinetics`` (a ``LabeledVideoDataset``) on the same files."""
    from pytorchvideo.data import Kinetics, make_clip_sampler

    from videotrain.data.loaders import resolve_root
    from videotrain.data.transforms import train_transform

    d = cfg.data
    root = resolve_root(d.name, d.root, d.get("synthetic"), d.layout)
    clip_duration = d.num_frames * d.sampling_rate / d.fps
    dataset = Kinetics(
        data_path=str(root / "train.csv"),
        clip_sampler=make_clip_sampler("random", clip_duration),
        video_sampler=torch.utils.data.RandomSampler,
        transform=_PeerTransform(d.num_frames, train_transform(
            d.short_side, d.crop_size, tuple(d.train_scale), d.hflip)),
        video_path_prefix=str(root),
        decode_audio=False,
        decoder="pyav",
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=d.batch_size, num_workers=num_workers,
                                         pin_memory=pin_memory, drop_last=False)
    return loader, root, dataset.num_videos


def measure_data(spec: dict[str, Any]) -> dict[str, Any]:
    """Child side of one data row: ``spec`` has ``pipeline``, ``num_workers``, ``overrides``
    and ``device``."""
    if spec["pipeline"] not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {spec['pipeline']!r}")
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    from videotrain.build import compose_cfg

    cfg = compose_cfg(spec["overrides"])
    pin = str(spec["device"]).startswith("cuda")
    build = videotrain_loader if spec["pipeline"] == "videotrain" else pytorchvideo_loader
    loader, root, videos = build(cfg, int(spec["num_workers"]), pin)
    shape = None
    clips = batches = 0
    t0 = time.perf_counter()
    startup = None
    t_first = t0
    for batch in loader:
        video = batch["video"]  # (B, T, C, H, W)
        if startup is None:  # the first batch also pays for starting the workers
            startup = time.perf_counter() - t0
            shape = tuple(video.shape[1:])
            t_first = time.perf_counter()
            continue
        clips += video.shape[0]
        batches += 1
    elapsed = time.perf_counter() - t_first
    if not clips:
        raise RuntimeError(f"{spec['pipeline']}: fewer than 2 batches; use more videos or a "
                           "smaller data.batch_size")
    return {
        "clips_per_s": clips / elapsed, "clips": clips, "batches": batches, "elapsed_s": elapsed,
        "startup_s": startup, "clip_shape": shape, "videos": videos, "root": str(root),
        "batch_size": int(cfg.data.batch_size), "pin_memory": pin, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "device": str(spec["device"]),
    }
