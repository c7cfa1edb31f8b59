"""Training as configured: ``train(cfg, out_dir)``, what ``python -m videotrain`` runs. Objects
come from ``videotrain.config.build``; everything below takes plain arguments.

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

from videotrain.config.build import (
    build_data_from_cfg,
    build_eval_data,
    build_model,
    build_precision,
    check_values,
    effective_lr,
    eval_settings,
    global_batch_size,
    optimizer_from_cfg,
    plan_memory,
    recipe_settings,
    resolve_device,
    seed_everything,
    trainer_settings,
    use_sync_bn,
    user_error,
)
from videotrain.config.estimate import ConfigEstimator
from videotrain.engine import distributed
from videotrain.engine.checkpoints.run import RunCheckpoints
from videotrain.engine.distributed import Comm, DistContext, wrap_ddp
from videotrain.engine.evaluate import multi_view_test
from videotrain.engine.optim import warmup_cosine
from videotrain.engine.trainer import Trainer, plan_steps
from videotrain.memory.base import SelfPlanning
from videotrain.metrics.logger import MetricsLogger, WandbSettings
from videotrain.untrusted import check_run_folder, write_seal, write_text

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
    check_values(cfg)  # every value, before any data is read
    # a shared folder resumed from: a linked run folder, links out of it, FIFOs, devices, and
    # what cannot be listed refused before any write (every rank: each writes or reads there)
    check_run_folder(out_dir, "write into")
    comm = Comm(ctx)
    device = resolve_device(cfg.device, ctx)
    settings = trainer_settings(cfg)  # validate cheap settings before generating data
    recipe = recipe_settings(cfg)
    precision = build_precision(cfg, device)
    sync_bn = use_sync_bn(cfg, ctx, device)
    global_batch, lr = global_batch_size(cfg, ctx.world_size), effective_lr(cfg, ctx.world_size)
    seed_everything(cfg.seed, cfg.deterministic)  # the same initial weights on every rank
    data, bad = build_data_from_cfg(cfg, device, ctx.rank, ctx.world_size, report_dir=out_dir)
    model = build_model(cfg, data.num_classes, sync_bn=sync_bn, class_names=data.class_names).to(device)
    plan_memory(cfg, model, precision, device, data.num_classes, ConfigEstimator)  # memory=auto: fails here
    optimizer = optimizer_from_cfg(cfg, model, ctx.world_size)
    model = wrap_ddp(model, device, ctx)  # broadcasts rank 0's parameters and buffers
    wait = float(cfg.data.worker_timeout)
    if ctx.enabled and wait > 0:  # a rank whose batch never comes fails every rank, not hangs it
        distributed.set_collective_timeout(wait + max(10.0, 0.1 * wait))
    if ctx.enabled:  # from here on, ranks draw different dropout masks (reproducibly)
        seed_everything(cfg.seed + ctx.rank, cfg.deterministic)
    runtime = {"world_size": ctx.world_size, "global_batch_size": global_batch, "lr": lr}
    config = OmegaConf.to_container(cfg, resolve=True)  # recorded in checkpoints, guards resume
    _, total_steps = plan_steps(len(data.train), settings)
    scheduler = warmup_cosine(optimizer, total_steps, cfg.sched.warmup_steps, cfg.sched.min_lr_ratio)
    checkpoints = RunCheckpoints(out_dir, settings.keep_last_k, settings.resume, comm, device,
                                 config=config, class_names=list(data.class_names))
    # what the run resumes from (or a refusal) before anything of this run is written: a refused
    # resume leaves the run's config.yaml, metrics.jsonl and wandb run as they were
    checkpoints.find_resume()
    logger = MetricsLogger(out_dir, enabled=ctx.is_main, wandb=WandbSettings(**cfg.logger.wandb),
                           run_name=out_dir.name, config={**config, "runtime": runtime})
    try:
        # restores the checkpoint find_resume chose; config.yaml follows once that has worked
        trainer = Trainer(model, optimizer, scheduler, data, precision, settings, checkpoints,
                          logger, device, comm=comm, preflight_bad=bad, recipe=recipe)
        if ctx.is_main:
            config_text = OmegaConf.to_yaml(cfg, resolve=True)
            # the one writer, root = the run folder: a real folder, no link in it followed
            write_text(out_dir / "config.yaml", config_text, root=out_dir)
            # config.seal: this user's keyed digest of those bytes, what makes the run their own
            write_seal(out_dir / "config.yaml", config_text.encode("utf-8"), root=out_dir)
            log.info("training %s on %s x %d process(es): %d steps (%d per epoch), global batch %d "
                     "(%d per process x %d accumulated x %d), lr %g (optim.lr_scaling=%s), output in %s",
                     trainer.strategy.describe(), device, ctx.world_size, trainer.total_steps,
                     trainer.steps_per_epoch, global_batch, cfg.data.batch_size,
                     cfg.trainer.grad_accum, ctx.world_size, lr, cfg.optim.get("lr_scaling", "none"), out_dir)
        results = trainer.fit()
        results["lr"] = lr
        results["class_names"] = data.class_names
        digests = comm.all_gather(distributed.param_digest(trainer.module))
        results["replicas_in_sync"] = len(set(digests)) == 1
        results["param_digests"] = digests  # one per rank
        if not results["replicas_in_sync"]:
            log.error("DDP replicas ended with different parameters: %s", digests)
        if isinstance(trainer.strategy, SelfPlanning):
            results["memory_plan"] = trainer.strategy.plan_report()
        if settings.test_after_fit:  # the paper-style evaluation: eval.clips x eval.crops views
            # under DDP each rank tests its shard of the videos; the counts are reduced
            test_data, test_bad = build_eval_data(cfg, device, ctx, report_dir=out_dir)
            test = multi_view_test(
                trainer.module, test_data, test_bad, eval_settings(cfg), precision, device, out_dir,
                max_bad_fraction=float(cfg.data.max_bad_fraction), progress=settings.progress,
                checkpoint=str(checkpoints.files.last),
                num_frames=int(cfg.data.num_frames), crop_size=int(cfg.data.crop_size))
            results["test"] = test
            results.update({f"test_{k}": test[k] for k in
                            ("video_top1", "video_top5", "clip_top1", "mean_class_acc")})
        if ctx.is_main:
            write_text(out_dir / "results.json", json.dumps(results, indent=2) + "\n", root=out_dir)
        logger.finish(results)
        comm.barrier()  # nobody leaves (and tears the group down) before rank 0 has written
        return results
    except BaseException:
        logger.finish()
        raise
