"""The process plumbing every suite's parent side shares: the device name its rows get
(``device_name``), one row in a fresh interpreter (``run_child``, which runs
``python -m MODULE --child SPEC``: ``videotrain.bench``, whose ``cli.child_main`` measures it,
unless the caller names another entry point), and the machine the rows ran on
(``machine_info``, written into every suite's ``bench.json``).

It imports no suite, so the cost benchmark (``cli``) and the lab's suites beside the package
(``benchmarks/``: the data loaders, the annotation files) build on it alike.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def device_name(name: str) -> str:
    """The device a suite runs its rows on, as the name each row is given (``device=NAME``):
    ``auto`` becomes ``cuda`` where torch sees a GPU, else ``cpu``; any other name is passed on
    as it is, and each row resolves it to a ``torch.device`` (``build.resolve_device``)."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def child_reply(measure: Callable[[dict[str, Any]], dict[str, Any]], spec_json: str) -> int:
    """Child side of :func:`run_child`: ``measure`` one row, print exactly one JSON line on
    stdout, the row's error (with status 1) where it raised: the parent decides."""
    try:
        result = measure(json.loads(spec_json))
        code = 0
    except Exception as exc:  # noqa: BLE001 - recorded in the row, the parent decides
        traceback.print_exc()
        cause = exc.__cause__ or exc
        result = {"error": f"{type(exc).__name__}: {exc}"
                           + (f" ({type(cause).__name__}: {cause})" if cause is not exc else "")}
        code = 1
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return code


def run_child(spec: dict[str, Any], timeout: float, module: str = "videotrain.bench",
              metered: bool = True, pythonpath: str | Path | None = None) -> dict[str, Any]:
    """Run one row in a fresh interpreter, ``python -m module --child SPEC``; the result (or
    the error) as a dict. ``metered``: the row meters the CPU's memory (glibc then hands large
    freed blocks back at once, ``MALLOC_MMAP_THRESHOLD_``). ``pythonpath``: a folder put first
    on the child's ``PYTHONPATH``, where ``module`` is found (a suite beside the package)."""
    env = os.environ.copy()
    env.setdefault("WANDB_MODE", "disabled")
    if spec["device"] == "cpu" and metered:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", module, "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    result: dict[str, Any] | None = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if result is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        result = {"error": f"child exited with {proc.returncode} and no result:\n{tail}"}
    elif proc.returncode != 0 and not result.get("error"):
        result["error"] = f"child exited with {proc.returncode}"
    result["wall_s"] = wall
    return result


def machine_info(device: str, gpu: bool = True) -> dict[str, Any]:
    """Host, CPU, Python and torch versions, torch's threads, the load average, the GPU
    (``gpu_info``, for a CUDA device, unless ``gpu`` is false: reading it starts CUDA in this
    process) and the commit (``git describe``; without a repository, ``$VIDEOTRAIN_COMMIT``)."""
    import torch

    info: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        info["load_avg"] = os.getloadavg()
    except OSError:
        pass
    if gpu and device.startswith("cuda") and torch.cuda.is_available():
        info.update(gpu_info(torch.device(device)))
    try:
        info["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                     text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    if not info.get("git") and os.environ.get("VIDEOTRAIN_COMMIT"):
        # a copy of the working tree without .git (a lent GPU machine): the commit it was made
        # from, as the caller names it (scripts/gpu_check.sh)
        info["git"] = os.environ["VIDEOTRAIN_COMMIT"]
    return info


def gpu_info(device: Any) -> dict[str, Any]:
    """Name, compute capability, memory and the CUDA / cuDNN versions torch was built with."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "gpu_capability": f"{props.major}.{props.minor}",
            "gpu_total_memory_mb": props.total_memory / 2**20, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}
