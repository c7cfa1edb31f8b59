"""``python -m videotrain [overrides]``: train and evaluate as configured (Hydra app).

With no arguments this generates the synthetic dataset on first use and trains the default
model on it. Outputs go to the Hydra run directory (``outputs/DATE/TIME`` under the current
directory, or ``hydra.run.dir=...``); re-running with the same ``hydra.run.dir`` resumes.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from videotrain.run import CONFIG_DIR, train


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    results = train(cfg, HydraConfig.get().runtime.output_dir)
    return results["val_top1"]


if __name__ == "__main__":
    main()
