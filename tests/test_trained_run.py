"""Loading a trained run (``videotrain.trained_run``): the config rule (run folder, else the
checkpoint's stored config, else the command line), and that eval, predict and export, which all
load through it, treat a checkpoint copied out of its run folder the same way: the same config,
the same results, or the same ``error:`` line with exit status 2."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import videotrain
import videotrain.run as run
from videotrain.build import clean_errors, validate
from videotrain.engine import checkpoint as ckpt
from videotrain.engine.inference import run_exported
from videotrain.eval import run_eval
from videotrain.export import export
from videotrain.predict import predict
from videotrain.trained_run import apply_overrides, find_run_config, load_trained, open_run

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
        assert "videotrain.trained_run" in imported, name
        others = {f"videotrain.{o}" for o in COMMANDS if o != name}
        assert not imported & others, (name, imported & others)
    assert not _imports("trained_run") & {f"videotrain.{o}" for o in COMMANDS}


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
