"""Strict configs (``videotrain/schema.py``): wrong types and unknown keys fail naming the key,
a sweep preset without ``-m`` says so, the job is named ``videotrain``, and run folders of runs
started in the same second do not collide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from videotrain import build, schema

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.max_epochs=abc"], r"Value 'abc' of type 'str' could not be converted to Integer"),
        (["data.batch_size=2.5"], r"could not be converted to Integer"),
        (["memory=sbp", "memory.keep_ratio=lots"], r"could not be converted to Float"),
        (["trainer.progress=sometimes"], r"Value 'sometimes' is not a valid bool"),
        (["model.backbone.depth=abc"], r"could not be converted to Integer"),
        (["trainer.max_epoch=3"], r"Key 'max_epoch' not in 'TrainerSchema'"),
    ],
)
def test_wrong_types_fail_while_composing_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        build.compose_cfg(overrides)
    text = f"{err.value} {err.value.__cause__}"
    assert message in text or pytest.fail(text)
    key = overrides[-1].split("=")[0]
    assert f"full_key: {key}" in text


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["+trainer.max_epoch=3"], "unknown config key trainer.max_epoch; did you mean trainer.max_epochs?"),
        (["+model.pretrianed=DEFAULT"], "unknown config key model.pretrianed; did you mean model.pretrained?"),
        (["+data.batchsize=4"], "unknown config key data.batchsize; did you mean data.batch_size?"),
        (["optim=sgd", "+optim.betas=[0.9,0.99]"], "unknown config key optim.betas (the keys of optim are:"),
        (["+memory.keep_ratio=0.5"], "unknown config key memory.keep_ratio (memory takes no keys)"),
        (["+sed=1"], "unknown config key sed; did you mean seed?"),
        (["data=kinetics", "data.root=x", "+data.fold=1"], "unknown config key data.fold"),
    ],
)
def test_unknown_keys_are_rejected_naming_the_nearest(overrides: list[str], message: str) -> None:
    with pytest.raises(schema.UnknownConfigKey) as err:
        build.compose_cfg(overrides)
    assert message in str(err.value)


def test_every_group_option_has_a_schema() -> None:
    """Each YAML of a schema'd group composes onto a dataclass (so its types are checked)."""
    from omegaconf import OmegaConf

    for group, key in [("data", "data"), ("model/backbone", "model.backbone"),
                       ("model/head", "model.head"), ("memory", "memory"), ("optim", "optim")]:
        for option in sorted(f.stem for f in (Path(build.CONFIG_DIR) / group).glob("*.yaml")):
            extra = ["data.root=x"] if group == "data" and option not in ("synthetic",) else []
            cfg = build.compose_cfg([f"{group}={option}", *extra])
            node = OmegaConf.select(cfg, key)
            assert OmegaConf.get_type(node).__name__.endswith("Schema"), (group, option)


def test_unique_dir_claims_a_fresh_folder_per_run(tmp_path: Path) -> None:
    base = str(tmp_path / "outputs" / "12-00-00")
    build._claimed.clear()
    first = build.unique_dir(base)
    assert first == base and Path(base).is_dir()
    assert build.unique_dir(base) == first  # the same run asks again: the same folder
    build._claimed.clear()  # another run, the same second
    assert build.unique_dir(base) == base + "-1"
    build._claimed.clear()


def test_two_runs_started_at_once_get_two_folders(tmp_path: Path) -> None:
    base = tmp_path / "outputs" / "12-00-00"
    code = f"from videotrain.build import unique_dir; print(unique_dir({str(base)!r}))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    got = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert sorted(got) == [str(base), f"{base}-1", f"{base}-2", f"{base}-3"]


def test_sweep_without_multirun_fails_and_the_log_is_videotrain_log(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "videotrain", "+sweep=keep_ratio",
                           f"hydra.run.dir={run_dir}", "logger.wandb.mode=disabled"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    first = done.stderr.strip().splitlines()[0]
    assert first.startswith("error: +sweep=keep_ratio sweeps memory=sbp, memory.keep_ratio=")
    assert "a sweep needs -m" in first
    assert (run_dir / "videotrain.log").exists() and not (run_dir / "__main__.log").exists()
    assert "a sweep needs -m" in (run_dir / "videotrain.log").read_text()
