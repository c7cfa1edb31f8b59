"""``python -m videotrain.predict checkpoint=PATH video=FILE|FOLDER [overrides]``: classify
videos with a trained model and print each one's top-``predict.topk`` classes with their
probabilities; ``predict.out=FILE.json`` also writes them.

Each video is seen the way ``python -m videotrain.eval`` sees a validation video (``eval.clips``
x ``eval.crops`` views by the evaluation's own dataset class, aggregated by ``eval.aggregate``).
``video`` is one file or a folder; a missing or unreadable file is an error naming it, and in a
folder it is reported (the JSON's ``errors``) while the others go on. The model is loaded by
``videotrain.config.trained_run``, as for eval: its config is checked before anything of it is
built, the checkpoint supplies the weights, and the model runs its evaluation forward whatever
strategy trained it. Which config and which class names: ``docs/design/internals.md``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from videotrain.config.build import (
    CONFIG_DIR,
    build_precision,
    clean_errors,
    eval_settings,
    validate,
)
from videotrain.config.trained_run import load_trained
from videotrain.data.dataset import BadVideo
from videotrain.engine.inference import (
    PredictSettings,
    UnreadableVideo,
    ViewReader,
    format_prediction,
    list_videos,
    predict_video,
    top_classes,
)
from videotrain.untrusted import shown, shown_name, write_text

log = logging.getLogger(__name__)


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
    # read from a checkpoint, results.json or a dataset's files: escaped and cut on the terminal,
    # in the log and in predict.out alike
    names = [shown_name(n) for n in trained.class_names]
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
                raise UnreadableVideo(f"video: {err}") from err  # one error: line, exit 2
            log.error("skipping %s", err)
            errors.append({"video": str(path), "error": str(err)})
            continue
        scores = predict_video(trained.model, views, precision, device, ev.aggregate)
        top = top_classes(scores, names, settings.topk)
        predictions.append({"video": str(path), "top": top})
        print(format_prediction(str(path), top), flush=True)
    if errors:
        print(f"{len(errors)} of {len(videos)} videos could not be read: "
              + ", ".join(shown(Path(e["video"])) for e in errors), flush=True)
    summary = {"checkpoint": str(trained.path), "video": str(source), "clips": ev.clips,
               "crops": ev.crops, "aggregate": ev.aggregate, "settings": asdict(settings),
               "predictions": predictions, "errors": errors}
    if settings.out:
        out = Path(settings.out).expanduser()  # the user's own path: its folder created if missing
        write_text(out, json.dumps(summary, indent=2))  # replaces a link there, never follows it
        log.info("predictions written to %s", out)
    if not predictions:
        raise UnreadableVideo(f"video: none of the {len(videos)} videos under {source} could be read")
    return summary


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    with clean_errors():
        predict(validate(cfg), list(HydraConfig.get().overrides.task))


if __name__ == "__main__":
    main()
