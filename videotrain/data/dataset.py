"""A map-style clip dataset over ``LabeledVideoPaths``: ``clip_sampling`` chooses the frames
(``data.sampler``), ``decode`` (PyAV) or ``decode_torchcodec`` (``data.decoder``) decodes them.

Map-style so a ``DistributedSampler`` shards it and a loader resumes mid-epoch. Every item's
randomness comes from a seed of ``(seed, epoch, index)``, so a step sees the same pixels for any
worker count and after a resume. A broken video is replaced in training (the batch reports its
path in ``skipped``) and never scored in evaluation; its message names the file escaped. The
decoders scale each kept frame to the transform's short side as it becomes RGB. Why:
docs/design/internals.md#the-clip-dataset."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from videotrain.data.annotations import VideoIndex
from videotrain.data.clip_sampling import check_sampler, clip_windows, segment_indices
from videotrain.data.decode import check_decoder, open_video
from videotrain.data.decode_torchcodec import DecoderUnavailable
from videotrain.data.transforms import frame_short_side
from videotrain.untrusted import shown

log = logging.getLogger(__name__)


class SampleKey(NamedTuple):
    index: int
    epoch: int


class BadVideo(RuntimeError):
    """A video that cannot be decoded into a clip. Made by :meth:`of`: ``path`` (as listed),
    ``step`` (``cannot open`` / ``cannot decode``) and ``reason`` (the error's type and fixed
    text, escaped), and a message of the three with the path escaped."""

    path: str = ""
    step: str = "cannot read"
    reason: str = ""

    @classmethod
    def of(cls, path: str, step: str, err: BaseException) -> BadVideo:
        bad = cls(f"{shown(Path(path))}: {step} ({(reason := error_text(err, path))})")
        bad.path, bad.step, bad.reason = path, step, reason
        return bad


def error_text(err: BaseException, path: str) -> str:
    """``err`` as a bad video's reason: its type and text, escaped and cut, without the file's
    name. An OS or FFmpeg error's text is its ``strerror`` (``str`` appends the name, raw);
    any other's has the name, where it quotes it, replaced."""
    text = getattr(err, "strerror", None)
    if not isinstance(text, str) or not text:
        text = str(err).replace(repr(path), "the file").replace(path, "the file") if path else str(err)
    return f"{type(err).__name__}: {shown(text, 400)}"


class VideoClipDataset(torch.utils.data.Dataset):
    """Returns ``{"video": (V, T, C, H, W) or (T, C, H, W), "label", "index", "skipped"}``;
    with this project's transforms the video is uint8, normalized later on the training device
    (``videotrain.data.transforms.clips_to_device``).

    Training items are one random clip; evaluation items stack ``clips x crops`` views
    (``V``), uniformly spaced in time, for video-level aggregation. ``sampler`` and ``decoder``
    are ``data.sampler`` (``random`` | ``segment``) and ``data.decoder`` (``pyav`` |
    ``torchcodec``); an unknown name, or torchcodec not installed, fails here.
    """

    def __init__(
        self,
        index: VideoIndex,
        num_frames: int,
        clip_duration: float,
        transform: Callable[[torch.Tensor], torch.Tensor],
        train: bool,
        num_clips: int = 1,
        seed: int = 0,
        max_retries: int = 20,
        decoder: str = "pyav",
        sampler: str = "random",
        known_bad: frozenset[str] = frozenset(),
        flip_labels: Mapping[int, int] | None = None,
    ) -> None:
        check_decoder(decoder)
        check_sampler(sampler)
        self.decoder, self.sampler = decoder, sampler
        self.index = index
        self.num_frames = num_frames
        self.clip_duration = clip_duration
        self.transform = transform  # (T, C, H, W) uint8 -> (V_crops, T, C, h, w) or (T, C, h, w)
        self.short_side = frame_short_side(transform)  # its first step, made as frames are decoded
        self.train = train
        self.num_clips = num_clips
        self.seed = seed
        self.max_retries = max_retries
        # missing or empty files the preflight found (already counted and reported): training
        # replaces them by a video known to be there, without trying to open them each epoch
        self.known_bad = known_bad
        self._good = ([i for i, (p, _) in enumerate(index.paths) if p not in known_bad]
                      if known_bad else None)
        # label-aware horizontal flip (``data.hflip_label_map``, training only): half of the
        # clips are mirrored and take the label of the mirrored action (left <-> right);
        # labels missing from the map are their own mirror
        self.flip_labels = dict(flip_labels) if flip_labels is not None and train else None

    def __len__(self) -> int:
        return len(self.index)

    def _decode(self, path: str) -> list[torch.Tensor]:
        """Decode the clips of one video: a list of uint8 ``(T, C, H, W)`` tensors."""
        try:
            video = open_video(path, self.decoder)
        except DecoderUnavailable:
            raise  # a setup error, not a bad video
        except Exception as err:  # missing, empty, not a container, no video stream, ...
            raise BadVideo.of(path, "cannot open", err) from err
        try:
            clips_per_video = 1 if self.train else self.num_clips
            if self.sampler == "segment":  # T frames spread over the whole video
                picks = segment_indices(video.frame_count(), self.num_frames, self.train, clips_per_video)
                clips = video.frames_at([p.tolist() for p in picks], self.short_side)  # (T, H, W, C)
            else:  # T frames of a window of clip_duration seconds
                duration = video.duration if video.duration is not None else video.measure_duration()
                windows = clip_windows(duration, self.clip_duration, self.train, clips_per_video)
                clips = video.clips(windows, self.num_frames, self.short_side)  # (T, H, W, C)
            return [torch.from_numpy(c).permute(0, 3, 1, 2) for c in clips]  # (T, C, H, W)
        except Exception as err:  # truncated stream, decoder error, no frames, over a budget, ...
            raise BadVideo.of(path, "cannot decode", err) from err
        finally:
            video.close()

    def decode_views(self, path: str) -> torch.Tensor:
        """The video at ``path`` as an item holds it: one clip ``(T, C, H, W)`` (training) or
        the ``clips x crops`` views ``(V, T, C, H, W)`` (evaluation; ``videotrain.predict``
        reads files this way). Raises ``BadVideo`` naming the file."""
        views = [self.transform(c) for c in self._decode(path)]
        if self.train:
            return views[0]  # (T, C, H, W)
        # each view is (crops, T, C, H, W) -> (clips * crops, T, C, H, W)
        return torch.cat([v if v.dim() == 5 else v[None] for v in views])

    def _load(self, idx: int, seed: int) -> tuple[torch.Tensor, int]:
        path, info = self.index.paths[idx]
        state = random.getstate()
        with torch.random.fork_rng(devices=[]):
            random.seed(seed)
            torch.manual_seed(seed)
            try:
                video = self.decode_views(path)
                label = int(info["label"])
                if self.flip_labels is not None and torch.rand(()) < 0.5:
                    video, label = video.flip(-1), self.flip_labels.get(label, label)  # (T, C, H, W)
            finally:
                random.setstate(state)
        return video, label

    def __getitem__(self, key: SampleKey | int) -> dict:
        idx, epoch = (key, 0) if isinstance(key, int) else key
        if not self.train:  # evaluation scores this video or none: never another in its place
            try:
                video, label = self._load(idx, hash((self.seed, epoch, idx, 0)) & 0x7FFF_FFFF)
            except BadVideo as err:
                log.warning("not evaluating bad video %s", err)
                path = str(self.index.paths[idx][0])
                return {"video": None, "label": -1, "index": idx, "skipped": [path]}
            return {"video": video, "label": label, "index": idx, "skipped": []}
        skipped: list[str] = []
        candidate = idx
        for attempt in range(self.max_retries + 1):
            seed = hash((self.seed, epoch, idx, attempt)) & 0x7FFF_FFFF
            if self._good and self.index.paths[candidate][0] in self.known_bad:
                skipped.append(str(self.index.paths[candidate][0]))
                candidate = self._good[random.Random(seed).randrange(len(self._good))]
                continue
            try:
                video, label = self._load(candidate, seed)
                return {"video": video, "label": label, "index": candidate, "skipped": skipped}
            except BadVideo as err:
                log.warning("skipping bad video %s", err)
                skipped.append(str(self.index.paths[candidate][0]))
                candidate = random.Random(seed).randrange(len(self))
        raise RuntimeError(
            f"{self.index.source}: {self.max_retries + 1} videos in a row failed to decode; "
            f"last: {shown(Path(skipped[-1]))}"
        )


def collate(items: list[dict]) -> dict:
    """Stack videos and labels; concatenate the lists of skipped paths. Evaluation items of bad
    videos (``video`` None) are left out: a batch may hold fewer videos, or none (``video``
    None)."""
    good = [it for it in items if it["video"] is not None]
    video = None
    if good:  # (B, T, C, H, W), contiguous: decoded frames come (H, W, C), the model's layout is its own
        first = good[0]["video"]
        video = torch.stack([it["video"] for it in good],
                            out=first.new_empty((len(good), *first.shape)))
    return {
        "video": video,
        "label": torch.tensor([it["label"] for it in good], dtype=torch.long),
        "index": torch.tensor([it["index"] for it in good], dtype=torch.long),
        "skipped": [p for it in items for p in it["skipped"]],
    }
