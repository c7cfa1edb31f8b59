"""Peak memory of one training step, on CUDA and on CPU.

CUDA: ``max_memory_allocated`` over the step minus what was allocated before it. CPU: reset
the kernel's high-water mark (``/proc/self/clear_refs``), run the step, read ``VmHWM -
VmRSS(before)``, with large allocations served by ``mmap`` (``M_MMAP_THRESHOLD``) and free heap
pages trimmed first, so freed tensors leave the resident set. Python's cyclic collector is
paused during the step (on CUDA too), so an earlier cycle freed mid-step cannot hide growth.
Where the mark cannot be reset the meter reports ``None``, never a wrong number;
``cpu_meter_reads_high`` says when an earlier unmetered job fragmented the heap. Why each step
is needed: docs/design/internals.md#the-step-peak-meter."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import re
from pathlib import Path

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest M_MMAP_THRESHOLD on 64-bit
_TRIM_THRESHOLD_DEFAULT = 128 * 1024  # glibc's default M_TRIM_THRESHOLD
_HWM_RESET_SLACK_KB = 1024  # VmHWM just after a reset: VmRSS, give or take pages faulted meanwhile
_allocator = "default"  # glibc's malloc setting: "default" | "meter" | "keep_freed"
_kept_freed = False  # whether keep_freed_memory ever ran in this process (cpu_meter_reads_high)
_gc_resume: bool | None = None  # while a meter pauses the collector: whether it was enabled before


@functools.cache  # find_library runs ldconfig: once per process, not once per step
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None


def _libc_call(name: str, *args: int) -> None:
    """Call glibc's ``name``; a no-op where there is no libc, or it is not glibc."""
    fn = getattr(_libc(), name, None)
    if fn is not None:
        fn(*args)


def _meter_allocator() -> None:
    """The meter's malloc setting: tensors of 64 KiB and more mapped and unmapped one by one, so
    the resident set follows what is allocated. Applied again after ``keep_freed_memory``."""
    global _allocator
    if _allocator == "meter":
        return
    if _allocator == "keep_freed":
        _libc_call("mallopt", _M_TRIM_THRESHOLD, _TRIM_THRESHOLD_DEFAULT)
    _libc_call("mallopt", _M_MMAP_THRESHOLD, 65536)
    _allocator = "meter"


def keep_freed_memory() -> None:
    """For timing, not metering: glibc keeps freed memory for reuse (mmap threshold at its
    maximum, no trimming) instead of handing every large tensor back to the OS, so a step no
    longer pays a fresh mapping and page faults for each allocation; roughly what a caching
    allocator such as PyTorch's on CUDA does. Under this setting a CPU meter would read high
    (malloc reuses the kept blocks, and their holes count), so the next ``StepPeakMemory.start``
    puts the meter's setting back."""
    global _allocator, _kept_freed
    _libc_call("mallopt", _M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    _libc_call("mallopt", _M_TRIM_THRESHOLD, 2**30)
    _allocator = "keep_freed"
    _kept_freed = True


def cpu_meter_reads_high() -> bool:
    """Whether a CPU meter started now reads high: ``keep_freed_memory`` ran in this process
    before (an earlier run's unmetered steps), and the heap it grew stays fragmented (module
    doc). CUDA's meter is not affected."""
    return _kept_freed


def _pause_gc() -> None:
    global _gc_resume
    if _gc_resume is None:  # else paused already, by a start whose step raised
        _gc_resume = gc.isenabled()
    gc.disable()


def _resume_gc() -> None:
    global _gc_resume
    if _gc_resume:
        gc.enable()
    _gc_resume = None


def _status_kbs(*fields: str) -> list[int]:
    """``/proc/self/status`` fields in kB, read at one instant (0 for a field not there)."""
    text = Path("/proc/self/status").read_text()
    found = (re.search(rf"^{f}:\s+(\d+) kB", text, re.MULTILINE) for f in fields)
    return [int(m.group(1)) if m else 0 for m in found]


def _status_kb(field: str) -> int:
    return _status_kbs(field)[0]


def _reset_hwm() -> tuple[bool, int]:
    """Reset the resident set's high-water mark -> (done, VmRSS in kB just after). Not done
    where the write fails or does not take (a kernel, or a sandbox such as gVisor, that accepts
    it and keeps the old mark)."""
    before = _status_kb("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False, before
    hwm, rss = _status_kbs("VmHWM", "VmRSS")
    return hwm <= max(before, rss) + _HWM_RESET_SLACK_KB, rss


class StepPeakMemory:
    """``start()`` before a step, ``stop()`` after it -> the step's peak increase in MB."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0
        self._ok = True
        if device.type == "cpu":
            _meter_allocator()

    def start(self) -> None:
        _pause_gc()  # no earlier garbage freed inside the step (module doc)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _meter_allocator()  # again, if keep_freed_memory undid it since
            _libc_call("malloc_trim", 0)  # free heap pages back: reusing them shows in RSS again
            self._ok, rss_kb = _reset_hwm()
            self._base = rss_kb * 1024

    def stop(self) -> float | None:
        """The step's peak so far; the collector runs again."""
        _resume_gc()
        return self.read()

    def read(self) -> float | None:
        """The step's peak so far, the step still running (the collector stays paused)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        if not self._ok:
            return None
        return max(_status_kb("VmHWM") * 1024 - self._base, 0) / 2**20
