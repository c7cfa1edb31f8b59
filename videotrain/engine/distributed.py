"""Data-parallel plumbing: joining the process group a launcher set up, and the few collectives
a run needs.

Launchers: ``torchrun`` exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` to every worker. SLURM tasks started by submitit (``hydra/launcher=slurm``)
export none of these, so ``export_submitit_env`` derives them from the job (first node as the
master, a port from the job id) before the group is joined. Either way the group is joined
with ``init_method=env://``.

Backend: ``gloo`` on a machine without CUDA; with CUDA, ``cpu:gloo,cuda:nccl``, so gradients
and CUDA tensors go through NCCL while small CPU-side bookkeeping (metrics, RNG states, object
collectives) goes through gloo and never needs a device copy.

Everything here is a no-op with one process, so the single-process path stays the default.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

# Set in every worker to rank 0's clock (seconds since the epoch); read by `launch_time`.
LAUNCH_TIME_ENV = "VIDEOTRAIN_LAUNCH_TIME"


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job: rank, world size and rank on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


SINGLE_PROCESS = DistContext()


def env_context() -> DistContext:
    """The context torchrun (or ``export_submitit_env``) described in the environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    return DistContext(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))


def export_submitit_env() -> None:
    """Inside a multi-task submitit job (SLURM, or the local executor), export torchrun-style
    variables so that ``env://`` works. Not needed (and not done) when ``RANK`` is set."""
    if "RANK" in os.environ or not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    import submitit  # present whenever SUBMITIT_EXECUTOR is set (we run inside its job)

    if submitit.JobEnvironment().num_tasks > 1:
        # keep CUDA_VISIBLE_DEVICES as SLURM set it; the device is chosen from LOCAL_RANK
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(timeout_min: float = 30.0) -> tuple[DistContext, bool]:
    """Join the process group described by the environment, if any and not joined yet.

    Returns the context and whether this call created the group (the caller then owns
    ``shutdown``).
    """
    export_submitit_env()
    ctx = env_context()
    if not ctx.enabled:
        return ctx, False
    if dist.is_initialized():
        if dist.get_world_size() != ctx.world_size or dist.get_rank() != ctx.rank:
            raise RuntimeError("an initialized process group disagrees with RANK/WORLD_SIZE")
        return ctx, False
    dist.init_process_group(backend(), init_method="env://", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(minutes=timeout_min))
    log.info("joined process group: rank %d of %d (%s)", ctx.rank, ctx.world_size, backend())
    return ctx, True


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def resolve_device(name: str, ctx: DistContext = SINGLE_PROCESS) -> torch.device:
    """``device=auto|cpu|cuda|cuda:N``. Under DDP each process takes ``cuda:LOCAL_RANK`` (modulo
    the visible devices, for clusters that show each task only its own GPU)."""
    if name == "cpu":
        return torch.device("cpu")
    if name not in ("auto", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {name!r}")
    if not torch.cuda.is_available():
        if name == "auto":
            return torch.device("cpu")
        raise ValueError(f"device={name!r} but CUDA is not available; use device=auto or cpu")
    if name.startswith("cuda:"):
        if ctx.enabled:
            raise ValueError(f"device={name} pins every DDP process to one GPU; use device=auto "
                             "or cuda (each process then uses cuda:LOCAL_RANK)")
        device = torch.device(name)
    else:
        device = torch.device("cuda", ctx.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


# ---------------------------------------------------------------- one run directory for all ranks


def share_launch_time(ctx: DistContext) -> float:
    """Broadcast rank 0's clock and store it in ``VIDEOTRAIN_LAUNCH_TIME`` on every rank, so
    ``${launch_time:...}`` in ``hydra.run.dir`` names one directory, not one per rank (ranks
    start up to seconds apart)."""
    stamp = torch.tensor([time.time()], dtype=torch.float64)
    if ctx.enabled:
        dist.broadcast(stamp, src=0)  # a CPU tensor: gloo
    os.environ[LAUNCH_TIME_ENV] = repr(float(stamp))
    return float(stamp)


def from_main_process(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its result broadcast to every rank (just ``fn()`` without a process
    group): for what every rank must share, such as the run directory or which files exist.
    An exception on rank 0 is raised on every rank (so none waits for a result forever)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as err:
            box = [("error", err)]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


# ---------------------------------------------------------------- a failing rank, named
FAILED_KEY = "videotrain/failed/"


def set_collective_timeout(seconds: float) -> None:
    """How long a rank waits in a collective for the others (the process group's timeout),
    so that when one rank fails or hangs the others fail too instead of waiting 30 minutes."""
    if dist.is_available() and dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def report_failure(rank: int, message: str, user: bool = False) -> None:
    """Leave ``message`` in the process group's store, where the other ranks look when their
    collective times out (see :func:`failed_peers`); ``user``: a config or data error, which
    the run reports as one ``error:`` line. Best effort: the store may be gone."""
    if dist.is_available() and dist.is_initialized():
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{FAILED_KEY}{rank}", message[:2000])
            if user:
                store.set(f"{FAILED_KEY}user/{rank}", "1")
        except Exception:  # noqa: BLE001 (the original error matters, not this one)
            pass


def failed_peers(world_size: int, me: int, user: bool = False) -> dict[int, str]:
    """The other ranks that reported a failure, with their messages (``user``: only those that
    reported a config or data error)."""
    found: dict[int, str] = {}
    if not (dist.is_available() and dist.is_initialized()):
        return found
    try:
        store = dist.distributed_c10d._get_default_store()
        for r in range(world_size):
            keys = [f"{FAILED_KEY}{r}"] + ([f"{FAILED_KEY}user/{r}"] if user else [])
            if r != me and store.check(keys):
                found[r] = store.get(f"{FAILED_KEY}{r}").decode()
    except Exception:  # noqa: BLE001
        pass
    return found


def launch_time(pattern: str) -> str:
    """OmegaConf resolver ``${launch_time:%H-%M-%S}``: like Hydra's ``${now:...}``, but the
    same instant on every DDP rank (see ``share_launch_time``)."""
    stamp = os.environ.get(LAUNCH_TIME_ENV)
    when = datetime.fromtimestamp(float(stamp)) if stamp else datetime.now()
    return when.strftime(pattern)


# ---------------------------------------------------------------- collectives for the trainer


class Comm:
    """The collectives the trainer needs, as plain-Python calls; identities with one process."""

    def __init__(self, ctx: DistContext = SINGLE_PROCESS) -> None:
        self.ctx = ctx
        self.active = ctx.enabled and dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def rank(self) -> int:
        return self.ctx.rank

    def reduce(self, values: dict[str, float | None], op: str) -> dict[str, float | None]:
        """``op="mean"`` or ``"max"`` of each value over ranks; ``None`` (not measured) is
        ignored, and stays ``None`` only if no rank measured it."""
        if op not in ("mean", "max"):
            raise ValueError(f"op must be 'mean' or 'max', got {op!r}")
        if not self.active:
            return dict(values)
        keys = list(values)
        present = torch.tensor([values[k] is not None for k in keys], dtype=torch.float64)
        if op == "mean":
            x = torch.tensor([values[k] or 0.0 for k in keys], dtype=torch.float64)
            both = torch.stack([x, present])  # (2, K): sums and counts
            dist.all_reduce(both)
            out = both[0] / both[1].clamp(min=1)
            found = both[1] > 0
        else:
            x = torch.tensor([-float("inf") if values[k] is None else values[k] for k in keys],
                             dtype=torch.float64)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            out, found = x, x > -float("inf")
        return {k: float(v) if ok else None for k, v, ok in zip(keys, out, found, strict=True)}

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (small picklable objects only)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its result (or its exception) on every rank
        (:func:`from_main_process`)."""
        return from_main_process(fn) if self.active else fn()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def sync_buffers(self, module: nn.Module) -> None:
        """Copy rank 0's buffers (BN running statistics) to every rank. DDP broadcasts them at
        the start of each training forward, but each rank then updates its own copy; syncing
        before evaluation makes every rank evaluate the model rank 0 checkpoints."""
        if not self.active:
            return
        for buf in module.buffers():
            dist.broadcast(buf, src=0)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


def param_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in ``named_parameters`` order: equal digests on all
    ranks mean the replicas hold bit-identical weights (buffers such as BN running statistics
    are left out: each rank updates its own in the last forward after DDP's broadcast)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def wrap_ddp(model: nn.Module, device: torch.device, ctx: DistContext) -> nn.Module:
    """DDP over the whole classifier (one process per device). Every strategy gives every
    parameter a gradient in every training step (SBP backpropagates kept frames through the
    whole backbone, frame dropout computes only kept frames, recomputation is non-reentrant), so
    neither ``find_unused_parameters`` nor ``static_graph`` is needed."""
    if not ctx.enabled:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
