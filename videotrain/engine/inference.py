"""Using a trained model: multi-view predictions for video files, and export to a deployable
graph. The entry points (``python -m videotrain.predict``, ``python -m videotrain.export``)
read the config; everything here takes plain arguments.

``predict_video``: the evaluation's views of one file (``eval.clips`` temporal clips x
``eval.crops`` spatial crops, decoded and transformed by the same dataset class as evaluation),
one forward, the views' softmax aggregated as ``eval.aggregate`` says, the top-k classes.

``export_model``: the model's evaluation forward, ``(B, T, C, H, W) -> (B, K)`` logits, traced by
``torch.export`` (saved as ``.pt2``) or by the dynamo ONNX exporter (``.onnx``), with a dynamic
batch dimension, then checked against the eager model on a second batch size.
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths
from torch import nn

from videotrain.data.annotations import VideoIndex
from videotrain.data.dataset import BadVideo, VideoClipDataset
from videotrain.data.transforms import IMAGENET_MEAN, IMAGENET_STD, clips_to_device, eval_transform
from videotrain.engine.precision import Precision
from videotrain.metrics.accuracy import aggregate_views
from videotrain.untrusted import shown
from videotrain.untrusted.files import atomic_writer, open_regular, staged_path

log = logging.getLogger(__name__)

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg", ".flv",
                    ".wmv", ".3gp", ".ogv", ".ts")
EXPORT_FORMATS = ("torch_export", "onnx")
SUFFIXES = {"torch_export": ".pt2", "onnx": ".onnx"}


@dataclass
class PredictSettings:
    """The ``predict`` config group (``python -m videotrain.predict``)."""

    out: str | None = None  # write the predictions here as JSON
    topk: int = 5  # classes listed per video

    def __post_init__(self) -> None:
        if int(self.topk) < 1:
            raise ValueError(f"predict.topk must be >= 1, got {self.topk}")


@dataclass
class ExportSettings:
    """The ``export`` config group (``python -m videotrain.export``)."""

    format: str = "torch_export"  # torch_export (.pt2) | onnx (.onnx)
    out: str | None = None  # the file to write; null: model.pt2 / model.onnx in the run folder
    batch_size: int = 2  # the example batch traced (the batch dimension stays dynamic)
    dynamic_batch: bool = True  # false: the exported model takes exactly batch_size clips
    opset: int | None = None  # onnx: the opset version (null: the exporter's default)
    check: bool = True  # compare the exported model with the eager one (max abs difference)

    def __post_init__(self) -> None:
        if self.format not in EXPORT_FORMATS:
            raise ValueError(f"export.format must be one of {', '.join(EXPORT_FORMATS)}, "
                             f"got {self.format!r}")
        if int(self.batch_size) < 1:
            raise ValueError(f"export.batch_size must be >= 1, got {self.batch_size}")


# ---------------------------------------------------------------------------- predict
def list_videos(path: Path) -> list[Path]:
    """``path`` itself (a file), or every video file under the folder ``path`` (by extension,
    recursively, sorted). Raises ``FileNotFoundError`` naming a missing path."""
    if path.is_file():
        return [path]
    if not path.exists():
        raise FileNotFoundError(f"video: no such file or folder: {path}")
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS)
    if not found:
        raise FileNotFoundError(f"video: no video files ({', '.join(VIDEO_EXTENSIONS)}) in {path}")
    return found


class UnreadableVideo(BadVideo, ValueError):
    """A video ``predict`` cannot read: a user error (one ``error:`` line, exit status 2), whose
    message names the file escaped and says why in the decoder's own words, never the file's
    (the ``BadVideo``'s step and reason: ``cannot open (InvalidDataError: Invalid data found
    when processing input)``)."""


class ViewReader:
    """Decodes one file into the evaluation's views ``(clips * crops, T, C, H, W)``, through the
    evaluation dataset's own decoding, clip sampling and transform (``decoder``, ``sampler``:
    the run's ``data.decoder``, ``data.sampler``), within its media budgets
    (``videotrain.data.media_budget``): its frames are scaled to ``short_side`` as they are
    decoded, so a 1080p or 4K video's views fit them. Raises ``UnreadableVideo`` (naming the
    file, escaped) for a missing, empty, corrupt or over-budget video."""

    def __init__(self, num_frames: int, clip_duration: float, short_side: int, crop_size: int,
                 clips: int, crops: int, decoder: str = "pyav", sampler: str = "random") -> None:
        nothing = VideoIndex(LabeledVideoPaths([]), [], "predict")  # files come one by one
        self.dataset = VideoClipDataset(
            nothing, num_frames, clip_duration, eval_transform(short_side, crop_size, crops),
            train=False, num_clips=clips, decoder=decoder, sampler=sampler)

    def __call__(self, path: Path) -> torch.Tensor:
        try:
            return self.dataset.decode_views(str(path))  # (V, T, C, H, W)
        except BadVideo as err:
            why = err.reason or shown(str(err), 200)  # a BadVideo not made by BadVideo.of
            raise UnreadableVideo(f"{shown(path)}: {err.step} ({why})") from err


@torch.no_grad()
def predict_video(model: nn.Module, views: torch.Tensor, precision: Precision,
                  device: torch.device, aggregate: str = "mean") -> torch.Tensor:
    """Class probabilities ``(K,)`` of one video from its views ``(V, T, C, H, W)``: the views'
    softmax aggregated like the evaluation's (``eval.aggregate``)."""
    model.eval()
    with precision.autocast():
        logits = model(clips_to_device(views, device))  # (V, K)
    probs = logits.float().softmax(dim=-1)[None]  # (1, V, K)
    return aggregate_views(probs, aggregate)[0].cpu()


def top_classes(scores: torch.Tensor, class_names: Sequence[str], k: int) -> list[dict[str, Any]]:
    """The ``k`` best classes of ``scores (K,)``: ``[{"class", "index", "prob"}, ...]``."""
    values, indices = scores.topk(min(k, scores.numel()))
    return [{"class": class_names[i], "index": int(i), "prob": float(v)}
            for v, i in zip(values.tolist(), indices.tolist(), strict=True)]


def format_prediction(video: str, top: list[dict[str, Any]]) -> str:
    """The lines predict prints for one video. Class names come from a checkpoint or a run's
    results.json, which a stranger may have written: they are shown escaped and cut
    (``untrusted.shown``), so a name cannot clear the screen, forge lines or write the
    clipboard (OSC 52) on the terminal."""
    names = [shown(t["class"]) for t in top]
    width = max(len(n) for n in names)
    lines = [shown(video, 400)] + [f"  {i}. {n:<{width}}  {t['prob']:.4f}"
                                   for i, (n, t) in enumerate(zip(names, top, strict=True), 1)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- export
def _onnx_modules() -> tuple[Any, Any]:
    try:
        import onnx  # noqa: F401 - the exporter needs it
        import onnxruntime
        import onnxscript  # noqa: F401 - the dynamo exporter needs it
    except ImportError as err:
        raise ImportError(f"export.format=onnx needs the 'export' extra ({err.name} is missing): "
                          "pip install 'videotrain[export]'") from err
    return onnx, onnxruntime


def export_model(model: nn.Module, example: torch.Tensor, out: Path, fmt: str,
                 dynamic_batch: bool = True, opset: int | None = None,
                 root: Path | None = None) -> Path:
    """Write ``model``'s evaluation forward for inputs shaped like ``example (B, T, C, H, W)``
    to ``out`` as ``fmt`` (``torch_export``: ``torch.export.save``; ``onnx``: input ``video``,
    output ``logits``, its weights in ``out.data`` beside it). The batch dimension is dynamic
    unless ``dynamic_batch`` is false. Every file goes through the one writer: renamed into
    place, never written through a link (``root``: the run folder ``out`` is in, where no link
    is followed either; None: ``out`` is the user's own path)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export.format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
    model.eval()
    dynamic = ({0: torch.export.Dim("batch", min=1, max=4096)},) if dynamic_batch else None
    with torch.no_grad():
        if fmt == "torch_export":
            program = torch.export.export(model, (example,), dynamic_shapes=dynamic)
            with atomic_writer(out, root) as f:
                torch.export.save(program, f)
        else:
            _onnx_modules()
            kwargs: dict[str, Any] = {} if opset is None else {"opset_version": int(opset)}
            # the exporter writes only to a path (and its weights beside it): a private folder,
            # whose files are then copied into place, the weights before the model that names them
            with staged_path(out, root) as staged:
                torch.onnx.export(model, (example,), str(staged), dynamo=True,
                                  input_names=["video"], output_names=["logits"],
                                  dynamic_shapes=dynamic, verbose=False, **kwargs)
                for extra in sorted(staged.parent.iterdir()):
                    if extra.name != staged.name:
                        with (open_regular(extra, what="exported weights") as src,
                              atomic_writer(out.with_name(extra.name), root) as dst):
                            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def run_exported(path: Path, fmt: str, video: torch.Tensor) -> torch.Tensor:
    """Logits of the exported model at ``path`` for ``video (B, T, C, H, W)`` (ONNX through
    onnxruntime on the CPU)."""
    if fmt == "torch_export":
        module = torch.export.load(path).module()
        with torch.no_grad():
            return module(video)
    _, ort = _onnx_modules()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"video": video.numpy()})
    return torch.from_numpy(logits)


def check_export(model: nn.Module, path: Path, fmt: str, example: torch.Tensor,
                 dynamic_batch: bool = True) -> float:
    """Max abs difference of the exported model's logits from the eager model's, on a batch of
    another size than the traced one when the batch is dynamic."""
    b = example.shape[0] + 1 if dynamic_batch else example.shape[0]
    video = torch.randn(b, *example.shape[1:], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(video)
    got = run_exported(path, fmt, video)
    if got.shape != want.shape:
        raise RuntimeError(f"the exported model returned {tuple(got.shape)}, expected {tuple(want.shape)}")
    diff = float((got - want).abs().max())
    if not math.isfinite(diff):
        raise RuntimeError("the exported model's output is not finite")
    return diff


def export_metadata(fmt: str, num_frames: int, crop_size: int, class_names: Sequence[str],
                    checkpoint: str, dynamic_batch: bool, batch_size: int,
                    max_abs_diff: float | None) -> dict[str, Any]:
    """What a consumer of the exported file needs to feed it (written next to it as JSON)."""
    return {
        "format": fmt,
        "input": {"name": "video", "layout": "(B, T, C, H, W)", "dtype": "float32",
                  "shape": ["B" if dynamic_batch else batch_size, num_frames, 3, crop_size, crop_size],
                  "preprocessing": "RGB frames scaled to [0, 1], resized (short side) and "
                                   "centre-cropped, then normalized with mean/std",
                  "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "output": {"name": "logits", "shape": ["B" if dynamic_batch else batch_size, len(class_names)]},
        "class_names": list(class_names),
        "checkpoint": checkpoint,
        "max_abs_diff_vs_eager": max_abs_diff,
    }
