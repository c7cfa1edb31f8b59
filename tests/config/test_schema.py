"""Strict configs (``videotrain/config/schema.py``): wrong types and unknown keys fail naming the key,
a sweep preset without ``-m`` says so, the job is named ``videotrain``, and run folders of runs
started in the same second do not collide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra.errors import ConfigCompositionException

from videotrain.config import build, schema

ROOT = Path(__file__).resolve().parents[2]


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
        # the recompute planner's switches are set in code, not by a config
        (["memory=recompute", "+memory.cost_model=flops"], "unknown config key memory.cost_model"),
        (["memory=recompute", "+memory.lower_set_cap=9"], "unknown config key memory.lower_set_cap"),
        (["memory=recompute", "+memory.device_profile=h200"], "unknown config key memory.device_profile"),
        (["memory=recompute", "+memory.segment_cost_us=1"], "unknown config key memory.segment_cost_us"),
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
    code = f"from videotrain.config.build import unique_dir; print(unique_dir({str(base)!r}))"
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


# ------------------------------------------------------------ defaults declared once
# An option that is a preset of the same target as another (resnet10 of resnet, vit_tiny of
# vit) sets these keys on purpose; every other key a YAML sets must be its Python default.
PRESET_KEYS = {
    ("model/backbone", "resnet10"): {"layers", "grid", "temporal_shift"},
    ("model/backbone", "resnet50"): {"depth"},
    ("model/backbone", "vit_tiny"): {"patch_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim"},
}
# data options are datasets: the reader's options (None in build_data: the reader's default) and
# the generator's settings are each dataset's own (build_data's required arguments have no default)
DATASET_KEYS = {"fold", "split_dir", "video_dir", "train_file", "val_file", "path_prefix", "classes_file",
                "labels_file", "video_ext", "synthetic"}


def _option_files() -> list[tuple[str, Path]]:
    """Every option of every schema'd group, but those that overlay another option of their
    group (recipe=kinetics on recipe=plain: a preset of it, whose base is checked)."""
    return [(group, path) for group in schema.SCHEMAS
            for path in sorted((Path(build.CONFIG_DIR) / group).glob("*.yaml"))
            if "_schema" in path.read_text()]


def _python_default(f: Any) -> Any:
    import dataclasses

    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return list(value) if isinstance(value, tuple) else value


def _differences(raw: dict, cls: type, allowed: set[str], prefix: str = "") -> tuple[list[str], int]:
    """The keys of ``raw`` (a YAML's own values) whose value is not ``cls``'s field default."""
    import dataclasses
    import importlib

    from omegaconf import MISSING

    fields = {f.name: f for f in dataclasses.fields(cls)}
    wrong, compared = [], 0
    for key, value in raw.items():
        assert key in fields, f"{prefix}{key} is not a field of {cls.__name__}"
        default = _python_default(fields[key])
        if dataclasses.is_dataclass(default):
            more, n = _differences(value, type(default), allowed, f"{prefix}{key}.")
            wrong, compared = wrong + more, compared + n
            continue
        if (isinstance(value, str) and value.startswith("${")) or default == MISSING or key in allowed:
            continue  # set from elsewhere in the config / a required argument / a preset's own
        if key == "_target_":  # a package alias names the same object
            def obj(path: str) -> Any:
                module, _, name = path.rpartition(".")
                return getattr(importlib.import_module(module), name)

            same = obj(value) is obj(default)
        else:
            same = value == default or (default is None and value == {})  # kwargs: {} = none
        compared += 1
        if not same:
            wrong.append(f"{prefix}{key}: Python {default!r}, YAML {value!r}")
    return wrong, compared


@pytest.mark.parametrize("group,path", _option_files(), ids=lambda v: v if isinstance(v, str) else v.stem)
def test_yaml_defaults_are_the_python_defaults(group: str, path: Path) -> None:
    """Each group's schema is derived from what it configures (TrainerSettings, AdamWSettings,
    warmup_cosine, the backbones' and heads' signatures, build_data, the strategies, ...), and
    every value its YAML sets is the default declared there: one default per key."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    names = [d for d in raw.pop("defaults", []) if isinstance(d, str) and d.endswith("_schema")]
    allowed = PRESET_KEYS.get((group, path.stem), set()) | (DATASET_KEYS if group == "data" else set())
    wrong, compared = _differences(raw, schema.SCHEMAS[group][names[0]], allowed)
    assert not wrong, f"{group}/{path.name}: " + "; ".join(wrong)
    assert compared or group == "memory", f"{path.name}: nothing compared"
    for key in PRESET_KEYS.get((group, path.stem), ()):  # a preset key that equals the default
        assert _differences({key: raw[key]}, schema.SCHEMAS[group][names[0]], set())[0], (key, "not a preset")


def test_root_and_model_defaults_are_the_schemas() -> None:
    """configs/config.yaml's own keys (and its model.* keys) are RootSchema's and ModelSchema's."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(Path(build.CONFIG_DIR) / "config.yaml"), resolve=False)
    own = {k: v for k, v in raw.items() if k not in ("defaults", "hydra")}
    wrong, compared = _differences(own, schema.RootSchema, set())
    assert not wrong and compared >= 8, wrong


def test_trainer_defaults_are_declared_once() -> None:
    """The three defaults that had drifted apart (YAML 8 / schema 4 / TrainerSettings 10 epochs):
    TrainerSettings holds the YAML's, which is what the default job runs."""
    from videotrain.engine.trainer import TrainerSettings

    s = TrainerSettings()
    assert (s.max_epochs, s.grad_clip, s.checkpoint_every_n_steps) == (8, 1.0, 50)
    cfg = build.compose_cfg([])
    assert (cfg.trainer.max_epochs, cfg.trainer.grad_clip, cfg.trainer.checkpoint_every_n_steps) == (8, 1.0, 50)
    assert schema.SCHEMAS["trainer"]["trainer_schema"] is schema.TrainerSchema
    assert build.trainer_settings(cfg) == TrainerSettings(max_bad_fraction=cfg.data.max_bad_fraction)
    assert s.max_bad_fraction == cfg.data.max_bad_fraction  # data's key, read by the trainer
