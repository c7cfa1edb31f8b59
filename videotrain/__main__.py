"""``python -m videotrain [overrides]``: train and evaluate as configured (Hydra app).

With no arguments this generates the synthetic dataset on first use and trains the default
model on it. Outputs go to the Hydra run directory (``outputs/DATE/TIME`` under the current
directory, or ``hydra.run.dir=...``); re-running with the same ``hydra.run.dir`` resumes.

``torchrun --nproc_per_node=N -m videotrain [overrides]`` trains with DDP. Every rank runs this
Hydra app, so before Hydra starts the ranks join the process group and agree on rank 0's
launch time (which names the run directory); ranks other than 0 write no ``.hydra/`` files and
log warnings only, to the console.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from videotrain.config.build import CONFIG_DIR, clean_errors, validate
from videotrain.engine import distributed
from videotrain.run import train


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    with clean_errors():
        check_sweep_mode()
        results = train(validate(cfg), HydraConfig.get().runtime.output_dir)
    return results["val_top1"]


def check_sweep_mode() -> None:
    """A ``+sweep=NAME`` preset only sets the multirun sweeper's parameters: without ``-m`` it
    would silently train one run. Say so instead."""
    hc = HydraConfig.get()
    sweep = hc.runtime.choices.get("sweep")
    if sweep and hc.mode == RunMode.RUN:
        params = ", ".join(f"{k}={v}" for k, v in hc.sweeper.get("params", {}).items())
        raise ValueError(f"+sweep={sweep} sweeps {params or 'its parameters'}: a sweep needs -m "
                         f"(--multirun), e.g. python -m videotrain -m +sweep={sweep}")


def worker_overrides(args: list[str]) -> list[str]:
    """Hydra overrides for DDP ranks other than 0: no ``.hydra/`` copies and no log file in
    rank 0's run directory, warnings on the console (the user's own choices win)."""
    extra = []
    if not any(a.startswith(("hydra.output_subdir=", "+hydra.output_subdir=")) for a in args):
        extra.append("hydra.output_subdir=null")
    if not any("hydra/job_logging" in a or a.startswith("hydra.job_logging") for a in args):
        extra += ["hydra/job_logging=stdout", "hydra.job_logging.root.level=WARNING"]
    return extra


def main() -> None:
    """Console entry point (``videotrain`` and ``python -m videotrain``)."""
    ctx, owns_group = distributed.init_from_env()
    try:
        if ctx.enabled:
            distributed.share_launch_time(ctx)
            if not ctx.is_main:
                sys.argv.extend(worker_overrides(sys.argv[1:]))
        hydra_main()
    finally:
        if owns_group:
            distributed.shutdown()


if __name__ == "__main__":
    main()
