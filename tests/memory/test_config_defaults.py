"""Each memory strategy's keyword defaults are its config's: a strategy built in Python
(``FrameDropout(0.5)``) trains like ``memory=frame_dropout`` (the code once sampled frames at
random where the config, and every measurement, used evenly spaced frames)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
from omegaconf import OmegaConf

# every option but the aliases of deprecated names (checkpoint.yaml composes recompute.yaml)
CONFIGS = sorted(p for p in (Path(__file__).parents[2] / "configs" / "memory").glob("*.yaml")
                 if "_target_" in p.read_text())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_strategy_defaults_are_the_configs(path: Path) -> None:
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    module, _, name = cfg.pop("_target_").rpartition(".")
    params = inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters
    cfg.pop("defaults", None)
    compared = 0
    for key, value in cfg.items():
        assert key in params, f"{path.name}: {key} is not a parameter of {name}"
        if isinstance(value, str) and value.startswith("${"):
            continue  # set from elsewhere in the config (the run seed)
        default = params[key].default
        assert default is not inspect.Parameter.empty, f"{name}({key}=...) has no default"
        assert (list(default) if isinstance(default, tuple) else default) == value, (
            f"{name}({key}={default!r}) but {path.name} sets {value!r}")
        compared += 1
    assert compared or path.stem == "e2e"
