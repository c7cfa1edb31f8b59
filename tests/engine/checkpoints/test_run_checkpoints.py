"""The run's checkpoint owner (``RunCheckpoints``): ``TrainState`` writes and reads itself
under the checkpoint layout's key names; a checkpoint in the layout the trainer wrote before
the owner existed (two hand-kept key lists) still resumes; save / restore / best / set-aside
on a tiny model, without data."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

import videotrain.run as run
from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.checkpoints.run import Checkpointed, RunCheckpoints, TrainState
from videotrain.engine.distributed import Comm
from videotrain.memory.e2e import EndToEnd
from videotrain.untrusted import UnsafeFileError

# The top-level keys of a training checkpoint (layout 2) as the trainer wrote them with its
# hand-kept list, before TrainState serialised itself. Frozen here: a renamed or dropped
# TrainState field would change what a checkpoint holds, and old files would stop resuming.
LAYOUT_2_KEYS = (
    ckpt.FORMAT_KEY, "model", "optimizer", "scheduler", "scaler", "strategy", "rng_per_rank",
    "world_size", "step", "epoch", "consumed", "total_steps", "skipped", "step_times",
    "data_waits", "peaks", "last_val", "val_step", "best_top1", "best_step", "config",
    "class_names",
)
# What this version writes: those, and this user's seal of the stored config (untrusted.own);
# a file without the seal (the layout above) still resumes.
WRITTEN_KEYS = (*LAYOUT_2_KEYS, "config_seal")
STATE_KEYS = ("step", "epoch", "consumed", "skipped", "step_times", "data_waits", "peaks",
              "last_val", "val_step", "best_top1", "best_step")
CPU = torch.device("cpu")


def test_train_state_round_trip_keeps_the_preflight_bad_videos() -> None:
    state = TrainState(step=7, epoch=1, consumed=12, skipped={"b.mp4", "a.mp4"},
                       step_times=[0.5, 0.25], data_waits=[0.0, 0.125], peaks=[10.0, 11.5],
                       last_val={"val_top1": 0.5}, val_step=4, best_top1=0.5, best_step=4)
    saved = state.state_dict()
    assert tuple(saved) == STATE_KEYS
    assert saved["skipped"] == ["a.mp4", "b.mp4"]  # a list: checkpoints hold no sets
    fresh = TrainState(skipped={"preflight.mp4"})
    fresh.load_state_dict(saved)
    assert fresh.skipped == {"a.mp4", "b.mp4", "preflight.mp4"}
    fresh.skipped = state.skipped
    assert fresh == state
    with pytest.raises(KeyError, match="best_step"):  # a checkpoint without a field is not read
        TrainState().load_state_dict({k: v for k, v in saved.items() if k != "best_step"})


def _parts(seed: int) -> Checkpointed:
    torch.manual_seed(seed)
    module = torch.nn.Linear(3, 2)
    module.strategy = EndToEnd()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return Checkpointed(module, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False),
                        TrainState(), total_steps=10)


def _step(parts: Checkpointed) -> None:
    parts.module(torch.randn(4, 3)).square().sum().backward()  # (4, 2)
    parts.optimizer.step()
    parts.optimizer.zero_grad()
    parts.scheduler.step()
    parts.state.step += 1


def test_save_restore_best_and_set_aside(tmp_path: Path) -> None:
    owner = RunCheckpoints(tmp_path, keep_last_k=2, resume="auto", comm=Comm(), device=CPU,
                           config={"optim": {"lr": 0.1}}, class_names=["a", "b"])
    assert owner.find_resume() is None  # nothing to resume: a fresh start
    parts = _parts(0)
    for _ in range(3):
        _step(parts)
        owner.save(parts)
    owner.mark_best()
    _step(parts)
    path = owner.save(parts)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "best.ckpt", "last.ckpt", "step-00000003.ckpt", "step-00000004.ckpt"]
    assert ckpt.load(folder / "best.ckpt")["step"] == 4
    assert owner.save_unless_saved(parts) == path  # step 4's is written: not again
    assert path.stat().st_mtime_ns == (folder / "step-00000004.ckpt").stat().st_mtime_ns
    blob = ckpt.load(path)
    assert set(blob) == set(WRITTEN_KEYS)
    assert blob["class_names"] == ["a", "b"] and blob["config"] == {"optim": {"lr": 0.1}}
    expected = torch.rand(5)  # the RNG state after the save is what the restore brings back
    _step(parts)  # moves on from the checkpoint: the restore must undo this

    again = RunCheckpoints(tmp_path, keep_last_k=2, resume="auto", comm=Comm(), device=CPU,
                           config={"optim": {"lr": 0.1}}, class_names=["a", "b"])
    assert again.find_resume() == str(path) and again.find_resume() == str(path)  # decided once
    fresh, other = _parts(1), _parts(2)  # other weights, other RNG state
    assert again.restore(fresh)
    assert torch.equal(torch.rand(5), expected)  # this rank's RNG state, as saved
    assert not again.restore(other)  # the contents are used once
    assert fresh.state == TrainState(**{k: blob[k] for k in STATE_KEYS if k != "skipped"})
    assert all(torch.equal(blob["model"][k], v) for k, v in fresh.module.state_dict().items())
    assert fresh.scheduler.last_epoch == 4 and fresh.optimizer.state_dict()["state"]
    assert again.save_unless_saved(fresh) is None  # the resumed step's checkpoint exists

    over = RunCheckpoints(tmp_path, keep_last_k=2, resume="false", comm=Comm(), device=CPU)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert over.find_resume() is None and not folder.exists()
    (aside,) = tmp_path.glob("checkpoints.replaced-*")
    assert "step-00000004.ckpt" in {p.name for p in aside.iterdir()}
    assert len(list(tmp_path.glob("metrics.replaced-*.jsonl"))) == 1


def test_starting_over_moves_names_and_follows_no_link(tmp_path: Path) -> None:
    """``trainer.resume=false`` sets the previous run aside by renaming names in the run
    folder: a ``metrics.jsonl`` that is a link is moved as a link (its target untouched), a
    ``checkpoints`` link is refused, not moved with what it points to."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    run_dir.mkdir()
    (victim / "checkpoints").mkdir(parents=True)
    (victim / "metrics.jsonl").write_text("the user's file\n")
    (victim / "checkpoints" / "step-00000001.ckpt").write_bytes(b"theirs")
    (run_dir / "metrics.jsonl").symlink_to(victim / "metrics.jsonl")
    RunCheckpoints(run_dir, keep_last_k=2, resume="false", comm=Comm(), device=CPU).find_resume()
    (moved,) = run_dir.glob("metrics.replaced-*.jsonl")
    assert moved.is_symlink() and not (run_dir / "metrics.jsonl").exists()
    assert (victim / "metrics.jsonl").read_text() == "the user's file\n"
    (run_dir / "checkpoints").symlink_to(victim / "checkpoints")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        RunCheckpoints(run_dir, keep_last_k=2, resume="false", comm=Comm(),
                       device=CPU).find_resume()
    assert [p.name for p in (victim / "checkpoints").iterdir()] == ["step-00000001.ckpt"]
    assert (run_dir / "checkpoints").is_symlink()


BASE = dict(trainer__max_epochs=1, trainer__checkpoint_every_n_steps=2, model__head__dropout=0.5)


def test_a_checkpoint_in_the_old_hand_written_layout_resumes_exactly(
    run_overrides, compose_cfg, metrics_rows, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Rewrite step 2's checkpoint of a finished 4-step run as a plain dict with exactly the
    layout-2 keys (what the trainer wrote before TrainState serialised itself), in a fresh
    folder, with ``torch.save``: the run resumes from it and repeats steps 3 and 4 bit for bit."""
    overrides = run_overrides(**BASE)
    ref = tmp_path / "reference"
    ref_results = run.train(compose_cfg(overrides), ref)
    written = ckpt.load(ref / "checkpoints" / "step-00000002.ckpt")
    assert set(written) == set(WRITTEN_KEYS)  # what this version writes: no key more or less
    old = {key: written[key] for key in LAYOUT_2_KEYS}
    old["skipped"] = list(old["skipped"])
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    path = resumed / "checkpoints" / "step-00000002.ckpt"
    torch.save(old, path)
    shutil.copy(ref / "metrics.jsonl", resumed / "metrics.jsonl")  # rows after step 2 are dropped
    with caplog.at_level(logging.INFO, logger="videotrain.engine.checkpoints.run"):
        results = run.train(compose_cfg(overrides), resumed)
    assert f"resumed from {path} at step 2 (epoch 0)" in caplog.text
    losses = [(r["step"], r["train_loss"]) for r in metrics_rows(resumed) if "train_loss" in r]
    assert losses == [(r["step"], r["train_loss"]) for r in metrics_rows(ref) if "train_loss" in r]
    assert [s for s, _ in losses] == [1, 2, 3, 4]
    assert results["param_digests"] == ref_results["param_digests"]
    assert results["steps"] == 4
