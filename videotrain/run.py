"""Training as configured: ``train(cfg, out_dir)``, what ``python -m videotrain`` runs. It
reads top to bottom: set up the processes, build what training needs in one call
(``videotrain.config.build.build_training``, which owns the order), fit, write the results.

Under torchrun (or SLURM tasks through submitit) every process calls ``train`` with the same
config: it joins the process group, shards the data by rank, wraps the model in DDP, and only
rank 0 writes ``config.yaml``, ``metrics.jsonl``, checkpoints, ``results.json`` and wandb.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch.nn import Module

from videotrain.config.build import (
    Training,
    build_eval_data,
    build_training,
    eval_settings,
    user_error,
)
from videotrain.config.estimate import ConfigEstimator
from videotrain.engine import distributed
from videotrain.engine.checkpoints.run import RunCheckpoints
from videotrain.engine.distributed import Comm, DistContext
from videotrain.engine.evaluate import multi_view_test
from videotrain.engine.trainer import Trainer
from videotrain.memory.base import SelfPlanning
from videotrain.metrics.logger import MetricsLogger, WandbSettings
from videotrain.untrusted import write_seal, write_text

log = logging.getLogger(__name__)


def train(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Train and validate as configured; rank 0 writes config, metrics.jsonl and results.json.

    Joins the process group that torchrun or a submitit SLURM job describes (and leaves it at
    the end if it joined it here); with one process this is plain single-device training.
    """
    ctx, owns_group = distributed.init_from_env()
    try:
        return _train(cfg, Path(out_dir), ctx)
    except Exception as err:
        if not ctx.enabled:
            raise
        if user_error(err) is not None:  # a config or data error: the same type on every rank
            distributed.report_failure(ctx.rank, f"rank {ctx.rank}: {type(err).__name__}: {err}",
                                       user=True)
            raise
        named = name_the_rank(err, ctx, float(cfg.data.worker_timeout))
        if named is err:
            raise
        raise named from err
    finally:
        if owns_group:
            distributed.shutdown()


class PeerDataError(ValueError):
    """Another rank stopped on a config or data error (a ``build.USER_ERRORS``)."""


def name_the_rank(err: Exception, ctx: DistContext, worker_timeout: float) -> Exception:
    """Under DDP, say which rank failed: this rank's error goes into the process group's store,
    and a rank that gave up waiting in a collective names the ranks that reported a failure.
    A data-loader timeout becomes a message naming the rank and ``data.worker_timeout``."""
    timed_out = isinstance(err, RuntimeError) and "DataLoader timed out" in str(err)
    mine = (f"rank {ctx.rank}: no batch from its data-loader workers within "
            f"data.worker_timeout={worker_timeout:g} s (a video decode hangs, or the storage "
            f"stalls): {err}" if timed_out
            else f"rank {ctx.rank}: {type(err).__name__}: {err}".splitlines()[0])
    distributed.report_failure(ctx.rank, mine)
    peers = distributed.failed_peers(ctx.world_size, ctx.rank)
    if peers:
        failed = "; ".join(f"rank {r} failed ({m})" for r, m in sorted(peers.items()))
        # a peer's config or data error (one rank's share of bad videos, say) stays a user error:
        # rank 0 prints it as the run's one `error:` line
        user = distributed.failed_peers(ctx.world_size, ctx.rank, user=True)
        kind = PeerDataError if user else RuntimeError
        return kind(f"rank {ctx.rank} stopped because {failed}; its own error: {err}")
    return RuntimeError(mine) if timed_out else err


def _train(cfg: DictConfig, out_dir: Path, ctx: DistContext) -> dict[str, Any]:
    """Build, resume if there is a checkpoint, fit, and write ``results.json`` (rank 0)."""
    run = build_training(cfg, ctx, out_dir, ConfigEstimator)
    comm = Comm(ctx)
    config = OmegaConf.to_container(cfg, resolve=True)  # recorded in checkpoints, guards resume
    checkpoints = RunCheckpoints(out_dir, run.settings.keep_last_k, run.settings.resume, comm,
                                 run.device, config=config, class_names=list(run.data.class_names))
    # what the run resumes from (or a refusal) before anything of this run is written: a refused
    # resume leaves the run's config.yaml, metrics.jsonl and wandb run as they were
    checkpoints.find_resume()
    runtime = {"world_size": ctx.world_size, "global_batch_size": run.plan.global_batch_size,
               "lr": run.lr}
    logger = MetricsLogger(out_dir, enabled=ctx.is_main, wandb=WandbSettings(**cfg.logger.wandb),
                           run_name=out_dir.name, config={**config, "runtime": runtime})
    try:
        # restores the checkpoint find_resume chose; config.yaml follows once that has worked
        trainer = Trainer(run.model, run.optimizer, run.scheduler, run.data, run.precision,
                          run.settings, run.plan, checkpoints, logger, run.device, comm=comm,
                          preflight_bad=run.preflight_bad, recipe=run.recipe)
        if ctx.is_main:
            write_config(cfg, out_dir)
            log_start(cfg, run, ctx.world_size, out_dir)
        results = trainer.fit()
        results.update(replica_summary(run, trainer.module, comm))
        if run.settings.test_after_fit:
            results.update(evaluate_after_fit(cfg, run, trainer.module, ctx, out_dir,
                                              str(checkpoints.files.last)))
        if ctx.is_main:
            write_text(out_dir / "results.json", json.dumps(results, indent=2) + "\n", root=out_dir)
        logger.finish(results)
        comm.barrier()  # nobody leaves (and tears the group down) before rank 0 has written
        return results
    except BaseException:
        logger.finish()
        raise


def write_config(cfg: DictConfig, out_dir: Path) -> None:
    """``config.yaml`` (the resolved config) and ``config.seal`` (this user's keyed digest of
    those bytes, what makes the run their own); the one writer, root = the run folder: a real
    folder, no link in it followed."""
    config_text = OmegaConf.to_yaml(cfg, resolve=True)
    write_text(out_dir / "config.yaml", config_text, root=out_dir)
    write_seal(out_dir / "config.yaml", config_text.encode("utf-8"), root=out_dir)


def log_start(cfg: DictConfig, run: Training, world_size: int, out_dir: Path) -> None:
    """The run's first log line: strategy, device, steps, batch and learning rate."""
    log.info("training %s on %s x %d process(es): %d steps (%d per epoch), global batch %d "
             "(%d per process x %d accumulated x %d), lr %g (optim.lr_scaling=%s), output in %s",
             run.strategy.describe(), run.device, world_size, run.plan.total_steps,
             run.plan.steps_per_epoch, run.plan.global_batch_size, cfg.data.batch_size,
             cfg.trainer.grad_accum, world_size, run.lr, cfg.optim.get("lr_scaling", "none"),
             out_dir)


def replica_summary(run: Training, module: Module, comm: Comm) -> dict[str, Any]:
    """What results.json adds to the trainer's summary: the learning rate, the classes, one
    parameter digest per rank (whether the DDP replicas ended in sync) and ``memory=auto``'s
    plan. A collective: every rank calls it."""
    digests = comm.all_gather(distributed.param_digest(module))
    summary: dict[str, Any] = {"lr": run.lr, "class_names": run.data.class_names,
                               "replicas_in_sync": len(set(digests)) == 1,
                               "param_digests": digests}
    if not summary["replicas_in_sync"]:
        log.error("DDP replicas ended with different parameters: %s", digests)
    if isinstance(run.strategy, SelfPlanning):
        summary["memory_plan"] = run.strategy.plan_report()
    return summary


def evaluate_after_fit(cfg: DictConfig, run: Training, module: Module, ctx: DistContext,
                   out_dir: Path, checkpoint: str) -> dict[str, Any]:
    """The paper-style evaluation after training, ``eval.clips x eval.crops`` views per video:
    under DDP each rank tests its shard of the videos and the counts are reduced."""
    test_data, test_bad = build_eval_data(cfg, run.device, ctx, report_dir=out_dir)
    test = multi_view_test(
        module, test_data, test_bad, eval_settings(cfg), run.precision, run.device, out_dir,
        max_bad_fraction=float(cfg.data.max_bad_fraction), progress=run.settings.progress,
        checkpoint=checkpoint, num_frames=int(cfg.data.num_frames),
        crop_size=int(cfg.data.crop_size))
    return {"test": test, **{f"test_{k}": test[k] for k in
                             ("video_top1", "video_top5", "clip_top1", "mean_class_acc")}}
