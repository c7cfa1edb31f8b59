"""``python -m videotrain.predict checkpoint=PATH video=FILE|FOLDER [overrides]``: classify
videos with a trained model and print each one's top-``predict.topk`` classes with their
probabilities; ``predict.out=FILE.json`` also writes them.

Each video is seen the way ``python -m videotrain.eval`` sees a validation video: ``eval.clips``
temporal clips x ``eval.crops`` spatial crops, decoded and transformed by the evaluation's own
dataset class, their softmax aggregated by ``eval.aggregate``. ``video`` is one file or a folder
(every video file under it). A missing or unreadable file is an error naming it; in a folder it
is reported (and listed in the JSON's ``errors``) and the others go on.

Which model: as for ``videotrain.eval``, the training run's ``config.yaml`` next to the
checkpoint (else the config stored in the checkpoint, else the composed config) describes the
model and data; overrides on this command line replace parts of it. Either config is checked
before anything of it is built (``videotrain.config_files``); ``run_config=false`` reads
neither and builds the model from this command line's config groups. The checkpoint supplies the
weights (``model.pretrained`` / ``model.pretrained_path`` are not loaded again), and the model
runs its evaluation forward, whatever memory strategy trained it. Class names come from the
run's ``results.json``, else from the dataset's annotations, else ``class_<i>``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from videotrain.build import (
    CONFIG_DIR,
    build_model,
    build_precision,
    clean_errors,
    eval_settings,
    resolve_device,
    validate,
)
from videotrain.data.dataset import BadVideo
from videotrain.data.loaders import READER_OPTIONS, read_index, resolve_root
from videotrain.engine.class_order import saved_class_names
from videotrain.engine.inference import (
    PredictSettings,
    ViewReader,
    format_prediction,
    list_videos,
    predict_video,
    top_classes,
)
from videotrain.eval import (
    load_trained_weights,
    model_state,
    read_checkpoint,
    run_config,
)
from videotrain.models.video import VideoClassifier

log = logging.getLogger(__name__)

E2E = {"_target_": "videotrain.memory.e2e.EndToEnd"}


class Trained:
    """A checkpoint's model, ready for inference, with the config that describes it."""

    def __init__(self, cfg: DictConfig, model: VideoClassifier, class_names: list[str],
                 state: dict[str, Any], path: Path) -> None:
        self.cfg, self.model, self.class_names, self.state, self.path = cfg, model, class_names, state, path


def _num_classes(state: dict[str, Any], path: Path) -> int:
    weight = state.get("head.fc.weight")  # every head ends in a Linear `fc`: (K, D)
    if weight is None or weight.dim() != 2:
        raise ValueError(f"checkpoint {path}: cannot tell the number of classes (no head.fc.weight)")
    return int(weight.shape[0])


def class_names_of(cfg: DictConfig, run_dir: Path | None, num_classes: int,
                   blob: dict[str, Any] | None = None) -> list[str]:
    """The class names of the run: the checkpoint's, else ``results.json``'s, else the
    dataset's (for an HMDB51 checkpoint from before checkpoints recorded them, in the order it
    was trained with), else placeholders."""
    saved = (blob or {}).get("class_names")
    if isinstance(saved, list) and len(saved) == num_classes:
        return [str(n) for n in saved]
    if run_dir is not None and (run_dir / "results.json").is_file():
        names = json.loads((run_dir / "results.json").read_text()).get("class_names")
        if isinstance(names, list) and len(names) == num_classes:
            return [str(n) for n in names]
    try:
        d = cfg.data
        root = resolve_root(d.name, d.get("root"), OmegaConf.to_container(d.get("synthetic")) if
                            d.get("synthetic") is not None else None, d.layout)
        options = {k: d.get(k) for k in READER_OPTIONS.get(d.layout, ())}
        names = read_index(d.layout, root, "train", d.get("num_classes"), options).class_names
        if len(names) == num_classes:
            known, _ = saved_class_names(blob or {}, list(names), d.layout)
            return known or list(names)
        log.warning("the dataset has %d classes, the checkpoint %d", len(names), num_classes)
    except Exception as err:  # noqa: BLE001 - the dataset may not be on this machine
        log.warning("class names unknown (no results.json next to the checkpoint, and the "
                    "dataset's annotations could not be read: %s); using class_<i>", err)
    return [f"class_{i}" for i in range(num_classes)]


def load_trained(cfg: DictConfig, overrides: list[str], keep: tuple[str, ...] = (),
                 device: str | None = None) -> Trained:
    """``cfg.checkpoint``'s model (evaluation mode, on ``device``, default ``cfg.device``) and
    its run's config."""
    path, blob = read_checkpoint(cfg)
    cfg, run_dir = run_config(cfg, overrides, keep, blob)
    num_classes = _num_classes(model_state(blob), path)
    with open_dict(cfg):
        # the checkpoint holds the weights, and the evaluation forward is the same under every
        # memory strategy: build plain e2e (no SBP / checkpoint wrappers, no memory=auto planning)
        cfg.memory = E2E
    model = build_model(cfg, num_classes, init=False)
    load_trained_weights(model, blob, path)
    model.to(resolve_device(device or cfg.device)).eval()
    return Trained(cfg, model, class_names_of(cfg, run_dir, num_classes, blob), blob, path)


def predict(cfg: DictConfig, overrides: list[str] | None = None) -> dict[str, Any]:
    """Predict every video of ``cfg.video``; prints them, writes ``predict.out`` if set, and
    returns ``{"predictions": [...], "errors": [...], ...}``."""
    if not cfg.get("video"):
        raise ValueError("video=FILE (or a folder of videos) is required")
    settings = PredictSettings(**OmegaConf.to_container(cfg.predict, resolve=True))
    trained = load_trained(cfg, list(overrides or []), keep=("video", "predict"))
    cfg = trained.cfg
    ev = eval_settings(cfg)
    d = cfg.data
    reader = ViewReader(int(d.num_frames), d.num_frames * d.sampling_rate / d.fps, int(d.short_side),
                        int(d.crop_size), ev.clips, ev.crops, decoder=str(d.get("decoder", "pyav")),
                        sampler=str(d.get("sampler", "random")))  # runs from before these keys: defaults
    device = next(trained.model.parameters()).device
    precision = build_precision(cfg, device)
    source = Path(str(cfg.video)).expanduser()
    videos = list_videos(source)
    predictions: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    for path in videos:
        try:
            views = reader(path)  # (clips * crops, T, C, H, W)
        except BadVideo as err:
            if len(videos) == 1 and source.is_file():
                raise BadVideo(f"video: {err}") from err
            log.error("skipping %s", err)
            errors.append({"video": str(path), "error": str(err)})
            continue
        scores = predict_video(trained.model, views, precision, device, ev.aggregate)
        top = top_classes(scores, trained.class_names, settings.topk)
        predictions.append({"video": str(path), "top": top})
        print(format_prediction(str(path), top), flush=True)
    if errors:
        print(f"{len(errors)} of {len(videos)} videos could not be read: "
              + ", ".join(e["video"] for e in errors), flush=True)
    summary = {"checkpoint": str(trained.path), "video": str(source), "clips": ev.clips,
               "crops": ev.crops, "aggregate": ev.aggregate, "settings": asdict(settings),
               "predictions": predictions, "errors": errors}
    if settings.out:
        out = Path(settings.out).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2))
        log.info("predictions written to %s", out)
    if not predictions:
        raise BadVideo(f"video: none of the {len(videos)} videos under {source} could be read")
    return summary


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    with clean_errors():
        predict(validate(cfg), list(HydraConfig.get().overrides.task))


if __name__ == "__main__":
    main()
