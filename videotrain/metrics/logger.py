"""Metric sinks: ``metrics.jsonl`` (always, on rank 0) and wandb (``logger.wandb.mode``).

The JSONL file is the source of truth for scripts; wandb is for people. On resume, lines
logged after the checkpoint being resumed are dropped so the file reads as one clean run.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from pathlib import Path
from typing import Any

from videotrain.untrusted import open_append, read_text, write_text

log = logging.getLogger(__name__)

WANDB_MODES = ("offline", "online", "disabled")
MAX_METRICS_BYTES = 1 << 30  # metrics.jsonl read back on resume: at most 1 GiB


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    def __init__(
        self,
        out_dir: str | Path,
        enabled: bool = True,
        wandb_mode: str = "disabled",
        wandb_project: str = "videotrain",
        run_name: str | None = None,
        config: dict | None = None,
    ) -> None:
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"logger.wandb.mode must be one of {WANDB_MODES}, got {wandb_mode!r}")
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.path = self.out_dir / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if wandb_mode != "disabled":
            import wandb  # imported lazily: it is slow to import and optional at run time

            id_file = self.out_dir / "wandb_run_id"
            run_id = (read_text(id_file, 1024, "wandb_run_id").strip() if id_file.exists()
                      else uuid.uuid4().hex[:12])
            if not run_id.isalnum():
                raise ValueError(f"{id_file}: not a wandb run id (letters and digits)")
            write_text(id_file, run_id)
            self._wandb = wandb.init(
                project=wandb_project, mode=wandb_mode, dir=str(self.out_dir), name=run_name,
                id=run_id, resume="allow", config=config, reinit="finish_previous",
            )

    def truncate_after(self, step: int) -> None:
        """Drop lines with ``step > step`` (written after the checkpoint we resume from)."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        text = read_text(self.path, MAX_METRICS_BYTES, "metrics.jsonl")  # a regular file only
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line:
                continue
            try:
                row = json.loads(line)
                row_step = row.get("step", 0) if isinstance(row, dict) else None
            except ValueError:
                row_step = None
            if not isinstance(row_step, int):  # never echoed: the file may be someone else's
                raise ValueError(f"{self.path}:{lineno}: expected a JSON object with an integer "
                                 "'step' (a metrics.jsonl line)")
            if row_step <= step:
                kept.append(line)
        write_text(self.path, "".join(ln + "\n" for ln in kept))  # replaces a link, never follows

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open_append(self.path) as f:  # O_NOFOLLOW: a link there is refused
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def finish(self, summary: dict[str, Any] | None = None) -> None:
        """Always called at the end of a job, so Hydra multirun starts each job cleanly."""
        if self._wandb is not None:
            if summary:
                self._wandb.summary.update({k: _clean(v) for k, v in summary.items()})
            self._wandb.finish()
            self._wandb = None
