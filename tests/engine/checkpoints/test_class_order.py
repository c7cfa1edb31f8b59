"""Checkpoints carry their class names; resume, ``videotrain.eval`` and ``model.init_from``
refuse a head whose classes are numbered differently from the dataset's.

The dataset: the tiny HMDB51 tree with two classes renamed ``climb`` and ``climb_stairs``, the
names that videotrain numbered in another order before it sorted HMDB51's classes by name. A
"legacy" checkpoint is one of its training checkpoints without ``class_names``, as every
checkpoint written before looks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import videotrain.config.build as builder
from videotrain import run
from videotrain.config.trained_run import apply_overrides
from videotrain.engine.checkpoints import format as ckpt
from videotrain.eval import evaluate_checkpoint

RENAME = {"left_then_down": "climb", "left_then_up": "climb_stairs"}
SORTED = ["climb", "climb_stairs", "right_then_down", "right_then_up"]
LEGACY = ["climb_stairs", "climb", "right_then_down", "right_then_up"]  # by split-file name


@pytest.fixture(scope="module")
def hmdb_pairs(layout_root, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hmdb_pairs") / "hmdb"
    shutil.copytree(layout_root("hmdb51"), root)
    splits = root / "testTrainMulti_7030_splits"
    for old, new in RENAME.items():
        (root / "hmdb51_org" / old).rename(root / "hmdb51_org" / new)
        for fold in (1, 2, 3):
            (splits / f"{old}_test_split{fold}.txt").rename(splits / f"{new}_test_split{fold}.txt")
    return root


@pytest.fixture(scope="module")
def overrides(hmdb_pairs: Path, run_overrides) -> list[str]:
    return ["data=hmdb51", *(o for o in run_overrides(hmdb_pairs) if not o.startswith("data="))]


@pytest.fixture(scope="module")
def trained(overrides: list[str], compose_cfg, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step HMDB51 run (read-only: copy it to change it)."""
    run_dir = tmp_path_factory.mktemp("hmdb_run") / "run"
    run.train(compose_cfg([*overrides, "trainer.max_steps=2"]), run_dir)
    return run_dir


def rewrite(path: Path, **changes) -> Path:
    """The checkpoint at ``path`` with ``changes`` (None deletes a key), written in place."""
    blob = ckpt.load(path)
    for key, value in changes.items():
        blob.pop(key, None) if value is None else blob.__setitem__(key, value)
    ckpt.save_atomic(blob, path)
    return path


def copy_run(trained: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the run whose step files have ``changes``; returns the copy's folder."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir, symlinks=True)
    for step in ckpt.CheckpointDir(run_dir / "checkpoints").step_files():
        rewrite(step, **changes)
    return run_dir


def test_checkpoints_record_their_class_names(trained: Path) -> None:
    blob = ckpt.load(trained / "checkpoints" / "last.ckpt")
    assert blob["class_names"] == SORTED


def test_resume_refuses_a_legacy_hmdb51_checkpoint(trained: Path, tmp_path: Path, overrides,
                                                   compose_cfg) -> None:
    run_dir = copy_run(trained, tmp_path, class_names=None)
    for mode in ("auto", "force"):
        with pytest.raises(ValueError) as err:
            run.train(compose_cfg([*overrides, "trainer.max_steps=3", f"trainer.resume={mode}"]), run_dir)
        text = str(err.value)
        assert text.startswith(f"cannot resume from {run_dir / 'checkpoints'}")
        assert "numbered HMDB51's classes in the order of their split-file names" in text
        # by label: class names (from a checkpoint, a dataset's files) are never echoed
        assert "label 0 here is label 1 in the checkpoint" in text and "trainer.resume=false" in text
        assert "climb" not in text


def test_resume_refuses_the_same_classes_in_another_order(trained: Path, tmp_path: Path,
                                                          overrides, compose_cfg) -> None:
    run_dir = copy_run(trained, tmp_path, class_names=LEGACY)
    with pytest.raises(ValueError, match="its classes and this dataset's differ: the same 4 "
                                         "classes in another order"):
        run.train(compose_cfg([*overrides, "trainer.max_steps=3"]), run_dir)


def _eval_cfg(run_dir: Path, compose_cfg, checkpoint: Path):
    extra = [f"checkpoint={checkpoint}", "eval.clips=1", "eval.crops=1"]
    return apply_overrides(OmegaConf.load(run_dir / "config.yaml"), compose_cfg(extra), extra)


def test_eval_refuses_a_legacy_or_reordered_checkpoint(trained: Path, tmp_path: Path,
                                                       compose_cfg) -> None:
    legacy = copy_run(trained, tmp_path, class_names=None) / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError, match=f"cannot evaluate {legacy}: it was trained on HMDB51 by "
                                         "a videotrain version that numbered"):
        evaluate_checkpoint(_eval_cfg(trained, compose_cfg, legacy), tmp_path / "eval")
    assert not (tmp_path / "eval" / "eval.json").exists()
    other = rewrite(shutil.copy(legacy, tmp_path / "other.ckpt"),
                    class_names=["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="its classes and this dataset's differ: other classes"):
        evaluate_checkpoint(_eval_cfg(trained, compose_cfg, other), tmp_path / "eval")
    # the run's own checkpoint evaluates
    report = evaluate_checkpoint(_eval_cfg(trained, compose_cfg, trained / "checkpoints" / "last.ckpt"),
                                 tmp_path / "eval")
    assert report["videos"] == 8


@pytest.mark.slow  # a fresh interpreter (~15 s); the same check runs in-process above
def test_eval_cli_gives_one_error_line(trained: Path, tmp_path: Path) -> None:
    legacy = copy_run(trained, tmp_path, class_names=None) / "checkpoints" / "last.ckpt"
    cmd = [sys.executable, "-m", "videotrain.eval", f"checkpoint={legacy}",
           f"hydra.run.dir={tmp_path / 'eval'}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=os.environ.copy(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert errors[0].startswith(f"error: ClassOrderMismatch: cannot evaluate {legacy}: it was "
                                "trained on HMDB51")


def test_init_from_refuses_a_head_in_another_order(trained: Path, tmp_path: Path, overrides,
                                                   compose_cfg) -> None:
    source = trained / "checkpoints" / "last.ckpt"

    def build(path: Path, names: list[str]):
        cfg = compose_cfg([*overrides, f"model.init_from={path}"])
        return builder.build_model(cfg, len(names), class_names=names)

    build(source, SORTED)  # the same classes, the same order: the head loads
    build(source, ["a", "b", "c", "d"])  # other classes: fine-tuning, the head loads as before
    legacy = rewrite(shutil.copy(source, tmp_path / "legacy.ckpt"), class_names=None)
    with pytest.raises(ValueError, match=f"cannot fine-tune from model.init_from={legacy}: it was "
                                         "trained on HMDB51"):
        build(legacy, SORTED)
    reordered = rewrite(shutil.copy(source, tmp_path / "reordered.ckpt"), class_names=LEGACY)
    with pytest.raises(ValueError, match="the same 4 classes in another order"):
        build(reordered, SORTED)
    build(reordered, SORTED[:3])  # 3 classes: the head is re-initialised, nothing to refuse


def test_what_an_old_checkpoint_without_class_names_reveals() -> None:
    from videotrain.engine.checkpoints.class_order import class_order_problem, saved_class_names

    hmdb = {"config": {"data": {"layout": "hmdb51"}}, "model": {}}
    assert saved_class_names(hmdb, SORTED, "hmdb51") == (LEGACY, True)
    # the synthetic classes have no name that is another's prefix: numbered alike, not refused
    synthetic = ["left_then_down", "left_then_up", "right_then_down", "right_then_up"]
    assert class_order_problem(hmdb, "x.ckpt", synthetic, "hmdb51", "evaluate") is None
    # other layouts' rules have not changed, and a checkpoint without config tells nothing
    assert saved_class_names({"config": {"data": {"layout": "ucf101"}}}, SORTED, "ucf101") == (None, False)
    assert class_order_problem({"model": {}}, "x.ckpt", SORTED, "hmdb51", "evaluate") is None


def test_predict_names_a_legacy_checkpoints_classes_in_its_order(trained: Path) -> None:
    from videotrain.config.trained_run import class_names_of

    cfg = OmegaConf.load(trained / "config.yaml")
    blob = ckpt.load(trained / "checkpoints" / "last.ckpt")
    assert class_names_of(cfg, None, 4, blob) == SORTED
    blob.pop("class_names")
    assert class_names_of(cfg, None, 4, blob) == LEGACY
