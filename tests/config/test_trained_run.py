"""Loading a trained run (``videotrain.config.trained_run``): the config rule (run folder, else the
checkpoint's stored config, else the command line), and that eval, predict and export, which all
load through it, treat a checkpoint copied out of its run folder the same way: the same config,
the same results, or the same ``error:`` line with exit status 2."""

from __future__ import annotations

import ast
import builtins
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

import videotrain
import videotrain.run as run
from videotrain.config.build import clean_errors, validate
from videotrain.config.trained_run import apply_overrides, find_run_config, load_trained, open_run
from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.inference import run_exported
from videotrain.eval import run_eval
from videotrain.export import export
from videotrain.predict import predict
from videotrain.untrusted import FILE_DATA_BOUNDS, own

COMMANDS = ("eval", "predict", "export")


def _imports(module: str) -> set[str]:
    """The ``videotrain`` modules ``videotrain/<module>.py`` imports, at the top or inside
    functions (a lazy import ties the modules as much as a top-level one)."""
    tree = ast.parse((Path(videotrain.__file__).parent / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("videotrain.")}


def test_the_commands_load_through_trained_run_and_not_through_each_other() -> None:
    for name in COMMANDS:
        imported = _imports(name)
        assert "videotrain.config.trained_run" in imported, name
        others = {f"videotrain.{o}" for o in COMMANDS if o != name}
        assert not imported & others, (name, imported & others)
    assert not _imports("config/trained_run") & {f"videotrain.{o}" for o in COMMANDS}


def test_apply_overrides_keeps_the_run_and_takes_the_command_line(compose_cfg) -> None:
    saved = compose_cfg(["model/backbone=vit_tiny", "data.num_frames=4", "memory=sbp"])
    composed = compose_cfg(["eval.clips=2", "data.root=/x", "model/head=mean", "checkpoint=a.ckpt"])
    cfg = apply_overrides(saved, composed, ["eval.clips=2", "data.root=/x", "model/head=mean",
                                            "checkpoint=a.ckpt", "hydra.run.dir=/tmp/y"])
    assert cfg.model.backbone._target_ == saved.model.backbone._target_  # from the run
    assert cfg.data.num_frames == 4 and cfg.memory.keep_ratio == saved.memory.keep_ratio
    assert cfg.model.head == composed.model.head and cfg.data.root == "/x"  # from the command
    assert cfg.eval.clips == 2 and cfg.checkpoint == "a.ckpt"


def test_find_run_config_looks_in_the_run_folder_only(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("seed: 0\n")
    assert find_run_config(run_dir / "checkpoints" / "last.ckpt") == run_dir / "config.yaml"
    assert find_run_config(run_dir / "last.ckpt") == run_dir / "config.yaml"
    assert find_run_config(tmp_path / "elsewhere" / "last.ckpt") is None
    # two levels up is another folder, not the run's
    assert find_run_config(run_dir / "checkpoints" / "old" / "last.ckpt") is None


@pytest.fixture(scope="module")
def lone(tmp_path_factory: pytest.TempPathFactory, run_overrides, compose_cfg) -> dict[str, Path]:
    """A tiny run (one-layer ViT: the default groups, resnet10, would not load it), its last
    checkpoint copied alone into another folder, and a lone copy whose stored config has a key
    the schema does not have."""
    base = tmp_path_factory.mktemp("trained_run")
    run.train(compose_cfg(run_overrides(trainer__max_steps=2)), base / "run")
    in_run = base / "run" / "checkpoints" / "last.ckpt"
    alone = base / "shared" / "alone.ckpt"
    alone.parent.mkdir()
    shutil.copyfile(in_run, alone)
    blob = ckpt.load(in_run)
    blob["config"]["model"]["head"]["hiden_dim"] = 16  # a misspelt key: refused by the schema
    refused = base / "shared" / "refused.ckpt"
    torch.save(blob, refused)
    return {"run": in_run, "alone": alone, "refused": refused}


def _overrides(name: str, checkpoint: Path, video: Path, out: Path) -> list[str]:
    extra = {"eval": ["eval.clips=1", "eval.crops=1"],
             "predict": [f"video={video}", "eval.clips=2", "eval.crops=3"],
             "export": ["export.format=torch_export", f"export.out={out / 'model.pt2'}"]}[name]
    return [f"checkpoint={checkpoint}", *extra, "trainer.progress=false", "device=cpu"]


def _run(name: str, compose_cfg, checkpoint: Path, video: Path, out: Path) -> dict:
    """What ``python -m videotrain.NAME`` runs in its ``main``, in-process."""
    overrides = _overrides(name, checkpoint, video, out)
    cfg = validate(compose_cfg(overrides))
    with clean_errors():
        if name == "eval":
            run_eval(cfg, overrides, out)
            return json.loads((out / "eval.json").read_text())
        if name == "predict":
            return predict(cfg, overrides)
        return export(cfg, overrides, out)


def test_a_lone_checkpoint_gets_its_runs_config(lone: dict[str, Path], compose_cfg,
                                                tiny_root: Path) -> None:
    """Out of its run folder, the checkpoint's stored config is the base: the same model and
    data as the run folder's config.yaml gives, and no run folder."""
    opened = {}
    for which in ("run", "alone"):
        overrides = [f"checkpoint={lone[which]}"]
        opened[which] = open_run(compose_cfg(overrides), overrides)
    assert opened["run"].run_dir == lone["run"].parent.parent and opened["alone"].run_dir is None
    for key in ("model", "data", "memory"):
        assert opened["alone"].cfg[key] == opened["run"].cfg[key], key
    assert opened["alone"].cfg.model.backbone.num_layers == 1  # the run's, not the default groups'
    trained = load_trained(compose_cfg([f"checkpoint={lone['alone']}"]),
                           [f"checkpoint={lone['alone']}"], device="cpu")
    assert trained.class_names == (tiny_root / "classes.txt").read_text().split()  # the checkpoint's
    assert not trained.model.training and trained.model.strategy.name == "e2e"


@pytest.mark.parametrize("name", COMMANDS)
def test_a_lone_checkpoint_runs_as_in_its_run_folder(name: str, lone: dict[str, Path], compose_cfg,
                                                     tiny_root: Path, tmp_path: Path) -> None:
    """eval, predict and export of the lone copy give what they give in the run folder."""
    video = tiny_root / "val" / "right_then_up" / "right_then_up_0000.mp4"
    got = {which: _run(name, compose_cfg, lone[which], video, tmp_path / which)
           for which in ("run", "alone")}
    if name == "eval":
        for report in got.values():
            assert report.pop("checkpoint") and report.pop("files")
        assert got["alone"] == got["run"] and got["run"]["videos"] == 8
    elif name == "predict":
        assert got["alone"]["predictions"] == got["run"]["predictions"]
        assert len(got["run"]["predictions"][0]["top"]) == 4
    else:
        for meta in got.values():
            assert meta.pop("checkpoint") and meta.pop("path") and meta.pop("max_abs_diff_vs_eager") <= 1e-4
        assert got["alone"] == got["run"]
        assert got["run"]["class_names"] == (tiny_root / "classes.txt").read_text().split()
        video = torch.randn(2, *got["run"]["input"]["shape"][1:],
                            generator=torch.Generator().manual_seed(0))  # (B, T, C, H, W)
        want = run_exported(tmp_path / "run" / "model.pt2", "torch_export", video)
        torch.testing.assert_close(run_exported(tmp_path / "alone" / "model.pt2", "torch_export",
                                                video), want, rtol=0, atol=0)


def test_a_refused_lone_checkpoint_is_refused_alike(lone: dict[str, Path], compose_cfg,
                                                    tiny_root: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """A stored config the schema refuses: one and the same ``error:`` line from all three,
    naming the key, exit status 2, and nothing written."""
    video = tiny_root / "val" / "right_then_up" / "right_then_up_0000.mp4"
    lines = {}
    for name in COMMANDS:
        out = tmp_path / name
        with pytest.raises(SystemExit) as done:
            _run(name, compose_cfg, lone["refused"], video, out)
        assert done.value.code == 2
        lines[name] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert not (out / "eval.json").exists() and not (out / "model.pt2").exists()
    assert lines["eval"] == lines["predict"] == lines["export"]
    (line,) = lines["eval"]
    assert line.startswith(f"error: RefusedConfig: the config stored in {lone['refused']}: ")
    assert "model.head.hiden_dim" in line and "run_config=false" in line


def test_run_config_false_reads_neither_config(lone: dict[str, Path], compose_cfg,
                                               run_overrides) -> None:
    """``run_config=false``: the command line's groups describe the model, for the refused copy
    too (its stored config is not read), and its weights load into a plain e2e model while the
    config keeps its memory group."""
    groups = [o for o in run_overrides() if not o.startswith(("trainer.", "device="))]
    overrides = [f"checkpoint={lone['refused']}", "run_config=false", *groups, "memory=sbp",
                 "device=cpu"]
    cfg = compose_cfg(overrides)
    opened = open_run(cfg, overrides)
    assert opened.cfg is cfg and "hiden_dim" not in opened.cfg.model.head
    trained = load_trained(cfg, overrides, device="cpu")
    assert not trained.model.training and len(trained.class_names) == 4
    assert trained.model.strategy.name == "e2e"
    assert OmegaConf.select(trained.cfg, "memory._target_").endswith("StochasticBackprop")


# ---------------------------------------------------------------------- whose run: the seal
SECRET = "hunter2-SECRET-5f0c1e"  # a marker secret: its bytes must appear nowhere


@pytest.fixture
def stranger(lone: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the tiny run folder with its seal (made under the session's key) as it came;
    each test makes it someone else's its own way."""
    dst = tmp_path / "shared"
    shutil.copytree(lone["run"].parent.parent, dst, symlinks=True)
    return dst


@pytest.fixture
def opened_files(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path ``os.open`` / ``open`` is asked for from here on (the readers go through
    one or the other), so a test can say a file was never read."""
    seen: list[str] = []
    real_os_open, real_open = os.open, builtins.open

    def os_open(path, *args, **kwargs):
        seen.append(os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path))
        return real_os_open(path, *args, **kwargs)

    def py_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            seen.append(os.fsdecode(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", py_open)
    return seen


def _edit_config(run_dir: Path, edit) -> None:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    edit(config)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


def _secret_file(tmp_path: Path) -> Path:
    secret = tmp_path / "home" / ".netrc"
    secret.parent.mkdir()
    secret.write_text(f"machine example.org login me password {SECRET}\nleft_then_up\n")
    return secret


def test_the_trainer_seals_the_config_and_every_checkpoint(lone: dict[str, Path]) -> None:
    """``config.seal`` beside ``config.yaml`` (of its exact bytes) and ``config_seal`` in each
    checkpoint (of its stored config): this user's, by the key in their cache."""
    run_dir = lone["run"].parent.parent
    text = (run_dir / "config.yaml").read_bytes()
    assert own.is_sealed_file(run_dir / "config.yaml", text)
    assert (run_dir / "config.seal").read_text().strip() == own.seal(text)
    for step in sorted((run_dir / "checkpoints").glob("step-*.ckpt")):
        blob = ckpt.load(step)
        assert own.is_sealed_config(blob["config"], blob["config_seal"]), step
    assert not own.is_sealed_config(ckpt.load(lone["refused"])["config"],
                                    ckpt.load(lone["refused"])["config_seal"])  # edited after


def test_an_own_run_keeps_its_data_settings(lone: dict[str, Path], compose_cfg,
                                            stranger: Path, tiny_root: Path) -> None:
    """The user's own run, in its folder, copied elsewhere, or its checkpoint alone: its data
    settings are used (``eval checkpoint=...`` alone evaluates what was trained)."""
    for checkpoint in (lone["run"], stranger / "checkpoints" / "last.ckpt", lone["alone"]):
        overrides = [f"checkpoint={checkpoint}"]
        cfg = open_run(compose_cfg(overrides), overrides, scores_data=True).cfg
        assert cfg.data.name == "kinetics" and cfg.data.root == str(tiny_root), checkpoint
        assert cfg.data.num_workers == 0 and cfg.data.batch_size == 4  # the run's, not defaults


@pytest.mark.parametrize("how", ["edited", "another key", "forged seal", "stored, another key"])
def test_someone_elses_config_gives_the_model_only(how: str, lone: dict[str, Path], stranger: Path,
                                                   compose_cfg, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Edited (the seal no longer fits), sealed under another user's key, with a seal written
    by hand, or a lone checkpoint whose stored config was sealed under another key: the model
    and the clip come from it, everything this machine reads, writes or spends from the command
    line, and one log line names the keys not used (never their values)."""
    checkpoint = stranger / "checkpoints" / "last.ckpt"
    if how == "edited":
        _edit_config(stranger, lambda c: c["data"].update(num_workers=10**6, batch_size=10**6))
    elif how == "forged seal":
        (stranger / "config.seal").write_text("0" * 64 + "\n")
    elif how == "stored, another key":
        checkpoint = lone["alone"]
    if how != "edited":
        monkeypatch.setenv("VIDEOTRAIN_CACHE", str(tmp_path / "their-cache"))
        if how == "forged seal":  # this user has a key; the seal is not made with it
            own.seal(b"")
    overrides = [f"checkpoint={checkpoint}", "predict.topk=2"]
    composed = compose_cfg(overrides)
    with caplog.at_level("INFO", logger="videotrain.config.trained_run"):
        cfg = open_run(composed, overrides).cfg
    saved = OmegaConf.load(stranger / "config.yaml")
    for key in ("model.backbone", "model.head", "data.num_frames", "data.crop_size",
                "data.short_side", "data.sampling_rate", "data.fps", "trainer.precision"):
        assert OmegaConf.select(cfg, key) == OmegaConf.select(saved, key), key
    for key in ("data.name", "data.root", "data.num_workers", "data.batch_size", "device",
                "trainer.max_epochs", "memory", "predict"):
        assert OmegaConf.select(cfg, key) == OmegaConf.select(composed, key), key
    (line,) = [r.getMessage() for r in caplog.records if "not sealed by you" in r.getMessage()]
    assert "data.root" in line and "data.num_workers" in line and "kinetics" not in line
    assert "1000000" not in line and str(lone["run"].parent.parent) not in line.split(" is not")[1]


def test_a_secret_named_by_someone_elses_config_is_never_read(
        lone: dict[str, Path], stranger: Path, compose_cfg, tiny_root: Path, tmp_path: Path,
        opened_files: list[str], capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture, run_overrides) -> None:
    """A shared config naming the user's ``.netrc`` as ``data.classes_file`` (and
    ``data.val_file``): eval, predict and export never open it, and its bytes appear in no
    output, log or written file. Eval without a dataset on the command line is refused (one
    line, naming the keys); with the user's own dataset it evaluates on that."""
    secret = _secret_file(tmp_path)
    _edit_config(stranger, lambda c: c["data"].update(classes_file=str(secret),
                                                      val_file=str(secret)))
    checkpoint = stranger / "checkpoints" / "last.ckpt"
    (stranger / "results.json").unlink()  # class names from the checkpoint, else the dataset
    video = tiny_root / "val" / "right_then_up" / "right_then_up_0000.mp4"
    out = tmp_path / "out"
    data = [o for o in run_overrides() if o.startswith(("data=", "data.root"))]
    written = []
    with caplog.at_level("INFO"):
        with pytest.raises(SystemExit) as done:
            _run("eval", compose_cfg, checkpoint, video, out / "refused")
        assert done.value.code == 2
        refused = capsys.readouterr().err
        (line,) = [x for x in refused.splitlines() if x.startswith("error:")]
        assert "data.classes_file" in line and "data.val_file" in line and str(secret) not in line
        for name in COMMANDS:
            overrides = [*_overrides(name, checkpoint, video, out / name), *data,
                         f"predict.out={out / 'predict.json'}"]
            cfg = validate(compose_cfg(overrides))
            with clean_errors():
                if name == "eval":
                    assert run_eval(cfg, overrides, out / name) >= 0  # the user's own val.csv
                elif name == "predict":
                    predict(cfg, overrides)
                else:
                    export(cfg, overrides, out / name)
        written = [p for p in out.rglob("*") if p.is_file()]
    assert str(secret) not in opened_files and all(Path(p) != secret for p in opened_files)
    text = capsys.readouterr().out + caplog.text + refused
    assert SECRET not in text and str(secret) not in text
    assert (out / "predict.json").is_file() and (out / "export" / "model.pt2.json").is_file()
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), path


def test_eval_of_someone_elses_run_without_a_dataset_is_refused(
        stranger: Path, compose_cfg, tiny_root: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, run_overrides) -> None:
    """Without the user's seal the run's dataset is not used, and evaluating on the command
    line's default one instead would give other figures silently: one ``error:`` line naming
    the keys (their values never), exit status 2; with the dataset given, the figures are those
    of the user's own run."""
    monkeypatch.setenv("VIDEOTRAIN_CACHE", str(tmp_path / "their-cache"))
    checkpoint = stranger / "checkpoints" / "last.ckpt"
    video = tiny_root / "val" / "right_then_up" / "right_then_up_0000.mp4"
    with pytest.raises(SystemExit) as done:
        _run("eval", compose_cfg, checkpoint, video, tmp_path / "refused")
    assert done.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: RefusedConfig: {stranger / 'config.yaml'}: this user did not seal")
    assert "data.name" in line and "data.root" in line and str(tiny_root) not in line
    assert not (tmp_path / "refused" / "eval.json").exists()


def test_a_clip_larger_than_a_file_may_set_is_refused(stranger: Path, compose_cfg,
                                                      tiny_root: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """``data.crop_size: 4096`` in someone else's config (10.7 GB in predict): refused naming
    the key and the bound before anything is built; the command line may still set it."""
    _edit_config(stranger, lambda c: c["data"].update(crop_size=4096, short_side=4096))
    checkpoint = stranger / "checkpoints" / "last.ckpt"
    video = tiny_root / "val" / "right_then_up" / "right_then_up_0000.mp4"
    for name in COMMANDS:
        with pytest.raises(SystemExit) as done:
            _run(name, compose_cfg, checkpoint, video, tmp_path / name)
        assert done.value.code == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert "data.crop_size is 4096" in line or "data.short_side is 4096" in line, line
        assert f"up to {FILE_DATA_BOUNDS['crop_size']}" in line or "up to 512" in line
    overrides = [f"checkpoint={checkpoint}", "data.crop_size=32", "data.short_side=32"]
    cfg = open_run(compose_cfg(overrides), overrides).cfg
    assert cfg.data.crop_size == 32 and cfg.data.short_side == 32
