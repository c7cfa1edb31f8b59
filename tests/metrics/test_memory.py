"""``StepPeakMemory`` on the CPU: the reported peak is the step's real high-water mark, in MiB.

The measurements run in a fresh interpreter, whose resident set holds nothing of other tests;
the last of them runs after ``keep_freed_memory`` (as the trainer calls it after its metered
steps), which a later ``start`` must undo: under it, malloc keeps a freed 24 MiB block resident
and maps a 28 MiB one beside it, and a meter would read their sum. One step runs with 64 MiB of
garbage in a reference cycle pending: were the collector to free it inside the step, the meter
would read 0 (it did, in a shared pytest worker, before the meter paused the collector).

Tolerance: 2 MiB either side of the bytes the step allocated. ``VmHWM``/``VmRSS`` count whole
pages, and between ``start`` and ``stop`` the rest of the process moves a little (the
interpreter's own heap, pages the kernel reclaims); on 64 MiB steps that drift measured
-0.1 to +1.0 MiB over 5 runs. 2 MiB still tells apart every plausible wrong count: the sum of
two freed tensors instead of their max (80 vs 48), MB instead of MiB (67.1 vs 64), the memory
still held at the end instead of the peak (0), or a missed reset of the high-water mark (the
earlier, larger step).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from videotrain.metrics import memory as meter_mod
from videotrain.metrics.memory import StepPeakMemory

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the CPU meter reads Linux's /proc")

TOLERANCE_MIB = 2.0

_SCRIPT = """
import json, torch
from videotrain.metrics.memory import StepPeakMemory

MiB = 2**20
meter = StepPeakMemory(torch.device("cpu"))

def step(sizes, together):
    meter.start()
    held = []
    for s in sizes:
        t = torch.ones(s * MiB // 4)  # float32, s MiB, every page written
        if together:
            held.append(t)
        del t
    held.clear()
    return meter.stop()

out = {
    "one_64": step([64], True),
    "seq_32_48": step([32, 48], False),  # freed in between: the peak is the larger one
    "both_32_48": step([32, 48], True),  # alive together: the peak is their sum
}
keep = torch.ones(96 * MiB // 4)  # allocated before start: not the step's
out["held_before_16"] = step([16], True)
del keep
out["small_after_big_8"] = step([8], True)  # the 80 MiB high-water mark above was reset

import gc
gc.collect()
gc.disable()  # the cycle below outlives this line...
junk = {"t": torch.ones(64 * MiB // 4)}
junk["self"] = junk
del junk
gc.enable()  # ...until the collector's next automatic run: where it runs, in the step below
meter.start()
objs = [[] for _ in range(5000)]  # enough new objects for an automatic collection
t = torch.ones(16 * MiB // 4)
del t, objs
out["garbage_pending_16"] = meter.stop()  # 0 if the 64 MiB cycle were freed in the step
out["gc_enabled_after"] = gc.isenabled()

from videotrain.metrics.memory import cpu_meter_reads_high, keep_freed_memory
out["reads_high_before"] = cpu_meter_reads_high()
keep_freed_memory()
out["reads_high_after"] = cpu_meter_reads_high()
meter.start()
a = torch.ones(24 * MiB // 4)
pin = torch.ones(1024)  # a small block after it: the 24 MiB hole cannot go back to the OS
del a
b = torch.ones(28 * MiB // 4)  # does not fit the hole
del b, pin
out["after_keep_freed_28"] = meter.stop()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def peaks() -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("key", "mib"), [("one_64", 64), ("seq_32_48", 48), ("both_32_48", 80),
                                          ("held_before_16", 16), ("small_after_big_8", 8),
                                          ("garbage_pending_16", 16), ("after_keep_freed_28", 28)])
def test_cpu_peak_is_the_bytes_the_step_allocated(peaks: dict[str, float], key: str, mib: float) -> None:
    got = peaks[key]
    assert got is not None, "clear_refs not writable: the meter cannot measure here"
    assert abs(got - mib) <= TOLERANCE_MIB, f"{key}: reported {got:.2f} MiB, allocated {mib} MiB"


def test_the_process_is_marked_reading_high_once_it_kept_freed_memory(peaks: dict) -> None:
    """A fresh process's meter is exact; once ``keep_freed_memory`` ran, the heap it grows stays
    fragmented for every later meter of the process (the trainer warns on it)."""
    assert (peaks["reads_high_before"], peaks["reads_high_after"]) == (False, True)


def test_the_collector_is_paused_for_the_step_only(peaks: dict[str, float]) -> None:
    """Paused from start to stop (garbage_pending_16 above), and running again after; a start
    whose step raised (no stop) is ended by the next meter's stop, as a new run's would."""
    assert peaks["gc_enabled_after"] is True
    cpu = torch.device("cpu")
    assert gc.isenabled()
    StepPeakMemory(cpu).start()  # the step raised: no stop
    assert not gc.isenabled()
    meter = StepPeakMemory(cpu)
    meter.start()
    meter.stop()
    assert gc.isenabled()


def test_meter_reports_none_rather_than_a_wrong_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the high-water mark cannot be reset, the peak since process start would be
    read as the step's: the meter says None instead."""
    monkeypatch.setattr(meter_mod, "_reset_hwm", lambda: (False, 0))
    meter = StepPeakMemory(torch.device("cpu"))
    meter.start()
    assert meter.stop() is None


def test_meter_reports_none_where_the_reset_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox that accepts the write to ``clear_refs`` and keeps the old high-water mark:
    the meter would read the process's earlier peak as the step's, so it says None."""

    class IgnoredWrite(type(Path())):
        def write_text(self, *args, **kwargs) -> int:
            return 0

    meter = StepPeakMemory(torch.device("cpu"))
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB resident, then unmapped: the mark stays above
    del big
    monkeypatch.setattr(meter_mod, "Path", IgnoredWrite)
    meter.start()
    assert meter.stop() is None
