"""A configured run's training step, simulated on fake tensors, each in a process of its own.

:func:`simulate_cfg` builds the run's model as training does (``build.build_model``, no weights
read), its optimizer and a full-size batch, and counts one training step and validation
forward on fake tensors (:func:`videotrain.memory.estimate.simulate_step`).
:func:`run_isolated` runs such simulations in fresh processes (two at a time, from a fork
server): ``python -m videotrain.plan --fit`` estimates its rows with it, the benchmark its
estimated column, and :class:`ConfigEstimator` is ``memory=auto``'s estimator, which the
commands hand to ``build.plan_memory`` (build does not import this module: it imports build).
"""

from __future__ import annotations

import gc
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from videotrain.config.build import build_model, compose_cfg, eval_settings, optimizer_from_cfg
from videotrain.config.files import checked_config
from videotrain.engine.precision import PRECISIONS
from videotrain.memory.estimate import StepMemory, onednn_target, simulate_step
from videotrain.models.video import VideoClassifier


def num_classes_of(cfg: DictConfig) -> int:
    """``data.num_classes`` when set; else 400 (Kinetics), which changes only the head's last
    layer: no dataset is read to plan."""
    return int(cfg.data.get("num_classes") or 400)


def simulate_cfg(cfg: DictConfig, target: str, with_eval: bool = True) -> StepMemory:
    """One training step (and validation forward) of ``cfg``'s model and batch, on fake
    tensors, for a ``target`` device type (``cuda``: AdamW/SGD take their foreach path)."""
    d = cfg.data
    b, t = int(d.batch_size), int(d.num_frames)
    size = int(d.crop_size)
    # the larger evaluation batch, in clips: validation, or the multi-view test after training
    val = int(d.get("val_batch_size") or b) * int(d.get("val_clips") or 1) * int(d.get("val_crops") or 1)
    test = int(cfg.eval.batch_size) * int(cfg.eval.clips) * int(cfg.eval.crops)
    eval_shape = (max(val, test if cfg.trainer.test_after_fit else 0), t, 3, size, size)
    classes = num_classes_of(cfg)
    # trainer.sync_bn converts BatchNorm on CUDA (with several processes, as the user intends
    # by setting it); on a single process SyncBatchNorm runs as BatchNorm, so it is simulated
    sync_bn = bool(cfg.trainer.sync_bn) and target == "cuda"

    def make_model() -> VideoClassifier:
        # training's own builder (model.freeze_backbone, SyncBatchNorm, the strategy), without
        # reading any weights: values do not change memory
        return build_model(cfg, classes, sync_bn=sync_bn, init=False)

    def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = optimizer_from_cfg(cfg, model)
        for group in optimizer.param_groups:  # CUDA tensors default to the foreach kernels
            group["foreach"] = target == "cuda"
        return optimizer

    return simulate_step(make_model, make_optimizer, (b, t, 3, size, size), classes,
                         autocast_dtype=PRECISIONS[str(cfg.trainer.precision)],
                         grad_clip=cfg.trainer.grad_clip,
                         label_smoothing=float(cfg.trainer.label_smoothing),
                         eval_video_shape=eval_shape if with_eval else None,
                         eval_frame_chunk=eval_settings(cfg).frame_chunk, onednn=onednn_target(target))


Job = tuple[list[str] | dict[str, Any], str]  # (overrides or a resolved config, target device type)


def _child(job: Job) -> dict[str, Any]:
    """Worker: one simulation in a fresh process. Automatic garbage collection stays off
    (see ``videotrain.memory.estimate``); the process ends with the task."""
    config, target = job
    gc.disable()
    t0 = time.perf_counter()
    try:
        # a resolved config from the parent is checked as one read from a file would be
        cfg = (checked_config(config, "the memory simulator's job") if isinstance(config, dict)
               else compose_cfg(config))
        return {"memory": simulate_cfg(cfg, target),
                "seconds": time.perf_counter() - t0}
    except Exception as err:  # reported per row, the other rows still run
        return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}


def run_isolated(jobs: list[Job], processes: int = 2) -> list[dict[str, Any]]:
    """Each job in a process of its own, results in the order of ``jobs``. Children come from
    a fork server that has imported this module (torch included) and run nothing else: a
    process that has run autograd cannot fork safely. Spawned where there is no fork server."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
    else:
        ctx = multiprocessing.get_context("spawn")
    # a process per task (Python >= 3.11); a worker that dies fails the call (BrokenProcessPool)
    # instead of hanging it, as multiprocessing.Pool would
    per_task = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}
    workers = max(min(processes, len(jobs)), 1)
    with ProcessPoolExecutor(workers, mp_context=ctx, **per_task) as pool:
        return list(pool.map(_child, jobs))


class ConfigEstimator:
    """``memory=auto``'s estimator: the configured run (``cfg``, with the dataset's real number
    of classes) with another ``memory:`` node, simulated in a process of its own."""

    def __init__(self, cfg: DictConfig, num_classes: int, target: str) -> None:
        base = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(base, dict)
        base["data"] = {**base["data"], "num_classes": num_classes}
        self.base, self.target = base, target

    def __call__(self, memory: dict[str, Any]) -> StepMemory:
        result = run_isolated([({**self.base, "memory": memory}, self.target)], processes=1)[0]
        if "error" in result:
            raise RuntimeError(result["error"])
        return result["memory"]
