"""``python -m videotrain``: one real end-to-end run, and the errors a user sees for bad
overrides (on the CLI for two of them, in-process for the rest)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import videotrain.run as run
from videotrain.config.build import clean_errors


def test_end_to_end_cli_from_any_directory(run_cli, tiny_root: Path, tiny_synthetic_overrides,
                                           shrink_overrides, tiny_model_overrides, metrics_rows,
                                           tmp_path: Path) -> None:
    # the default data group (synthetic) finds the session dataset in $VIDEOTRAIN_CACHE
    args = [*tiny_synthetic_overrides, *shrink_overrides, *tiny_model_overrides,
            "trainer.max_epochs=1", "trainer.log_every_n_steps=1", "trainer.cpu_metered_steps=2"]
    cwd = tmp_path / "somewhere"
    cwd.mkdir()
    done = run_cli(args, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = list(cwd.glob("outputs/*/*/results.json"))  # Hydra's default run dir, under cwd
    assert len(outputs) == 1, list(cwd.rglob("*"))
    run_dir = outputs[0].parent
    results = json.loads(outputs[0].read_text())

    for key in ("val_top1", "val_top5"):
        assert 0.0 <= results[key] <= 1.0, (key, results[key])
    assert results["val_top5"] == 1.0  # 4 classes: the label is always in the top 5
    peak = results["train_peak_mem_mb"]
    rows = metrics_rows(run_dir)
    steps = [r for r in rows if "train_loss" in r]
    if os.access("/proc/self/clear_refs", os.W_OK):  # the CPU meter can measure here
        assert isinstance(peak, float) and peak >= 0  # (a tiny model may reuse freed memory)
        # trainer.cpu_metered_steps=2: steps 1 and 2 metered (the figure is step 2's), 3-4 not
        assert [r["peak_mem_mb"] is not None for r in steps] == [True, True, False, False]
        assert peak == steps[1]["peak_mem_mb"]
    else:  # it reports nothing rather than a wrong number
        assert peak is None
    assert results["step_time_s"] > 0 and results["clips_per_s"] > 0
    assert results["memory_strategy"] == "e2e"
    assert results["skipped_videos"] == 0 and results["epochs"] == 1 and results["steps"] == 4
    assert results["class_names"] == (tiny_root / "classes.txt").read_text().split()

    assert (run_dir / "config.yaml").exists()
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # one line per step
    val = [r for r in rows if "val_top1" in r]
    assert len(val) == 1 and val[0]["val_top1"] == results["val_top1"]


def test_cli_unknown_key_fails_naming_it(run_cli, tmp_path: Path) -> None:
    done = run_cli(["data.nonexistent_key=1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert done.returncode != 0
    assert "data.nonexistent_key" in done.stderr
    assert not (tmp_path / "run" / "results.json").exists()


@pytest.mark.slow  # the same messages are checked in-process below; this adds the exit code
def test_cli_bad_value_fails_naming_it(run_cli, run_overrides, tmp_path: Path) -> None:
    done = run_cli([*run_overrides(), "trainer.precision=64", f"hydra.run.dir={tmp_path}"],
                   cwd=tmp_path)
    assert done.returncode != 0
    assert "trainer.precision must be one of" in done.stderr


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.precision=64", "trainer.precision must be one of 32, bf16, 16; got '64'"),
        ("trainer.precision=16", "trainer.precision=16 needs CUDA"),
        ("optim.name=foo", "optim.name must be 'adamw' or 'sgd', got 'foo'"),
        ("trainer.grad_accum=0", "trainer.grad_accum must be >= 1"),
        ("trainer.max_epochs=0", "trainer.max_epochs must be >= 1"),
        ("trainer.cpu_metered_steps=1", "trainer.cpu_metered_steps must be >= 2"),
        ("sched.name=step", "sched.name must be 'cosine'"),
        ("logger.wandb.mode=sometimes", "logger.wandb.mode must be one of"),
        ("data.layout=csv", "data.layout must be one of kinetics, folder, ucf101, hmdb51, ssv2"),
        ("data.batch_size=64", "data.batch_size=64 exceeds the 16 training videos"),
        ("data.crop_size=64", "data.crop_size=64 exceeds data.short_side=32"),
    ],
)
def test_bad_value_fails_naming_the_key(override: str, message: str, run_overrides, compose_cfg,
                                        tmp_path: Path) -> None:
    cfg = compose_cfg([*run_overrides(), override])
    with pytest.raises(ValueError) as err:
        run.train(cfg, tmp_path)
    assert message in str(err.value)
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_cli_too_many_bad_videos_exits_nonzero(run_cli, run_overrides, tiny_copy: Path,
                                               tmp_path: Path) -> None:
    for rel in ["train/right_then_up/right_then_up_0000.mp4",
                "train/left_then_down/left_then_down_0002.mp4"]:
        (tiny_copy / rel).write_bytes(b"")
    done = run_cli([*run_overrides(root=tiny_copy), f"hydra.run.dir={tmp_path / 'run'}"],
                   cwd=tmp_path)
    assert done.returncode != 0
    output = done.stdout + done.stderr  # Hydra logs to stdout, errors go to stderr
    assert "BadDataError" in output and "data.max_bad_fraction=0.1" in output
    assert "right_then_up_0000.mp4" in output  # the warning names the file


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.num_frames=0"], "data.num_frames must be an integer >= 1, got 0"),
        (["data.batch_size=0"], "data.batch_size must be an integer >= 1, got 0"),
        (["data.fps=0"], "data.fps must be a number of frames per second > 0, got 0"),
        (["data.train_scale=[0.5,0.2]"], "data.train_scale must be [min, max] area fractions"),
        (["data.max_bad_fraction=1.5"], "data.max_bad_fraction must be a fraction in [0, 1], got 1.5"),
        (["memory=sbp", "memory.keep_ratio=1.5"], "memory.keep_ratio must be in (0, 1], got 1.5"),
        (["memory=frame_dropout", "memory.keep_ratio=0"], "memory.keep_ratio must be in (0, 1], got 0.0"),
        (["memory=auto", "memory.budget_gb=-1"], "memory.budget_gb must be > 0"),
        (["trainer.max_epochs=-3"], "trainer.max_epochs must be >= 1, got -3"),
        (["sched.min_lr_ratio=2"], "sched.min_lr_ratio must be a fraction in [0, 1], got 2.0"),
        (["eval.clips=0"], "eval.clips must be >= 1, got 0"),
    ],
)
def test_every_bad_value_is_one_line_before_any_data_is_read(
        overrides: list[str], message: str, run_overrides, compose_cfg, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    """Each invalid value is one `error:` line naming its key, exit status 2,
    checked before the data (here a data.root that does not exist) is looked at."""
    cfg = compose_cfg([*run_overrides(root=tmp_path / "no_such_dataset"), *overrides])
    with pytest.raises(SystemExit) as done, clean_errors():
        run.train(cfg, tmp_path / "run")
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert "Error in call to target" not in err[0]


def test_cli_missing_data_root_is_one_line(run_cli, tmp_path: Path) -> None:
    """A missing data.root (a FileNotFoundError) is one `error:` line and
    exit status 2, not a traceback."""
    done = run_cli(["data=kinetics", f"data.root={tmp_path / 'nowhere'}", "logger.wandb.mode=disabled",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"error: data.root: directory not found: {tmp_path / 'nowhere'}"]


@pytest.mark.slow  # a fresh interpreter each; the same errors are checked in-process above
def test_cli_strategy_value_and_missing_annotation_file(run_cli, tmp_path: Path) -> None:
    done = run_cli(["memory=sbp", "memory.keep_ratio=1.5", "logger.wandb.mode=disabled",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == ["error: memory.keep_ratio must be in (0, 1], got 1.5"]
    (tmp_path / "k").mkdir()
    done = run_cli(["data=kinetics", f"data.root={tmp_path / 'k'}", "logger.wandb.mode=disabled",
                    f"hydra.run.dir={tmp_path / 'run2'}"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"error: data.train_file: annotation file not found: {tmp_path / 'k' / 'train.csv'}"]
