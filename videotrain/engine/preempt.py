"""Stopping cleanly when the job is told to: SIGTERM, SIGUSR1 and SIGUSR2.

``StopSignals`` records the request while ``Trainer.fit`` trains; at the next optimizer-step
boundary the ranks agree on it (``agreed_stop``), a checkpoint is written and ``Preempted``
ends the process with ``EXIT_PREEMPTED`` (75); the same command resumes. A second signal
raises ``Interrupted`` at once (checkpoints are atomic). The previous handler is chained after
the checkpoint (submitit's requeue). Handlers are installed from the main thread only; forked
loader workers ignore SIGUSR1/2 and die on SIGTERM. Details:
docs/design/internals.md#preemption."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from videotrain.engine.distributed import Comm

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # os.EX_TEMPFAIL
SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, n))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Preempted(SystemExit):
    """Training stopped at an optimizer-step boundary on a signal, after writing a checkpoint.

    A ``SystemExit`` (code ``EXIT_PREEMPTED``), so that it passes through Hydra, which turns
    other exceptions into exit code 1, and ends the process with the documented code; code that
    runs the trainer in-process can catch it.
    """

    def __init__(self, signum: int, step: int, checkpoint: str | Path | None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    def __str__(self) -> str:
        return (f"stopped by {signal_name(self.signum)} after step {self.step}; checkpoint "
                f"{self.checkpoint}; exit code {EXIT_PREEMPTED}")


class Interrupted(SystemExit):
    """A second stop signal while stopping: leave at once (exit code 128 + signal number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"{signal_name(self.signum)} again while stopping: exiting at once"


class StopSignals:
    """Context manager: handlers for ``SIGNALS`` while inside, the previous ones restored after.

    ``requested`` is the first signal received (None before). Outside the main thread (where
    Python cannot install handlers) it does nothing, and ``requested`` stays None.
    """

    def __init__(self, signals: tuple[int, ...] = SIGNALS) -> None:
        self.signals = signals
        self.requested: int | None = None
        self.previous: dict[int, Any] = {}
        self._pid: int | None = None

    @property
    def installed(self) -> bool:
        return bool(self.previous)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: no stop-signal handlers installed")
            return self
        self._pid = os.getpid()
        for signum in self.signals:
            self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, prev in self.previous.items():
            signal.signal(signum, signal.SIG_DFL if prev is None else prev)
        self.previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker) inherited this
            if signum == signal.SIGTERM:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self.requested is not None:
            raise Interrupted(signum)
        self.requested = signum

    def previous_handler(self, signum: int) -> Any:
        prev = self.previous.get(signum)
        return prev if callable(prev) else None

    def chain(self, signum: int) -> None:
        """Call the handler ``signum`` had before ours, if it was a Python function (e.g.
        submitit's, which requeues the job and exits). Its exceptions propagate."""
        prev = self.previous_handler(signum)
        if prev is not None:
            prev(signum, None)


def agreed_stop(signals: StopSignals, comm: Comm) -> int | None:
    """The stop signal if any rank got one (the same answer on every rank: an all-reduce of
    the flag, at the step boundaries all ranks share), else None."""
    local = signals.requested
    if not comm.active:
        return local
    got = comm.reduce({"signal": local}, "max")["signal"]
    return None if got is None else int(got)


def stop_run(signum: int, signals: StopSignals, comm: Comm, checkpoint: Path | None,
             where: tuple[int, int, int], loaders: Iterable[Any]) -> NoReturn:
    """After the stop's checkpoint is written: log (rank 0), stop the loaders' worker
    processes, call the handler that was installed before ours, and raise ``Preempted``.
    ``where`` is (optimizer step, epoch, samples into the epoch)."""
    step, epoch, consumed = where
    own = signals.requested or signum  # this rank's own signal decides what to chain
    prev = signals.previous_handler(own)
    if comm.is_main:
        then = (f"handing over to the handler installed before ours "
                f"({getattr(prev, '__qualname__', prev)}; submitit's requeues the job)"
                if prev is not None else f"exiting with code {EXIT_PREEMPTED}")
        log.warning("%s received: stopped after optimizer step %d (epoch %d, %d samples into "
                    "it); checkpoint written: %s; %s. Re-running the same command resumes "
                    "from it.", signal_name(signum), step, epoch, consumed, checkpoint, then)
    for loader in loaders:
        close_loader_workers(loader)
    failed: BaseException | None = None
    try:
        signals.chain(own)
    except BaseException as err:  # e.g. submitit's sys.exit after requeueing: after the barrier
        failed = err
    comm.barrier()  # no rank leaves before rank 0's previous handler has run
    if failed is not None:
        raise failed
    raise Preempted(signum, step, checkpoint)


def close_loader_workers(loader: Any) -> None:
    """Stop a DataLoader's worker processes now: they are persistent, and would otherwise
    live until the loader is garbage collected or the interpreter exits."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    if it is not None:
        loader._iterator = None
