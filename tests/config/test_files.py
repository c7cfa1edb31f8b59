"""Configs read from files (``videotrain.config.files``): a run folder's ``config.yaml`` and the
config stored in a checkpoint are checked against the strict schema and a ``_target_``
allowlist derived from ``configs/`` before anything of them is instantiated.

The ``torch.load`` attack is reproduced for eval, predict and export: a ``torch.load`` node with
``weights_only: false`` (whose file, ``evil.pt``, creates a marker file when unpickled) under
``model.backbone`` in a checkpoint's stored config, and under ``model.head`` in a run folder's
``config.yaml``. Each command stops with exit status 2 and one ``error:`` line naming the key;
the marker never appears. ``run_config=false`` with the run's groups on the command line still
evaluates, predicts and exports the same checkpoint (the way to go on with a trusted run), and
the untouched config of every shipped experiment passes the check.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf

import videotrain.run as run
from videotrain.config.build import CONFIG_DIR, clean_errors, validate
from videotrain.config.files import (
    RefusedConfig,
    checked_config,
    model_part,
    read_config_file,
    shipped_options,
    shipped_targets,
)
from videotrain.engine.checkpoints import format as ckpt
from videotrain.eval import run_eval
from videotrain.export import export
from videotrain.predict import predict
from videotrain.untrusted import FILE_DATA_BOUNDS

EXPERIMENTS = sorted(p.stem for p in (Path(CONFIG_DIR) / "exp").glob("*.yaml"))


class CreatesAFile:
    """Unpickling this calls ``open(path, "w")``: the payload of a crafted ``evil.pt``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def payload(evil: Path) -> dict:
    """The node of the attack: Hydra instantiates it (nested, before the outer target)."""
    return {"_target_": "torch.load", "_args_": [str(evil)], "weights_only": False}


@pytest.fixture(scope="module")
def attack(tmp_path_factory: pytest.TempPathFactory, run_overrides, compose_cfg) -> dict[str, Path]:
    """A tiny trained run, and the two crafted copies a stranger could share:
    ``stored``: its last checkpoint alone, with the payload under ``model.backbone`` of the
    config stored in it (still a ``weights_only`` checkpoint); ``folder``: a copy of the run
    folder with the payload under ``model.head`` of its ``config.yaml``."""
    base = tmp_path_factory.mktemp("attack")
    run_dir = base / "run"
    run.train(compose_cfg(run_overrides(trainer__max_steps=1)), run_dir)
    evil, marker = base / "evil.pt", base / "PAYLOAD-RAN"
    torch.save(CreatesAFile(marker), evil)

    blob = ckpt.load(run_dir / "checkpoints" / "last.ckpt")
    blob["config"]["model"]["backbone"]["payload"] = payload(evil)
    shared = base / "shared" / "shared.ckpt"
    shared.parent.mkdir()
    torch.save(blob, shared)
    assert ckpt.load(shared)["config"]["model"]["backbone"]["payload"]["_target_"] == "torch.load"

    folder = base / "run-copy"
    shutil.copytree(run_dir, folder)  # last.ckpt (a link) becomes a file
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["model"]["head"]["payload"] = payload(evil)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return {"run": run_dir / "checkpoints" / "last.ckpt", "stored": shared,
            "folder": folder / "checkpoints" / "last.ckpt", "evil": evil, "marker": marker}


KEY_AT_FAULT = {"stored": "model.backbone.payload._target_=torch.load",
                "folder": "model.head.payload._target_=torch.load"}


def test_the_payload_is_live(tmp_path: Path) -> None:
    """Without the check, instantiating the node runs the payload (Hydra lets torch.load through):
    the tests below that find no marker file test something."""
    evil, marker = tmp_path / "evil.pt", tmp_path / "PAYLOAD-RAN"
    torch.save(CreatesAFile(marker), evil)
    instantiate(payload(evil))
    assert marker.exists()


# ---------------------------------------------------------------------- the allowlist
def test_allowlist_is_the_shipped_configs_targets() -> None:
    targets = shipped_targets()
    assert set(targets) == {"model.backbone", "model.head", "memory"}
    for group in ("model/backbone", "model/head", "memory"):
        for path in (Path(CONFIG_DIR) / group).glob("*.yaml"):
            data = yaml.safe_load(path.read_text())
            if "_target_" not in data:  # an alias of a deprecated name (memory=checkpoint)
                assert data["defaults"][0] in {p.stem for p in path.parent.glob("*.yaml")}, path
                continue
            assert data["_target_"] in targets[group.replace("/", ".")]
    # memory=auto's candidates write the class's own module path: both spellings are allowed
    assert "videotrain.memory.sbp.strategy.StochasticBackprop" in targets["memory"]
    assert "torch.load" not in {t for ts in targets.values() for t in ts}


def test_allowlist_follows_the_config_folder(tmp_path: Path) -> None:
    """Derived, not kept by hand: a new option file adds its target, and only there."""
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    (configs / "model" / "head" / "pooled.yaml").write_text(
        "defaults:\n  - meanhead_schema\n  - _self_\n\n_target_: videotrain.models.heads.MeanHead\n"
        "dropout: 0.5\n")
    (configs / "model" / "head" / "mine.yaml").write_text(
        "defaults:\n  - meanhead_schema\n  - _self_\n\n_target_: mypackage.heads.Mine\n")
    targets = shipped_targets(str(configs))
    assert "mypackage.heads.Mine" in targets["model.head"]
    assert "mypackage.heads.Mine" not in shipped_targets()["model.head"]
    assert "mypackage.heads.Mine" not in targets["model.backbone"]
    assert {o.option for o in shipped_options(str(configs)) if o.group == "model/head"} >= {"mine", "pooled"}


# ---------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def plain_config(compose_cfg) -> dict:
    """The default config as a run records it (resolved plain values)."""
    return OmegaConf.to_container(compose_cfg(["data.root=/data/x"]), resolve=True)


def _edit(config: dict, key: str, value: object) -> dict:
    out = copy.deepcopy(config)
    *parents, last = key.split(".")
    node = out
    for part in parents:
        node = node[part]
    node[last] = value
    return out


@pytest.mark.parametrize("key, value, message", [
    ("model.backbone.payload", {"_target_": "torch.load"},
     "model.backbone.payload._target_=torch.load is refused: a _target_ where the schema has none"),
    ("model.head._target_", "torch.load",
     "model.head._target_=torch.load is refused: no shipped config of model.head builds it"),
    ("memory._target_", "videotrain.models.heads.MeanHead",  # shipped, but not a memory strategy
     "memory._target_=videotrain.models.heads.MeanHead is refused: no shipped config of memory"),
    ("model.pretrained", {"_target_": "os.system", "_args_": ["touch x"]},
     "model.pretrained._target_=os.system is refused"),
    ("trainer.resume", [{"_target_": "builtins.exec"}], "trainer.resume[0]._target_=builtins.exec"),
    ("_target_", "builtins.eval", "_target_=builtins.eval is refused"),
    ("data.root", "${oc.env:HOME}", "data.root is an interpolation (${oc.env:HOME})"),
    ("model.head.hidden_dm", 8, "unknown config key model.head.hidden_dm; did you mean "
                                "model.head.hidden_dim?"),
    # the key and the kind of value, never the file's text ('many')
    ("trainer.max_epochs", "many", "trainer.max_epochs: a str that the schema does not accept there"),
    ("sneaky", 1, "unknown config key sneaky"),
    ("memory", "e2e", "memory must be a mapping (the memory config group), got a str"),
])
def test_refused_naming_the_key(plain_config: dict, key: str, value: object, message: str) -> None:
    with pytest.raises(RefusedConfig) as err:
        checked_config(_edit(plain_config, key, value), "RUN/config.yaml")
    text = str(err.value)
    assert text.startswith("RUN/config.yaml: ") and message in text, text
    assert not isinstance(value, str) or repr(value) not in text  # a value is never shown
    assert "run_config=false" in text and "\n" not in text  # one line, with the way to go on
    assert isinstance(err.value, ValueError)  # clean_errors: exit status 2


@pytest.mark.parametrize("key", ["model.backbone._target_", "model.backbone", "data.name", "model"])
def test_no_resolver_runs_while_checking(plain_config: dict, key: str, tmp_path: Path) -> None:
    """An interpolation is refused unresolved: ``${unique_dir:...}`` (a resolver videotrain
    registers, which creates a folder) never runs, wherever it sits."""
    made = tmp_path / "made-by-a-resolver"
    with pytest.raises(RefusedConfig, match=f"{key} is an interpolation"):
        checked_config(_edit(plain_config, key, f"${{unique_dir:{made}}}"), "f")
    assert not made.exists()


def test_the_hint_names_the_runs_groups(plain_config: dict) -> None:
    with pytest.raises(RefusedConfig, match=r"run_config=false .*model/backbone=resnet10\|resnet18\|"
                                            r"resnet50 model/head=tconv data=synthetic"):
        checked_config(_edit(plain_config, "model.head.x", {"_target_": "torch.load"}), "f")


def test_a_yaml_file_is_read_as_plain_data(tmp_path: Path, plain_config: dict) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("model: !!python/object/apply:os.system ['touch x']\n")
    with pytest.raises(RefusedConfig, match="cannot be read as a YAML config"):
        read_config_file(path)
    path.write_text(yaml.safe_dump(plain_config))
    assert read_config_file(path).model.head._target_ == plain_config["model"]["head"]["_target_"]


# ---------------------------------------------------------------------- shipped experiments pass
@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_shipped_experiment_passes(exp: str, compose_cfg, tmp_path: Path) -> None:
    """The config a run of ``+exp=NAME`` records (config.yaml and the checkpoint's copy) passes
    unchanged, with what the experiment requires set on the command line."""
    cfg = validate(compose_cfg([f"+exp={exp}", "data.root=/data/set",
                                "model.init_from=/runs/k400/checkpoints/best.ckpt"]))
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))  # as videotrain.run writes it
    assert OmegaConf.to_container(read_config_file(path)) == OmegaConf.to_container(cfg, resolve=True)
    checked_config(OmegaConf.to_container(cfg, resolve=True), f"the config stored in {exp}.ckpt")


def test_every_group_option_passes(compose_cfg) -> None:
    """Each option of every schema-backed group (one composition each) passes too."""
    for o in shipped_options():
        cfg = compose_cfg([f"{o.group}={o.option}", "data.root=/data/set"])
        checked_config(OmegaConf.to_container(cfg, resolve=True), f"{o.group}={o.option}")


# ---------------------------------------------------------------------- eval, predict, export
def _command(name: str, attack: dict[str, Path], variant: str, tiny_root: Path,
             out: Path) -> list[str]:
    video = tiny_root / "val" / "right_then_up" / "right_then_up_0000.mp4"
    extra = {"eval": ["eval.clips=1", "eval.crops=1"], "predict": [f"video={video}"],
             "export": ["export.format=torch_export", f"export.out={out / 'model.pt2'}"]}[name]
    return [f"checkpoint={attack[variant]}", *extra, "trainer.progress=false", "device=cpu"]


def _run_in_process(name: str, cfg, overrides: list[str], out: Path):
    if name == "eval":
        return run_eval(cfg, overrides, out)
    if name == "predict":
        return predict(cfg, overrides)
    return export(cfg, overrides, out)


@pytest.mark.parametrize("variant", ["stored", "folder"])
@pytest.mark.parametrize("name", ["eval", "predict", "export"])
def test_crafted_config_is_refused(name: str, variant: str, attack: dict[str, Path], compose_cfg,
                                   tiny_root: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    """What each command's ``main`` does (``clean_errors`` around it): exit status 2, one
    ``error:`` line naming the key, and the payload never ran."""
    overrides = _command(name, attack, variant, tiny_root, tmp_path)
    with pytest.raises(SystemExit) as done, clean_errors():
        _run_in_process(name, validate(compose_cfg(overrides)), overrides, tmp_path)
    assert done.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and KEY_AT_FAULT[variant] in errors[0], errors
    assert "RefusedConfig" in errors[0] and "run_config=false" in errors[0]
    assert not attack["marker"].exists()
    assert not (tmp_path / "model.pt2").exists()


@pytest.mark.slow  # six fresh interpreters (~10-25 s each on a shared 2-core CPU)
@pytest.mark.parametrize("variant", ["stored", "folder"])
@pytest.mark.parametrize("name", ["eval", "predict", "export"])
def test_crafted_config_is_refused_by_the_commands(name: str, variant: str, attack: dict[str, Path],
                                                   tiny_root: Path, tmp_path: Path) -> None:
    """``python -m videotrain.{eval,predict,export}`` as a user runs them."""
    cmd = [sys.executable, "-m", f"videotrain.{name}",
           *_command(name, attack, variant, tiny_root, tmp_path), f"hydra.run.dir={tmp_path / 'out'}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and KEY_AT_FAULT[variant] in errors[0], done.stderr[-3000:]
    assert not attack["marker"].exists()


# ---------------------------------------------------------------------- the trusted way on
@pytest.mark.parametrize("variant", ["stored", "folder"])
def test_run_config_false_evaluates_and_predicts_the_crafted_checkpoint(
        variant: str, attack: dict[str, Path], run_overrides, compose_cfg, tiny_root: Path,
        tmp_path: Path) -> None:
    """``run_config=false`` with the run's groups on the command line: the model is rebuilt from
    the shipped configs and only the weights are loaded, giving what the untouched run gives."""
    groups = [o for o in run_overrides() if not o.startswith(("trainer.", "device="))]
    trusted = [*_command("eval", attack, variant, tiny_root, tmp_path), "run_config=false", *groups]
    untouched = _command("eval", attack, "run", tiny_root, tmp_path)
    assert run_eval(validate(compose_cfg(trusted)), trusted, tmp_path / "a") == \
        run_eval(validate(compose_cfg(untouched)), untouched, tmp_path / "b")

    trusted = [*_command("predict", attack, variant, tiny_root, tmp_path), "run_config=false", *groups]
    untouched = _command("predict", attack, "run", tiny_root, tmp_path)
    got = predict(validate(compose_cfg(trusted)), trusted)["predictions"]
    assert got == predict(validate(compose_cfg(untouched)), untouched)["predictions"]
    assert not attack["marker"].exists()


def test_run_config_false_exports_the_crafted_run(attack: dict[str, Path], run_overrides,
                                                  compose_cfg, tiny_root: Path, tmp_path: Path) -> None:
    groups = [o for o in run_overrides() if not o.startswith(("trainer.", "device="))]
    trusted = [*_command("export", attack, "folder", tiny_root, tmp_path), "run_config=false", *groups]
    meta = export(validate(compose_cfg(trusted)), trusted, tmp_path)
    assert meta["class_names"] == (tiny_root / "classes.txt").read_text().split()
    assert (tmp_path / "model.pt2").is_file() and not attack["marker"].exists()


def test_a_lone_checkpoint_evaluates_from_its_stored_config(attack: dict[str, Path], compose_cfg,
                                                            tiny_root: Path, tmp_path: Path) -> None:
    """Outside its run folder, an untouched checkpoint's stored config passes the check and
    describes the model, as for predict (the default groups, resnet10, would not load it)."""
    lone = tmp_path / "lone.ckpt"
    shutil.copyfile(attack["run"], lone)
    overrides = ["eval.clips=1", "eval.crops=1", "trainer.progress=false", "device=cpu"]
    untouched = [f"checkpoint={attack['run']}", *overrides]
    assert run_eval(validate(compose_cfg([f"checkpoint={lone}", *overrides])),
                    [f"checkpoint={lone}", *overrides], tmp_path / "a") == \
        run_eval(validate(compose_cfg(untouched)), untouched, tmp_path / "b")


def test_run_config_false_drops_the_runs_config(attack: dict[str, Path],
                                                                compose_cfg, tiny_root: Path,
                                                                tmp_path: Path) -> None:
    """``run_config=false`` really drops the run's config: the default groups (resnet10) do not
    fit the run's one-layer ViT, and the error says so."""
    overrides = [*_command("eval", attack, "folder", tiny_root, tmp_path), "run_config=false",
                 "data=kinetics", f"data.root={tiny_root}", "data.crop_size=32", "data.short_side=32",
                 "data.num_frames=4", "data.num_workers=0"]
    with pytest.raises(ValueError, match="does not fit the configured model"):
        run_eval(validate(compose_cfg(overrides)), overrides, tmp_path)


# ---------------------------------------------------------------------- a config this user did not seal
def _theirs(compose_cfg) -> dict:
    """A stranger's run config: another model and clip, and every kind of machine key set to
    what a crafted config would (paths, workers, batch sizes, generated sizes, devices)."""
    cfg = OmegaConf.to_container(compose_cfg([
        "data=kinetics", "data.root=/their/data", "data.classes_file=/etc/shadow",
        "data.val_file=/proc/self/environ", "data.num_workers=100000", "data.batch_size=100000",
        "data.num_frames=16", "data.crop_size=224", "data.short_side=256", "data.sampling_rate=3",
        "data.fps=25", "data.sampler=segment", "model/backbone=timm", "model.backbone.name=resnet18",
        "+model.backbone.kwargs={checkpoint_path: /their/w.pth, depth: 3}",
        "model.init_from=/their/init.ckpt", "trainer.precision=bf16", "device=cuda:7",
        "eval.batch_size=100000", "predict.out=/home/me/.bashrc", "export.out=/home/me/x"]),
        resolve=True)
    return cfg


def test_only_what_defines_the_model_is_taken_from_an_unsealed_config(compose_cfg) -> None:
    theirs = _theirs(compose_cfg)
    base = checked_config(theirs, "RUN/config.yaml")
    composed = compose_cfg([])
    got, unused = model_part(base, composed, [], "RUN/config.yaml")
    for key in ("data.num_frames", "data.crop_size", "data.short_side", "data.sampling_rate",
                "data.fps", "data.sampler", "model.head", "trainer.precision"):
        assert OmegaConf.select(got, key) == OmegaConf.select(base, key), key
    assert got.model.backbone.name == "resnet18" and dict(got.model.backbone.kwargs) == {"depth": 3}
    for key in ("data.name", "data.root", "data.num_workers", "data.batch_size", "model.init_from",
                "device", "eval", "predict", "export", "memory", "optim", "trainer.max_epochs"):
        assert OmegaConf.select(got, key) == OmegaConf.select(composed, key), key
    assert "data.classes_file" not in got.data and "data.val_file" not in got.data  # synthetic's
    assert {"data.root", "data.num_workers", "data.classes_file", "model.init_from",
            "device"} <= set(unused)
    assert not {k for k in unused if k.split(".")[0] in ("eval", "predict", "export")}


def test_the_command_line_sets_what_it_names(compose_cfg) -> None:
    """A key the command line sets is its own, a clip key too; a group chosen there
    (``data=kinetics``) selects the dataset and keeps the run's clip."""
    base = checked_config(_theirs(compose_cfg), "f")
    overrides = ["data=kinetics", "data.root=/mine", "data.crop_size=32", "model/head=mean"]
    composed = compose_cfg(overrides)
    got, _ = model_part(base, composed, overrides, "f", scores_data=True)
    assert got.data.root == "/mine" and got.data.crop_size == 32 and got.data.num_frames == 16
    assert got.data.classes_file is None and got.data.val_file == "val.csv"  # the shipped defaults
    assert got.model.head == composed.model.head


def test_eval_refuses_a_dataset_it_would_change_silently(compose_cfg) -> None:
    base = checked_config(_theirs(compose_cfg), "RUN/config.yaml")
    with pytest.raises(RefusedConfig) as err:
        model_part(base, compose_cfg([]), [], "RUN/config.yaml", scores_data=True)
    text = str(err.value)
    assert text.startswith("RUN/config.yaml: this user did not seal it")
    for key in ("data.name", "data.root", "data.classes_file", "data.val_file"):
        assert key in text, key
    assert "/etc/shadow" not in text and "/their" not in text and "environ" not in text
    # generated data: its root only says where it is cached, its settings what it is
    gen = checked_config(OmegaConf.to_container(compose_cfg(["data.root=/their/cache"]),
                                                resolve=True), "f")
    model_part(gen, compose_cfg([]), [], "f", scores_data=True)  # no refusal
    spec = checked_config(OmegaConf.to_container(compose_cfg(["data.synthetic.size=32"]),
                                                 resolve=True), "f")
    with pytest.raises(RefusedConfig, match=r"differs from the run's in data\.synthetic\.size:"):
        model_part(spec, compose_cfg([]), [], "f", scores_data=True)


@pytest.mark.parametrize(("key", "value"), [
    ("crop_size", 4096), ("short_side", 100000), ("num_frames", 10**6), ("sampling_rate", 0),
    ("fps", 1e9), ("num_frames", -1)])
def test_a_clip_beyond_its_bound_is_refused_naming_the_key(compose_cfg, key: str,
                                                           value: float) -> None:
    theirs = OmegaConf.to_container(compose_cfg([]), resolve=True)
    theirs["data"][key] = value
    base = checked_config(theirs, "f")
    with pytest.raises(RefusedConfig, match=rf"f: data\.{key} is .*up to {FILE_DATA_BOUNDS[key]}"):
        model_part(base, compose_cfg([]), [], "f")
    got, _ = model_part(base, compose_cfg([f"data.{key}=8"]), [f"data.{key}=8"], "f")
    assert got.data[key] == 8  # the user's own value, whatever the file's
