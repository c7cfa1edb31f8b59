"""Metric sinks: ``metrics.jsonl`` (always, on rank 0) and wandb (``logger.wandb.mode``).

The JSONL file is the source of truth for scripts; wandb is for people. On resume, lines
logged after the checkpoint being resumed are dropped so the file reads as one clean run.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from videotrain import NEUTRAL
from videotrain.untrusted import open_append, read_text, write_text
from videotrain.untrusted.bounds import ANY, MAX_METRICS_BYTES, MAX_STEPS, Int, Map
from videotrain.untrusted.files import atomic_writer, make_dirs
from videotrain.untrusted.formats import read_jsonl

log = logging.getLogger(__name__)

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class WandbSettings:
    """``logger.wandb``: offline needs no account (``wandb sync`` uploads later); online needs
    an API key; disabled writes metrics.jsonl only."""

    mode: str = "offline"
    project: str = "videotrain"

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"logger.wandb.mode must be one of {WANDB_MODES}, got {self.mode!r}")


@dataclass
class LoggerSettings:
    """The ``logger`` config group, declared once (its schema is derived from it)."""

    # where a run logs changes nothing it computes: resume-neutral
    wandb: WandbSettings = field(default_factory=WandbSettings, metadata=NEUTRAL)
# a metrics.jsonl line as resume reads it back: its step (bytes and lines are bounded first)
METRICS_ROW = Map({"step": Int(0, MAX_STEPS)}, required=("step",), extra=ANY)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """``metrics.jsonl`` in ``out_dir`` (on the process where ``enabled``), mirrored to wandb as
    ``wandb`` says (None: no wandb)."""

    def __init__(
        self,
        out_dir: str | Path,
        enabled: bool = True,
        wandb: WandbSettings | None = None,
        run_name: str | None = None,
        config: dict | None = None,
    ) -> None:
        wandb = wandb or WandbSettings(mode="disabled")
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.path = self.out_dir / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        # every file here through the one writer, root = the run folder (no link followed)
        make_dirs(self.out_dir, root=self.out_dir)
        if wandb.mode != "disabled":
            import wandb as wandb_lib  # imported lazily: it is slow to import and optional at run time

            id_file = self.out_dir / "wandb_run_id"
            try:
                run_id = read_text(id_file, 1024, "wandb_run_id").strip()
            except FileNotFoundError:
                run_id = uuid.uuid4().hex[:12]
            if not run_id.isalnum() or len(run_id) > 64:
                raise ValueError(f"{id_file}: not a wandb run id (up to 64 letters and digits)")
            write_text(id_file, run_id, root=self.out_dir)
            # wandb writes into RUN/wandb/ itself: a new run folder of its own each start, and
            # links it replaces (never writes through); run_folder.check_run_folder's rule
            self._wandb = wandb_lib.init(
                project=wandb.project, mode=wandb.mode, dir=str(self.out_dir), name=run_name,
                id=run_id, resume="allow", config=config, reinit="finish_previous",
            )

    def truncate_after(self, step: int) -> None:
        """Drop lines with ``step > step`` (written after the checkpoint we resume from)."""
        if not self.enabled or not self.path.exists():
            return
        # a regular file, its bytes and lines bounded before a line is parsed, each line's step
        # checked; the kept lines streamed into the new file (the old one stays on an error)
        rows = read_jsonl(self.path, METRICS_ROW, MAX_METRICS_BYTES, what="metrics.jsonl")
        with atomic_writer(self.path, self.out_dir) as out:
            for _, line, row in rows:
                if row["step"] <= step:
                    out.write(line + b"\n")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open_append(self.path, root=self.out_dir) as f:  # a link there is refused
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
