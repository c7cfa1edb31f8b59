"""Run under torchrun by tests/test_distributed.py (not collected by pytest): DDP at scale.

* ``sharded``: a run with ``trainer.test_after_fit=true``: the multi-view test runs sharded over
  both ranks and reduced; every rank reports what it returned in ``sharded_rankN.json``.
* ``hung``: the same run with rank 1's decoding patched to hang (``data.num_workers=1``,
  ``data.worker_timeout`` short): every rank must fail, within the timeout plus a margin, with
  a message naming rank 1. Each rank writes ``hung_rankN.json`` (its error and how long it
  took), then leaves at once: its process group is broken.

Usage: ``torchrun --standalone --nproc_per_node=2 tests/ddp_cluster_worker.py SPEC_JSON``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import videotrain.config.build as builder
import videotrain.run as run
from videotrain.data.dataset import VideoClipDataset
from videotrain.engine import distributed


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=builder.CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def main() -> None:
    spec = json.loads(sys.argv[1])
    out, base = Path(spec["out"]), spec["overrides"]
    ctx, _ = distributed.init_from_env()

    results = run.train(compose_cfg([*base, *spec["sharded"]]), out / "sharded")
    (out / f"sharded_rank{ctx.rank}.json").write_text(json.dumps(results.get("test")))

    if ctx.rank == 1:  # its worker process inherits the patch (fork): the first batch never comes
        def hang(self, path):  # bounded, so that no process outlives the test by long
            time.sleep(spec["hang_s"])
            raise RuntimeError("unreachable")

        VideoClipDataset.decode_views = hang
    t0 = time.perf_counter()
    try:
        run.train(compose_cfg([*base, *spec["hung"]]), out / "hung")
        error = None
    except Exception as err:  # noqa: BLE001 (recorded for the test to check)
        error = f"{type(err).__name__}: {err}"
    (out / f"hung_rank{ctx.rank}.json").write_text(json.dumps(
        {"error": error, "seconds": time.perf_counter() - t0}))
    sys.stdout.flush()
    os._exit(0)  # the group is broken: no teardown collective


if __name__ == "__main__":
    main()
