"""``python -m videotrain.export checkpoint=PATH export.format=torch_export|onnx [export.out=FILE]``:
a trained model as a deployable graph, ``video (B, T, C, H, W)`` (normalized) -> ``logits (B, K)``.

What is exported is the evaluation forward, built as plain e2e (strategies change only
training), with a dynamic batch dimension (``export.dynamic_batch``): ``torch_export`` writes a
``.pt2``, ``onnx`` an ``.onnx`` (the ``export`` extra). ``export.check=true`` loads the file back
and compares its logits with the eager model's at another batch size; ``FILE.json`` records the
input shape, normalization, class names and that difference. The run is loaded by
``videotrain.config.trained_run``, as for eval and predict."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from videotrain.config.build import CONFIG_DIR, clean_errors, validate
from videotrain.config.trained_run import load_trained
from videotrain.engine.inference import (
    SUFFIXES,
    ExportSettings,
    check_export,
    export_metadata,
    export_model,
)
from videotrain.untrusted import shown_name, write_text

log = logging.getLogger(__name__)


def export(cfg: DictConfig, overrides: list[str] | None = None,
           out_dir: str | Path | None = None) -> dict[str, Any]:
    """Export ``cfg.checkpoint`` as ``cfg.export`` says; returns the metadata written beside it
    (with ``path``)."""
    settings = ExportSettings(**OmegaConf.to_container(cfg.export, resolve=True))
    trained = load_trained(cfg, list(overrides or []), keep=("export",), device="cpu")
    model = trained.model.cpu().eval()
    model.eval_frame_chunk = None  # one backbone call over every frame: a static graph
    d = trained.cfg.data
    t, size = int(d.num_frames), int(d.crop_size)
    example = torch.randn(settings.batch_size, t, 3, size, size,
                          generator=torch.Generator().manual_seed(0))  # (B, T, C, H, W)
    suffix = SUFFIXES[settings.format]
    # export.out is the user's own path (followed as given); else the run folder, where no link
    # is followed at any component (the one writer refuses it)
    out = Path(settings.out).expanduser() if settings.out else Path(out_dir or ".") / f"model{suffix}"
    root = None if settings.out else Path(out_dir or ".")
    log.info("exporting %s (%s) to %s: input (B, %d, 3, %d, %d), %d classes", trained.path,
             settings.format, out, t, size, size, len(trained.class_names))
    export_model(model, example, out, settings.format, settings.dynamic_batch, settings.opset, root)
    diff = None
    if settings.check:
        diff = check_export(model, out, settings.format, example, settings.dynamic_batch)
        log.info("exported model vs eager: max abs difference of the logits %.3g", diff)
    names = [shown_name(n) for n in trained.class_names]  # read from files: escaped and cut
    meta = export_metadata(settings.format, t, size, names, str(trained.path),
                           settings.dynamic_batch, settings.batch_size, diff)
    write_text(Path(f"{out}.json"), json.dumps(meta, indent=2), root)  # a link there: replaced
    print(f"wrote {out} ({settings.format}; input video (B, {t}, 3, {size}, {size}) -> logits "
          f"(B, {len(trained.class_names)}))", flush=True)
    return {**meta, "path": str(out)}


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    with clean_errors():
        export(validate(cfg), list(hc.overrides.task), hc.runtime.output_dir)


if __name__ == "__main__":
    main()
