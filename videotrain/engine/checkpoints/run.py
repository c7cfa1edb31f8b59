"""A training run's checkpoints, from one owner: what it resumes from, what it saves, and when.

``RunCheckpoints`` is the trainer's one contact with ``RUN/checkpoints/``. The run (``run.py``)
makes it first and asks it what the run resumes from (``find_resume``) before anything of the
run is written, so that a refused resume leaves config.yaml, metrics.jsonl and the wandb run as
they were. The trainer then calls it at a few points: ``restore`` when it is built, ``save`` at
the checkpoint steps and epoch ends, ``mark_best`` after a validation that improved val_top1, and
``save_unless_saved`` before it stops on a signal.

What a checkpoint holds (the layout ``checkpoint.FORMAT``, flat, top-level keys): the objects'
states (``Checkpointed``: model, optimizer, scheduler, scaler, strategy, EMA), the loop's progress
(``TrainState``, one key per field), every rank's RNG state, the world size, the total steps, the
resolved config and the class names. The files themselves (atomic writes, last/best links,
pruning, corrupt-file fallback) are ``videotrain.engine.checkpoints.format``'s; the config guard is
``videotrain.engine.checkpoints.resume``'s.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.checkpoints.resume import fit_problem, refusal
from videotrain.engine.distributed import Comm
from videotrain.engine.recipe import WeightEMA
from videotrain.memory.base import MemoryStrategy
from videotrain.untrusted import seal_config
from videotrain.untrusted.files import rename

log = logging.getLogger(__name__)


class ResumeRefused(ckpt.CheckpointError):
    """The checkpoint was written under a config (or world size) that trains differently."""


@dataclass
class TrainState:
    """The loop's progress. A checkpoint stores each field under its own name (``state_dict``),
    so adding a field here adds it to the checkpoint; there is no second list to keep."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # current epoch
    consumed: int = 0  # samples of the current epoch already trained on (per rank: equal on all)
    skipped: set[str] = field(default_factory=set)  # bad video paths seen so far
    step_times: list[float] = field(default_factory=list)
    data_waits: list[float] = field(default_factory=list)  # per step, waiting for batches
    peaks: list[float] = field(default_factory=list)
    last_val: dict[str, float] = field(default_factory=dict)
    val_step: int = -1  # the step last_val was computed at
    best_top1: float = -1.0  # the best val_top1 so far (best.ckpt), and its step
    best_step: int = -1

    def state_dict(self) -> dict[str, Any]:
        """Every field by name, ``skipped`` as a sorted list (a checkpoint holds no sets)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["skipped"] = sorted(self.skipped)
        return out

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Every field from ``saved`` (a checkpoint); bad videos known already (the
        preflight's) are kept alongside the saved ones."""
        known = self.skipped
        for f in fields(self):
            setattr(self, f.name, saved[f.name])
        self.skipped = known | set(saved["skipped"])


@dataclass
class Checkpointed:
    """Everything of the trainer that a checkpoint saves and restores, by reference."""

    module: torch.nn.Module  # without its DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    state: TrainState
    total_steps: int
    ema: WeightEMA | None = None

    @property
    def strategy(self) -> MemoryStrategy:
        return self.module.strategy  # the model's, looked up when used

    def state_dict(self) -> dict[str, Any]:
        out = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
               "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
               "strategy": self.strategy.state_dict(), **self.state.state_dict(),
               "total_steps": self.total_steps}
        if self.ema is not None:  # what eval, predict, export and model.init_from load
            out["ema_model"] = self.ema.state_dict()
            out["ema_updates"] = self.ema.num_updates
        return out

    def load_state_dict(self, blob: dict[str, Any]) -> None:
        self.module.load_state_dict(blob["model"])
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        self.scaler.load_state_dict(blob["scaler"])
        self.strategy.load_state_dict(blob["strategy"])
        if self.ema is not None:
            if "ema_model" in blob:
                self.ema.load(blob["ema_model"], int(blob["ema_updates"]))
            else:  # a guarded resume refuses this; trainer.resume=force restarts the average
                log.warning("the checkpoint has no EMA weights (recipe.ema_decay was off): the "
                            "EMA starts from the resumed weights")
        self.state.load_state_dict(blob)


# what restoring reads from a checkpoint: resume refuses one without them (resume.refusal)
RESUMED_FIELDS = ("model", "optimizer", "scheduler", "scaler", "strategy", "rng_per_rank",
                  *(f.name for f in fields(TrainState)))


class RunCheckpoints:
    """The checkpoints of the run in ``out_dir`` (module docstring).

    ``resume`` is ``trainer.resume`` (``videotrain.engine.checkpoints.resume``); ``config`` the run's resolved
    config as a plain dict, recorded in every checkpoint and compared on resume (without it,
    resume is not guarded); ``class_names`` the dataset's, recorded and checked likewise. Every
    method is called on every rank; rank 0 decides and writes, the others follow.
    """

    def __init__(self, out_dir: str | Path, keep_last_k: int | None, resume: str, comm: Comm,
                 device: torch.device, config: dict[str, Any] | None = None,
                 class_names: list[str] | None = None) -> None:
        self.out_dir = Path(out_dir)
        # every folder operation below the run folder: no link followed (untrusted.files)
        self.files = ckpt.CheckpointDir(self.out_dir / "checkpoints", keep_last_k, root=self.out_dir)
        self.resume, self.comm, self.device = resume, comm, device
        self.config, self.class_names = config, class_names
        # this user's seal of the stored config: eval, predict and export read it as their own
        self.config_seal = seal_config(config) if config is not None else None
        self.saved_step = -1  # the step of the last save or of the resumed checkpoint (every rank)
        self.last_path: Path | None = None  # the file the last save wrote (rank 0)
        self._best_pending = False  # the last validation improved val_top1: the next save is best
        self._decided = False
        self._resume_path: str | None = None  # find_resume's answer
        self._blob: dict[str, Any] | None = None  # its contents, until restored

    def find_resume(self) -> str | None:
        """The checkpoint this run resumes from, as ``trainer.resume`` says, or None for a fresh
        start; decided once (later calls return the same answer).

        Rank 0 finds, loads and checks it (``CheckpointDir.load_newest``: a corrupt newest file
        falls back to the previous one; ``resume.refusal``: the config guard, ``ResumeRefused``)
        and every rank follows, so that all ranks resume, start fresh, or fail together. Under
        ``trainer.resume=false`` the previous run's checkpoints and metrics are set aside.
        """
        if self._decided:
            return self._resume_path
        self._decided = True
        if self.resume == "false":
            if self.comm.is_main:
                self._set_aside_previous_run()
            self.comm.barrier()
            return None
        loaded: list[dict[str, Any]] = []

        def newest() -> str | None:  # rank 0's decision; its error is raised on every rank
            self.files.clean_temporaries()
            found = self.files.load_newest(map_location=self.device)
            if found is None:
                return None
            path, blob = found
            why = refusal(blob, path, self.config, self.comm.world_size, self.resume,
                          class_names=self.class_names, required=RESUMED_FIELDS)
            if why:
                raise ResumeRefused(why)
            loaded.append(blob)
            return str(path)

        path = self.comm.from_main(newest)
        if path is None:
            return None
        blob = loaded[0] if loaded else None
        if blob is None:  # ranks other than 0 read the file rank 0 chose
            if not Path(path).is_file():
                raise FileNotFoundError(f"rank {self.comm.rank} cannot read rank 0's checkpoint "
                                        f"{path}: under DDP the output directory must be on a "
                                        "shared filesystem")
            blob = ckpt.check_training_checkpoint(ckpt.load(path, map_location=self.device), path)
        self._resume_path, self._blob = path, blob
        return path

    def restore(self, parts: Checkpointed) -> bool:
        """Load the checkpoint ``find_resume`` chose into ``parts`` and this rank's RNGs;
        False (nothing changed) for a fresh start."""
        path, blob = self.find_resume(), self._blob
        if path is None or blob is None:
            return False
        self._blob = None  # the weights are in the model now: do not hold a second copy
        why = fit_problem(blob, path, parts.module, parts.optimizer,
                          parts.ema.module if parts.ema is not None else None)
        if why:  # before anything is loaded: the keys escaped, not torch's raw error
            raise ResumeRefused(why)
        parts.load_state_dict(blob)
        # the loaders draw worker seeds from their own generators, not the global RNG, so the
        # restored state is exactly where the uninterrupted run was at this step; each rank
        # takes its own (dropout masks differ per rank), or rank 0's if the world size changed
        per_rank = blob["rng_per_rank"]
        ckpt.set_rng_state(per_rank[self.comm.rank] if len(per_rank) == self.comm.world_size
                           else per_rank[0])
        st = parts.state
        self.saved_step = st.step
        if self.comm.is_main:
            log.info("resumed from %s at step %d (epoch %d)", path, st.step, st.epoch)
            if blob.get("total_steps", parts.total_steps) != parts.total_steps:
                log.warning("training now ends at step %d, not %d as when %s was written "
                            "(trainer.max_epochs / max_steps changed): the learning-rate schedule "
                            "follows the new end from step %d on", parts.total_steps,
                            blob["total_steps"], path, st.step)
        return True

    def mark_best(self) -> None:
        """The validation just run improved val_top1: the next save also writes best.ckpt."""
        self._best_pending = True

    def save(self, parts: Checkpointed) -> Path | None:
        """Called on every rank at the same steps: gathers per-rank state, rank 0 writes
        ``step-N.ckpt`` (and points last.ckpt at it; best.ckpt too after ``mark_best``) and
        returns its path."""
        rngs = self.comm.all_gather(ckpt.rng_state())
        skipped = set().union(*self.comm.all_gather(sorted(parts.state.skipped)))
        best, self._best_pending = self._best_pending, False
        self.saved_step = parts.state.step
        if not self.comm.is_main:
            return None
        blob = {ckpt.FORMAT_KEY: ckpt.FORMAT, **parts.state_dict(), "rng_per_rank": rngs,
                "world_size": self.comm.world_size, "skipped": sorted(skipped),
                "config": self.config, "config_seal": self.config_seal,
                "class_names": self.class_names}  # head row k scores class_names[k]
        self.last_path = self.files.save(blob, parts.state.step, best=best)
        return self.last_path

    def save_unless_saved(self, parts: Checkpointed) -> Path | None:
        """The checkpoint of the current step (what a preempted run resumes from): written now
        unless this step's is written already. Its path on rank 0, None on the others."""
        if self.saved_step != parts.state.step:
            self.save(parts)
        return self.last_path

    def _set_aside_previous_run(self) -> None:
        """``trainer.resume=false``: start over. The old checkpoints move to
        ``checkpoints.replaced-DATE-TIME/`` and metrics.jsonl to
        ``metrics.replaced-DATE-TIME.jsonl``: kept for the user, never loaded."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = self.files.set_aside(f"replaced-{stamp}")
        metrics = self.out_dir / "metrics.jsonl"
        has_metrics = os.path.lexists(metrics)  # the name itself: a link is moved, not followed
        if moved is not None or has_metrics:
            log.warning("trainer.resume=false: starting over in %s; the previous run's "
                        "checkpoints (%s) and metrics.jsonl are kept with the suffix replaced-%s "
                        "and not loaded", self.out_dir, moved or "none", stamp)
        if has_metrics:
            rename(metrics, self.out_dir / f"metrics.replaced-{stamp}.jsonl", self.out_dir)
