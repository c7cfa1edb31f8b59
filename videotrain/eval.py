"""``python -m videotrain.eval checkpoint=PATH [overrides]``: evaluate a trained model the way
papers report it, with ``eval.clips`` temporal clips x ``eval.crops`` spatial crops per video
(Kinetics convention 10 x 3) and the views' softmax aggregated by ``eval.aggregate``.

It writes ``eval.json`` (clip- and video-level top-1/top-5, mean class accuracy, the views,
skipped videos), ``per_class.csv`` and ``confusion.png`` into the Hydra run directory. The
same evaluation runs at the end of training with ``trainer.test_after_fit=true``.

Which model: ``videotrain.config.trained_run`` loads it, as for ``videotrain.predict`` and
``videotrain.export``: the checkpoint first (``torch.load(weights_only=True)``: a file that
needs arbitrary unpickling is refused and nothing in it runs), then the run folder's
``config.yaml`` (``RUN/checkpoints/``), else the config stored in the checkpoint, with only the
overrides given to this command replacing parts of it, so ``checkpoint=PATH`` alone evaluates
what was trained (on its own val split). Either config is checked before anything of it is used
(``videotrain.config.files``: refused naming the key, exit status 2). Without either, or with
``run_config=false``, the composed config must describe the trained model; the checkpoint then
supplies only the weights. The number of classes is the dataset's, and a head that numbers them
in another order is refused (``videotrain.engine.checkpoints.class_order``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from videotrain.config.build import (
    CONFIG_DIR,
    build_eval_data,
    build_precision,
    check_values,
    clean_errors,
    eval_settings,
    resolve_device,
    validate,
)
from videotrain.config.trained_run import open_run, read_checkpoint, trained_model
from videotrain.engine.checkpoints.class_order import check_class_order
from videotrain.engine.evaluate import multi_view_test

log = logging.getLogger(__name__)


def evaluate_checkpoint(cfg: DictConfig, out_dir: str | Path,
                        checkpoint: tuple[Path, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Load ``cfg.checkpoint`` (or the ``(path, contents)`` already read by ``read_checkpoint``)
    into the configured model and run the multi-view evaluation."""
    path, blob = checkpoint or read_checkpoint(cfg)  # first, before any data is read
    check_values(cfg)
    device = resolve_device(cfg.device)
    precision = build_precision(cfg, device)
    settings = eval_settings(cfg)  # bad eval.* values fail before any data is read
    data, bad = build_eval_data(cfg, device, report_dir=out_dir)
    # a head trained on another numbering of the classes would score every video wrongly
    check_class_order(blob, path, data.class_names, cfg.data.get("layout"), "evaluate")
    model = trained_model(cfg, blob, path, device, data.num_classes)
    return multi_view_test(model, data, bad, settings, precision, device, out_dir,
                           max_bad_fraction=float(cfg.data.max_bad_fraction),
                           progress=bool(cfg.trainer.progress), checkpoint=str(path),
                           num_frames=int(cfg.data.num_frames), crop_size=int(cfg.data.crop_size))


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    with clean_errors():
        return run_eval(validate(cfg), list(hc.overrides.task), hc.runtime.output_dir)


def run_eval(cfg: DictConfig, overrides: list[str], out_dir: str | Path) -> float:
    """What the command runs: the checkpoint (``weights_only``), then its run's checked config
    (``run_config``) with the command line's ``overrides`` over it, then
    ``evaluate_checkpoint``; returns the video top-1."""
    run = open_run(cfg, overrides, scores_data=True)  # a dataset only the user chooses
    log.info("evaluation settings: %s", asdict(eval_settings(run.cfg)))
    summary = evaluate_checkpoint(run.cfg, out_dir, (run.path, run.state))
    return summary["video_top1"]


if __name__ == "__main__":
    main()
