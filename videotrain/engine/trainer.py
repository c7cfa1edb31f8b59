"""The training loop, in one readable place.

The loop never branches on the memory strategy: the model owns it. The loop owns the
bookkeeping: gradient accumulation, clipping, mixed precision, per-step peak memory and step
time, checkpoints at optimizer-step boundaries with exact resume (the sampler's position, every
sample seeded by ``(seed, epoch, index)``, RNG states saved), bad-video accounting and logs.
Under DDP every rank runs this loop on its shard; accumulation skips the all-reduce before the
last micro-batch, logged metrics are reduced over ranks, rank 0 writes. Checkpoints go through
``engine.checkpoints.run``; preemption (``engine.preempt``) stops after the current step with a
checkpoint and exit 75. Details: docs/design/internals.md#the-training-loop."""

from __future__ import annotations

import logging
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from videotrain.data.loaders import DataBundle
from videotrain.data.preflight import check_bad_fraction
from videotrain.data.transforms import clips_to_device
from videotrain.engine.checkpoints.run import Checkpointed, RunCheckpoints, TrainState
from videotrain.engine.distributed import Comm
from videotrain.engine.evaluate import evaluate
from videotrain.engine.precision import Precision
from videotrain.engine.preempt import StopSignals, agreed_stop, stop_run
from videotrain.engine.recipe import BatchMix, RecipeSettings, WeightEMA, soft_target_loss
from videotrain.engine.settings import TrainerSettings
from videotrain.memory.base import StepObserver
from videotrain.memory.compiled import Compiler, compile_model, wants_compile
from videotrain.metrics.logger import MetricsLogger
from videotrain.metrics.memory import StepPeakMemory, cpu_meter_reads_high, keep_freed_memory
from videotrain.untrusted import shown

log = logging.getLogger(__name__)


def plan_steps(batches_per_epoch: int, settings: TrainerSettings) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps) for the LR schedule and the loop."""
    per_epoch = batches_per_epoch // settings.grad_accum
    if per_epoch < 1:
        raise ValueError(
            f"{batches_per_epoch} batches per epoch is fewer than trainer.grad_accum="
            f"{settings.grad_accum}; lower data.batch_size or trainer.grad_accum"
        )
    by_epochs = settings.max_epochs * per_epoch
    return per_epoch, min(settings.max_steps or by_epochs, by_epochs)


@dataclass(frozen=True)
class StepPlan:
    """How long a run trains and on how many clips a step learns: computed once, when the run
    is built (``videotrain.config.build.build_training``), and read by the LR schedule, the
    loop, the start-up log line and the results."""

    steps_per_epoch: int  # optimizer steps
    total_steps: int
    # samples per epoch (per rank) that feed full optimizer steps; a tail smaller than
    # grad_accum micro-batches is dropped rather than leaking half-accumulated gradients
    epoch_samples: int
    global_batch_size: int  # clips per optimizer step over all ranks: what the learning rate sees

    @classmethod
    def of(cls, batches_per_epoch: int, batch_size: int, settings: TrainerSettings,
           global_batch_size: int) -> StepPlan:
        """The plan for ``batches_per_epoch`` micro-batches of ``batch_size`` clips per rank."""
        per_epoch, total = plan_steps(batches_per_epoch, settings)
        return cls(per_epoch, total, per_epoch * settings.grad_accum * batch_size, global_batch_size)


class Trainer:
    """The loop. ``checkpoints`` owns the run's checkpoints (``RunCheckpoints``): the trainer
    restores from it when built (the checkpoint the run resumes from, if any, RNG states
    included), saves through it at the checkpoint steps and epoch ends, and asks it for the
    stop's checkpoint when a signal stops training.

    ``fit`` raises ``Preempted`` (a ``SystemExit`` with code ``EXIT_PREEMPTED`` = 75) when a
    SIGTERM, SIGUSR1 or SIGUSR2 stopped training after a checkpoint (module docstring).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        data: DataBundle,
        precision: Precision,
        settings: TrainerSettings,
        plan: StepPlan,
        checkpoints: RunCheckpoints,
        logger: MetricsLogger,
        device: torch.device,
        comm: Comm | None = None,
        preflight_bad: list[str] | None = None,
        recipe: RecipeSettings | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.data, self.precision, self.s, self.plan = data, precision, settings, plan
        self.checkpoints, self.logger, self.device = checkpoints, logger, device
        self.comm = comm or Comm()
        self.is_main = self.comm.is_main
        self.signals = StopSignals()  # installed by fit
        self.state = TrainState(skipped=set(preflight_bad or []))
        self.meter = StepPeakMemory(device)
        self.metered_here = 0  # steps this process metered (see _meters)
        if device.type == "cpu" and cpu_meter_reads_high():
            log.warning("this process trained unmetered steps before this run (an earlier job of a "
                        "multirun?): its CPU peak memory reads high, by more with every earlier job; "
                        "trainer.cpu_metered_steps=null in every job meters exactly, at 2-2.5x "
                        "the CPU step time (docs/benchmarks.md#how-peak-memory-is-measured)")
        self._split_paths: dict[str, set[str]] = {}  # per split, for its own bad fraction
        # the recipe's batch-level parts (videotrain.engine.recipe): MixUp / CutMix, weight EMA
        recipe = recipe or RecipeSettings()
        self.mix = BatchMix(recipe, data.num_classes) if recipe.mixes else None
        self.ema = WeightEMA(self.module, recipe.ema_decay) if recipe.ema_decay else None
        # what every checkpoint holds; a resumed run continues from here (the RNG states too:
        # nothing draws random numbers between this and fit)
        self.parts = Checkpointed(self.module, optimizer, scheduler, precision.scaler, self.state,
                                  plan.total_steps, self.ema)
        self.resumed = checkpoints.restore(self.parts)
        if wants_compile(settings.compile, device.type):  # after the EMA's copy: it stays eager
            compile_model(self.module, Compiler(settings.compile_mode))

    @property
    def module(self) -> torch.nn.Module:
        """The model without its DDP wrapper (what checkpoints and evaluation use)."""
        return getattr(self.model, "module", self.model)

    @property
    def strategy(self):
        return self.module.strategy

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train to the end (from where the run's checkpoints left it) and return ``results()``.
        While it runs, SIGTERM / SIGUSR1 / SIGUSR2 stop it at the next optimizer-step boundary
        with a checkpoint and ``Preempted`` (exit code 75); see the module docstring."""
        st, s, total = self.state, self.s, self.plan.total_steps
        # metrics.jsonl as of the checkpoint: rows logged after it go (and a fresh start drops
        # the rows of a run that died before its first checkpoint)
        self.logger.truncate_after(st.step)
        with StopSignals() as self.signals:
            while st.step < total and st.epoch < s.max_epochs:
                finished = self.train_epoch()
                if finished:
                    st.epoch += 1
                    st.consumed = 0
                if not finished or st.epoch % s.val_every_n_epochs == 0 or st.step >= total:
                    self.validate()
                self.checkpoints.save(self.parts)
                self._stop_if_requested()
            if st.val_step != st.step:  # e.g. resumed from a mid-epoch checkpoint at the last step
                self.validate()
                self.checkpoints.save(self.parts)
            self._stop_if_requested()
        return self.results()

    def train_epoch(self) -> bool:
        """One (possibly resumed) epoch. Returns False when ``max_steps`` stopped it early."""
        st, s = self.state, self.s
        batch_size = self.data.train.batch_size
        self.data.train_sampler.set_epoch(st.epoch, skip=st.consumed)
        self.model.train()
        # zeroed in place, not freed: re-allocating the gradient buffers inside the epoch's first
        # step would count them in that step's peak, which measures only what a step adds
        self.optimizer.zero_grad(set_to_none=False)
        # data_wait: time between asking the loader for a batch and getting it, summed over the
        # step's micro-batches; step time excludes it, so the two add up to the wall time.
        # loss_sum stays on the device until the step's end: reading it after each backward
        # would make the host wait for the GPU before it could queue the optimizer's kernels
        micro, loss_sum, data_wait = 0, None, 0.0
        bar = tqdm(total=self.plan.steps_per_epoch, initial=st.consumed // batch_size // s.grad_accum,
                   desc=f"epoch {st.epoch}", disable=not (s.progress and self.is_main), leave=False)
        t_data = time.perf_counter()
        for batch in self.data.train:
            if st.consumed >= self.plan.epoch_samples:
                break
            waited = time.perf_counter() - t_data
            data_wait += waited
            self._note_skipped(batch["skipped"], self.data.train.dataset, "train split")
            if micro == 0:
                metered = self._meters()
                if metered:
                    self.meter.start()
                t_step, waited_in_step = time.perf_counter(), 0.0
            else:
                waited_in_step += waited
            video = clips_to_device(batch["video"], self.device)  # (B, T, C, H, W) float32
            labels = batch["label"].to(self.device, non_blocking=True)
            with self._sync_context(last_micro=micro + 1 == s.grad_accum):
                loss = self._loss(video, labels)
                self.precision.backward(loss / s.grad_accum)
            # (), on the device; the first loss starts the sum (no zero tensor to fill and add to)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            micro += 1
            st.consumed += batch_size
            if micro < s.grad_accum:
                t_data = time.perf_counter()
                continue
            grad_norm = self._optimizer_step()
            if self.ema is not None:
                self.ema.update(self.module)
            if self.device.type == "cuda":  # the step's one wait for the device: its time
                torch.cuda.synchronize(self.device)
            st.step_times.append(time.perf_counter() - t_step - waited_in_step)
            st.data_waits.append(data_wait)
            peak = self._stop_meter() if metered else None
            if peak is not None:
                st.peaks.append(peak)
            st.step += 1
            if peak is not None and isinstance(self.strategy, StepObserver):
                self.strategy.observe_step(st.step, peak)  # e.g. memory=auto re-checks its plan
            bar.update(1)
            train_loss = float(loss_sum) / s.grad_accum  # after the sync: no wait
            bar.set_postfix(loss=f"{train_loss:.3f}")
            if st.step % s.log_every_n_steps == 0 or st.step == 1:  # same steps on all ranks
                mean = self.comm.reduce({"train_loss": train_loss}, "mean")
                slowest = self.comm.reduce({"step_time_s": st.step_times[-1],
                                            "data_wait_s": data_wait, "peak_mem_mb": peak}, "max")
                row = {**mean, "lr": max(self.scheduler.get_last_lr()), "epoch": st.epoch,
                       **slowest, "skipped_videos": len(st.skipped)}
                if grad_norm is not None:
                    row["grad_norm"] = float(grad_norm)
                self.logger.log(row, st.step)
            micro, loss_sum, data_wait = 0, None, 0.0
            if s.checkpoint_every_n_steps and st.step % s.checkpoint_every_n_steps == 0:
                self.checkpoints.save(self.parts)
            self._stop_if_requested(bar)  # a step boundary: stop here if a rank got a signal
            if st.step >= self.plan.total_steps:
                break
            t_data = time.perf_counter()
        bar.close()
        return st.consumed >= self.plan.epoch_samples

    def validate(self) -> dict[str, float]:
        """Validate the model (``val_*``) and, with ``recipe.ema_decay``, its EMA
        (``val_ema_*``). best.ckpt follows val top-1 of the weights the run ships: the EMA's
        when there is one, else the model's."""
        self.comm.sync_buffers(self.module)
        peak = self.train_peak_mb()
        models = {"val": self.module}
        if self.ema is not None:
            self.comm.sync_buffers(self.ema.module)
            models["val_ema"] = self.ema.module
        metrics: dict[str, float] = {}
        for prefix, model in models.items():
            if peak is not None:  # evaluation (eval.frame_chunk=auto) stays within training's peak
                model.eval_memory_budget = peak * 2**20
            got = evaluate(model, self.data.val, self.precision, self.device,
                           progress=self.s.progress and self.is_main, num_classes=self.data.num_classes,
                           on_skipped=lambda p: self._note_skipped(p, self.data.val.dataset, "val split"))
            metrics.update({prefix + k[len("val"):]: v for k, v in got.items()})
        st = self.state
        st.last_val, st.val_step = metrics, st.step
        shipped = metrics["val_ema_top1" if self.ema is not None else "val_top1"]
        if shipped is not None and shipped > st.best_top1:
            st.best_top1, st.best_step = shipped, st.step
            self.checkpoints.mark_best()  # the save that follows writes best.ckpt
        self.logger.log({**metrics, "epoch": self.state.epoch}, self.state.step)
        if self.is_main:
            log.info("step %d epoch %d: val top1 %.3f top5 %.3f (clip top1 %.3f) over %d of %d "
                     "listed videos%s", st.step, st.epoch, metrics["val_top1"], metrics["val_top5"],
                     metrics["val_clip_top1"], metrics["val_videos"],
                     self.data.val_listed or len(self.data.val.dataset),
                     f"; EMA top1 {metrics['val_ema_top1']:.3f}" if self.ema is not None else "")
        return metrics

    # ---------------------------------------------------------------- its parts
    def _loss(self, video: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets: torch.Tensor = labels  # (B,) class indices, or (B, K) probabilities when mixed
        if self.mix is not None:
            video, targets = self.mix(video, labels)
        with self.precision.autocast():
            logits = self.model(video)  # (B, K)
        return soft_target_loss(logits, targets, self.s.label_smoothing)

    def _optimizer_step(self) -> torch.Tensor | None:
        """Unscale, clip, step, zero the gradients; returns the gradient norm before clipping
        (a device tensor, read by the caller after the step's sync) when clipping is on."""
        scaler = self.precision.scaler
        grad_norm = None
        if self.s.grad_clip:
            scaler.unscale_(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.s.grad_clip)  # (), on the device
        scaler.step(self.optimizer)
        scaler.update()
        # gradients stay allocated between steps (like weights and optimizer state), so the
        # per-step peak measures what the memory strategy controls: activations and transients
        self.optimizer.zero_grad(set_to_none=False)
        self.scheduler.step()
        return grad_norm

    def _sync_context(self, last_micro: bool):
        """DDP all-reduces gradients in every backward; within an accumulation only the last
        micro-batch needs it (``no_sync`` lets the others accumulate locally)."""
        no_sync = getattr(self.model, "no_sync", None)
        return nullcontext() if last_micro or no_sync is None else no_sync()

    def _note_skipped(self, paths: list[str], dataset, source: str) -> None:
        if paths:
            # logged here too, not only by the dataset: a worker process's log may not reach
            # the run's log (e.g. with the spawn start method), the main process's always does
            what = "not evaluated" if source == "val split" else "another clip took its place"
            for path in dict.fromkeys(p for p in paths if p not in self.state.skipped):
                log.warning("bad video skipped (%s): %s", what, shown(Path(path)))
            self.state.skipped.update(paths)
            if source not in self._split_paths:  # bad videos of the other split don't count
                self._split_paths[source] = {p for p, _ in dataset.index.paths}
            num_bad = len(self.state.skipped & self._split_paths[source])
            check_bad_fraction(num_bad, len(dataset), source, self.s.max_bad_fraction)

    def _meters(self) -> bool:
        """Whether this step's peak memory is metered. On CUDA always (the allocator keeps
        statistics anyway). On CPU the meter makes every large allocation a fresh mapping that
        is handed back when freed (``videotrain.metrics.memory``), which slows the step (see
        docs/benchmarks.md), so with ``cpu_metered_steps=N`` only this
        process's first N steps are metered: a step's peak is the same from step 2 on (same
        shapes, same number of kept frames). A strategy that observes every step's peak
        (``memory=auto``) keeps the meter throughout."""
        limit = self.s.cpu_metered_steps
        if self.device.type != "cpu" or limit is None or isinstance(self.strategy, StepObserver):
            return True
        return self.metered_here < limit

    def _stop_meter(self) -> float | None:
        peak = self.meter.stop()
        self.metered_here += 1
        if not self._meters():  # the last metered step (CPU, with a limit, no observer)
            # glibc keeps freed memory from now on (a later meter's start() puts its setting back)
            keep_freed_memory()
            log.info("peak memory metered on the first %d steps; the rest run without the CPU "
                     "meter's allocator setting (trainer.cpu_metered_steps)", self.metered_here)
        return peak

    def _stop_if_requested(self, bar: tqdm | None = None) -> None:
        """At a step boundary: when any rank got a stop signal, checkpoint this step (unless
        its checkpoint is written) and stop (``videotrain.engine.preempt.stop_run``)."""
        signum = agreed_stop(self.signals, self.comm)
        if signum is None:
            return
        if bar is not None:
            bar.close()
        path = self.checkpoints.save_unless_saved(self.parts)
        st = self.state
        stop_run(signum, self.signals, self.comm, path, (st.step, st.epoch, st.consumed),
                 (self.data.train, self.data.val))

    # ---------------------------------------------------------------- the summary
    def train_peak_mb(self) -> float | None:
        """The largest measured step peak of this process (step 1 left out: it also allocates
        gradients and optimizer state), or None before any metered step."""
        peaks = self.state.peaks[1:] or self.state.peaks
        return max(peaks) if peaks else None

    def results(self) -> dict[str, Any]:
        """The run's summary, reduced over ranks (a collective: call it on every rank)."""
        st = self.state
        times = st.step_times[1:] or st.step_times  # the first step pays for lazy allocations
        waits = st.data_waits[1:] or st.data_waits  # the first wait includes worker start-up
        slowest = self.comm.reduce({"step_time_s": statistics.median(times) if times else None,
                                    "train_peak_mem_mb": self.train_peak_mb(),
                                    "data_wait_s": statistics.median(waits) if waits else None},
                                   "max")
        step_time, data_wait = slowest["step_time_s"], slowest["data_wait_s"]
        if data_wait is not None and step_time and data_wait > 0.25 * step_time and self.is_main:
            log.warning("data loading is a bottleneck: a step waits %.3f s for its batch and "
                        "computes for %.3f s (median); raise data.num_workers", data_wait, step_time)
        skipped = set().union(*self.comm.all_gather(sorted(st.skipped)))
        return {
            **st.last_val,
            "train_peak_mem_mb": slowest["train_peak_mem_mb"],  # the largest over steps and ranks
            "step_time_s": float("nan") if step_time is None else step_time,
            "clips_per_s": self.plan.global_batch_size / step_time if step_time else None,
            "data_wait_s": data_wait,
            "world_size": self.comm.world_size,
            "batch_size_per_process": self.data.train.batch_size,
            "global_batch_size": self.plan.global_batch_size,
            "memory_strategy": self.strategy.describe().get("strategy"),
            "memory": self.strategy.describe(),
            "skipped_videos": len(skipped),
            "skipped_paths": sorted(skipped),
            "epochs": st.epoch,
            "steps": st.step,
            "best_val_top1": st.best_top1 if st.best_step >= 0 else None,  # best.ckpt's
            "best_step": st.best_step if st.best_step >= 0 else None,
            "num_classes": self.data.num_classes,
            "val_videos_listed": self.data.val_listed or len(self.data.val.dataset),
            "dropped_classes": list(self.data.dropped_classes),
            "device": str(self.device),
            "precision": self.precision.key,
        }
