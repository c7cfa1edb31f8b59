"""Resume, guarded: the config a checkpoint was written with must match in what changes
training (``trainer.resume=auto``), unless forced; ``trainer.resume=false`` starts over; a
truncated newest checkpoint falls back to the previous one; an unsafe one is refused; a
different world size is refused (mid-epoch, even when forced); keep_last_k and best.ckpt."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Annotated

import pytest
import torch

import videotrain.run as run
from videotrain import NEUTRAL
from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.checkpoints.resume import config_diff, flatten, one_sided
from videotrain.engine.checkpoints.run import ResumeRefused
from videotrain.engine.settings import resume_mode

BASE = dict(trainer__max_epochs=1, trainer__checkpoint_every_n_steps=2, model__head__dropout=0.5)


def _losses(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]


@pytest.fixture(scope="module")
def finished(run_overrides, compose_cfg, tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4). Copy it before changing it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run.train(compose_cfg(run_overrides(**BASE)), out)
    return out


@pytest.fixture
def run_dir(finished: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished, dst, symlinks=True)
    return dst


def test_config_diff_ignores_math_neutral_keys() -> None:
    old = {"optim": {"lr": 0.001, "name": "adamw"}, "trainer": {"max_epochs": 2, "grad_accum": 1},
           "logger": {"wandb": {"mode": "offline"}}, "data": {"num_workers": 4, "train_scale": [0.25, 1]}}
    new = {"optim": {"lr": 0.002, "name": "adamw"}, "trainer": {"max_epochs": 9, "grad_accum": 1},
           "logger": {"wandb": {"mode": "disabled"}}, "data": {"num_workers": 0, "train_scale": [0.25, 1.0]},
           "seed": 1}
    assert flatten(old)["data.train_scale"] == [0.25, 1]
    both, added = one_sided(config_diff(old, new))
    assert both == [("optim.lr", 0.001, 0.002)]
    assert [k for k, _, _ in added] == ["seed"]  # new on one side: warned about, not refused
    assert config_diff(None, new) == []
    assert [resume_mode(v) for v in ("auto", "force", False, "false", True)] == [
        "auto", "force", "false", "false", "auto"]



def test_math_neutral_keys_are_the_marked_fields() -> None:
    """MATH_NEUTRAL is derived from the NEUTRAL marks on the fields that declare the keys: the
    trainer's are the ten it always listed and the compiler's two (the same math, compiled),
    and marking a field is what makes a key neutral."""
    import dataclasses

    from videotrain.engine.checkpoints import resume
    from videotrain.engine.trainer import TrainerSettings

    trainer = {k for k in resume.MATH_NEUTRAL if k.startswith("trainer.")}
    assert trainer == {f"trainer.{k}" for k in (
        "max_epochs", "max_steps", "progress", "log_every_n_steps", "checkpoint_every_n_steps",
        "keep_last_k", "resume", "val_every_n_epochs", "test_after_fit", "cpu_metered_steps",
        "compile", "compile_mode")}
    assert resume.is_neutral("trainer.max_epochs") and not resume.is_neutral("trainer.grad_clip")
    assert resume.is_neutral("logger.wandb.mode") and resume.is_neutral("data.num_workers")
    assert {f.name for f in dataclasses.fields(TrainerSettings) if f.metadata.get("math_neutral")} == {
        k.removeprefix("trainer.") for k in trainer}

    @dataclasses.dataclass
    class Settings:
        every: int = dataclasses.field(default=1, metadata=NEUTRAL)
        lr: float = 0.1

    assert resume.marked_neutral(Settings, "x.") == ("x.every",)


def test_every_neutral_key_is_marked_where_it_is_declared() -> None:
    """No hand list: the data keys are marked on build_data's arguments (Annotated), the logger's
    wandb node on LoggerSettings, the eval keys on EvalSettings, the root's on RunSettings; a
    nested marked dataclass field is a whole node (a prefix), and each marked key is a real key
    of the composed default config."""
    from omegaconf import OmegaConf

    from videotrain.config.build import compose_cfg
    from videotrain.engine.checkpoints import resume

    rest = {k for k in resume.MATH_NEUTRAL if not k.startswith("trainer.")}
    assert rest == {"data.num_workers", "data.worker_timeout", "data.val_batch_size",
                    "data.max_bad_fraction", "logger.wandb.", "eval.clips", "eval.crops",
                    "eval.aggregate", "eval.batch_size", "eval.frame_chunk", "checkpoint",
                    "run_config", "device"}
    keys = set(resume.flatten(OmegaConf.to_container(compose_cfg([]), resolve=False)))
    for key in resume.MATH_NEUTRAL:
        assert any(k == key or k.startswith(key) for k in keys if key.endswith(".")) or key in keys, key
    assert not resume.is_neutral("data.batch_size") and not resume.is_neutral("seed")

    assert resume.annotated_neutral(_marked_fn, "g.") == ("g.a",)
    assert resume.marked_neutral(_Outer, "o.") == ("o.whole.", "o.part.y")


def _marked_fn(a: Annotated[int, "math_neutral"], b: int = 0) -> None: ...


@dataclasses.dataclass
class _Inner:
    x: int = 0
    y: int = dataclasses.field(default=0, metadata=NEUTRAL)


@dataclasses.dataclass
class _Outer:
    whole: _Inner = dataclasses.field(default_factory=_Inner, metadata=NEUTRAL)
    part: _Inner = dataclasses.field(default_factory=_Inner)


def test_invalid_resume_value_names_the_key(run_overrides, compose_cfg, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="trainer.resume must be one of auto, force, false; got 'maybe'"):
        run.train(compose_cfg(run_overrides(trainer__resume="maybe")), tmp_path)
    with pytest.raises(ValueError, match="trainer.keep_last_k must be an integer >= 1 or null"):
        run.train(compose_cfg(run_overrides(trainer__keep_last_k=0)), tmp_path)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_changed_lr_is_refused_listing_the_key(run_dir: Path, run_overrides, compose_cfg) -> None:
    config_before = (run_dir / "config.yaml").read_text()
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(ResumeRefused) as refused:
        run.train(compose_cfg(run_overrides(**BASE, optim__lr=0.002)), run_dir)
    message = str(refused.value)
    path = run_dir / "checkpoints" / "step-00000004.ckpt"
    assert message.splitlines()[0] == (f"cannot resume from {path}: the config differs from the "
                                       "one it was written with in what changes training: optim.lr")
    assert "  optim.lr: 0.001 -> 0.002" in message.splitlines()
    assert "trainer.resume=force" in message and "trainer.resume=false" in message
    # nothing of the refused run was written
    assert (run_dir / "config.yaml").read_text() == config_before
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before


def test_math_neutral_changes_resume(run_dir: Path, run_overrides, compose_cfg, metrics_rows,
                                     caplog: pytest.LogCaptureFixture) -> None:
    cfg = compose_cfg(run_overrides(**{**BASE, "trainer__max_epochs": 2}, trainer__progress=True,
                                    trainer__log_every_n_steps=2, logger__wandb__project="other",
                                    trainer__keep_last_k=3, eval__clips=2))
    with caplog.at_level(logging.INFO):
        results = run.train(cfg, run_dir)
    assert "resumed from" in caplog.text and "at step 4 (epoch 1)" in caplog.text
    assert "training now ends at step 8, not 4" in caplog.text
    assert results["steps"] == 8
    assert [s for s, _ in _losses(metrics_rows(run_dir))] == [1, 2, 3, 4, 6, 8]


def test_force_resumes_with_a_warning(run_dir: Path, run_overrides, compose_cfg,
                                      caplog: pytest.LogCaptureFixture) -> None:
    cfg = compose_cfg(run_overrides(**{**BASE, "trainer__max_epochs": 2}, optim__lr=0.002,
                                    trainer__resume="force"))
    with caplog.at_level(logging.WARNING):
        results = run.train(cfg, run_dir)
    assert "trainer.resume=force: resuming from" in caplog.text
    assert "  optim.lr: 0.001 -> 0.002" in caplog.text
    assert results["steps"] == 8
    saved = ckpt.load(run_dir / "checkpoints" / "last.ckpt")
    assert saved["config"]["optim"]["lr"] == 0.002  # new checkpoints record the new config
    assert saved["config"]["trainer"]["resume"] == "force"


def test_resume_false_starts_over(run_dir: Path, run_overrides, compose_cfg, metrics_rows,
                                  finished: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        results = run.train(compose_cfg(run_overrides(**BASE, trainer__resume="false")), run_dir)
    assert "trainer.resume=false: starting over" in caplog.text and results["steps"] == 4
    (old,) = run_dir.glob("checkpoints.replaced-*")
    assert sorted(p.name for p in old.iterdir()) == sorted(
        p.name for p in (finished / "checkpoints").iterdir())
    assert len(list(run_dir.glob("metrics.replaced-*.jsonl"))) == 1
    # a fresh run: each step once, and the same losses (same seed) as the first time
    assert _losses(metrics_rows(run_dir)) == _losses(metrics_rows(finished))


def test_truncated_last_falls_back_to_the_previous(run_dir: Path, run_overrides, compose_cfg,
                                                   metrics_rows, finished: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    folder = run_dir / "checkpoints"
    newest = folder / "step-00000004.ckpt"
    assert os.readlink(folder / "last.ckpt") == newest.name
    data = (folder / "last.ckpt").read_bytes()
    (folder / "last.ckpt").write_bytes(data[: len(data) // 3])  # truncates the file it names
    with caplog.at_level(logging.INFO):
        run.train(compose_cfg(run_overrides(**BASE)), run_dir)
    previous = folder / "step-00000002.ckpt"
    assert (f"checkpoint {newest} (last.ckpt pointing to it) is unreadable" in caplog.text)
    assert f"resuming from the previous checkpoint {previous}" in caplog.text
    assert f"resumed from {previous} at step 2" in caplog.text
    # steps 3 and 4 were trained again, exactly as the first time
    assert _losses(metrics_rows(run_dir)) == _losses(metrics_rows(finished))
    assert ckpt.load(folder / "last.ckpt")["step"] == 4


class CreatesAFile:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_unsafe_newest_checkpoint_is_refused(run_dir: Path, run_overrides, compose_cfg,
                                             tmp_path: Path) -> None:
    marker = tmp_path / "created-by-unpickling"
    evil = run_dir / "checkpoints" / "step-00000099.ckpt"
    torch.save({"videotrain_format": 2, "model": {}, "x": CreatesAFile(marker)}, evil)
    os.remove(run_dir / "checkpoints" / "last.ckpt")
    os.symlink(evil.name, run_dir / "checkpoints" / "last.ckpt")
    with pytest.raises(ckpt.UnsafeCheckpointError) as refused:
        run.train(compose_cfg(run_overrides(**BASE)), run_dir)
    assert str(refused.value).startswith(
        f"{evil} is not a safe videotrain checkpoint: it needs arbitrary unpickling (")
    assert not marker.exists() and evil.exists()  # refused, and left for the user to look at


def test_keep_last_k_and_best_ckpt(run_overrides, compose_cfg, metrics_rows,
                                   tmp_path: Path) -> None:
    cfg = compose_cfg(run_overrides(trainer__max_epochs=3, trainer__checkpoint_every_n_steps=1,
                                    trainer__keep_last_k=2, model__head__dropout=0.5))
    results = run.train(cfg, tmp_path)  # 12 steps, 12 saves (+3 at epoch ends)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "best.ckpt", "last.ckpt", "step-00000011.ckpt", "step-00000012.ckpt"]
    vals = [(r["step"], r["val_top1"]) for r in metrics_rows(tmp_path) if "val_top1" in r]
    top = max(v for _, v in vals)
    first_best = next(s for s, v in vals if v == top)
    best = ckpt.load(folder / "best.ckpt")
    assert best["step"] == best["best_step"] == first_best and best["best_top1"] == top
    assert best["last_val"]["val_top1"] == top
    assert results["best_val_top1"] == top and results["best_step"] == first_best
    assert json.loads((tmp_path / "results.json").read_text())["best_step"] == first_best


def _fake_world_size(path: Path, world_size: int) -> None:
    blob = ckpt.load(path)
    blob["world_size"] = world_size
    ckpt.save_atomic(blob, path)


def test_another_world_size_is_refused(run_dir: Path, run_overrides, compose_cfg,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """The policy: a different number of DDP processes changes the global batch and the data
    shards. At an epoch end it is refused like a config change (force resumes); mid-epoch it
    is refused even with force (the shards' positions cannot be re-derived)."""
    folder = run_dir / "checkpoints"
    end, mid = folder / "step-00000004.ckpt", folder / "step-00000002.ckpt"
    for path in (end, mid):
        _fake_world_size(path, 2)  # as if written by two processes
    with pytest.raises(ResumeRefused, match=r"world_size \(DDP processes\): 2 -> 1"):
        run.train(compose_cfg(run_overrides(**BASE)), run_dir)
    end.unlink()  # now the newest is mid-epoch
    for mode in ("auto", "force"):
        with pytest.raises(ResumeRefused) as refused:
            run.train(compose_cfg(run_overrides(**BASE, trainer__resume=mode)), run_dir)
        assert str(refused.value).startswith(
            f"cannot resume from {mid}: it was written mid-epoch by 2 process(es), and this run "
            "has 1; the samples each rank has already trained on this epoch cannot be re-derived")
    shutil.copy(mid, end)  # an epoch-end checkpoint again (its content does not matter here)
    blob = ckpt.load(end)
    blob.update(consumed=0, epoch=1, step=4)
    ckpt.save_atomic(blob, end)
    with caplog.at_level(logging.WARNING):
        results = run.train(compose_cfg(run_overrides(**BASE, trainer__resume="force")), run_dir)
    assert "world_size (DDP processes): 2 -> 1" in caplog.text and results["steps"] == 4


def test_keys_of_another_version_are_warned_about(run_dir: Path, run_overrides, compose_cfg,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A key the checkpoint's config lacks (added by a later videotrain) does not block."""
    path = run_dir / "checkpoints" / "step-00000004.ckpt"
    blob = ckpt.load(path)
    lr_scaling = blob["config"]["optim"].pop("lr_scaling")
    ckpt.save_atomic(blob, path)
    with caplog.at_level(logging.WARNING):
        results = run.train(compose_cfg(run_overrides(**BASE)), run_dir)
    assert results["steps"] == 4
    assert f"not compared with {path}: keys set in only one of the two configs" in caplog.text
    assert f"  optim.lr_scaling: (not set) -> {lr_scaling}" in caplog.text


# ---------------------------------------------------------------------- a crafted newer checkpoint
def _newer(run_dir: Path, edit) -> Path:
    """``step-00000009.ckpt``: the run's last checkpoint, edited, as the newest step file (a
    shared run folder's, which resume reads first)."""
    blob = ckpt.load(run_dir / "checkpoints" / "step-00000004.ckpt")
    edit(blob)
    path = run_dir / "checkpoints" / "step-00000009.ckpt"
    torch.save(blob, path)
    return path


def _one_line(message: str) -> str:
    assert "\n" not in message and "\x1b" not in message and "\x07" not in message
    return message


ESCAPES = "evil\x1b]0;owned\x07\nkey"


@pytest.mark.parametrize(("edit", "says"), [
    (lambda b: b["model"].update({ESCAPES: torch.zeros(1)}),
     "model weights: 1 unexpected keys: 'evil\\x1b]0;owned\\x07\\nkey'"),
    (lambda b: b["model"].pop(next(iter(b["model"]))), "model weights: 1 missing keys: "),
    (lambda b: b["model"].update({k: torch.zeros(3, 1) for k in list(b["model"])[:1]}),
     "model weights: 1 shape mismatches (file vs model): "),
    (lambda b: b["optimizer"]["state"][0].update(exp_avg=torch.zeros(7)),
     "optimizer state: exp_avg of parameter 0 (7,) vs "),
    (lambda b: b["optimizer"]["param_groups"].pop(),
     "optimizer state: another number of parameter groups"),
])
def test_weights_that_do_not_fit_the_model_are_refused_naming_the_keys(
        run_dir: Path, run_overrides, compose_cfg, edit, says: str) -> None:
    """Resume checks the checkpoint's weights and optimizer state against the model being
    trained before loading anything (as eval does): one refusal naming the keys escaped, not
    torch's traceback with the keys raw."""
    newer = _newer(run_dir, edit)
    with pytest.raises(ResumeRefused) as refused:
        run.train(compose_cfg(run_overrides(**BASE)), run_dir)
    message = _one_line(str(refused.value))
    assert message.startswith(f"cannot resume from {newer}: it does not fit the model being trained")
    assert says in message, message


def test_a_checkpoint_without_a_field_resume_reads_is_refused(run_dir: Path, run_overrides,
                                                               compose_cfg) -> None:
    newer = _newer(run_dir, lambda b: b.pop("best_step"))
    with pytest.raises(ResumeRefused, match=f"cannot resume from {newer}: it has no best_step"):
        run.train(compose_cfg(run_overrides(**BASE)), run_dir)


def _shared_bomb() -> list:
    node: list = ["x"] * 9
    for _ in range(7):
        node = [node] * 9  # 9^8 leaves in a few KB: the pickle's memo
    return node


@pytest.mark.parametrize(("edit", "says"), [
    (lambda b: b.update(last_val={"val_top1": _shared_bomb()}),
     "a shared reference at last_val.val_top1"),
    (lambda b: b.update(peaks=["9" * 10**6]), "peaks[0] must be a finite number"),
    (lambda b: b.update(step="4"), "step must be an integer from 0 to"),
    (lambda b: b["rng_per_rank"][0].update(torch=torch.zeros(3, dtype=torch.uint8)),
     "rng_per_rank[0].torch must be a 1-d torch.uint8 tensor of"),
])
def test_a_field_out_of_its_schema_is_refused_before_use(run_dir: Path, run_overrides,
                                                         compose_cfg, edit, says: str) -> None:
    """Every field resume reads is checked when the checkpoint is read (``safe_load``): a
    stored-results bomb (8.8 GB when compared), a long string where a number is expected, an
    RNG state torch would reject with a traceback; the file named, the value never."""
    newer = _newer(run_dir, edit)
    start = time.monotonic()
    with pytest.raises(ckpt.CheckpointError) as refused:
        run.train(compose_cfg(run_overrides(**BASE)), run_dir)
    assert time.monotonic() - start < 30
    message = _one_line(str(refused.value))
    assert message.startswith(str(newer)) and says in message and "9" * 200 not in message, message


def test_a_step_file_named_with_a_newline_is_not_resumed(run_dir: Path, run_overrides,
                                                         compose_cfg, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """``step-00000009.ckpt\\n`` (``$`` matched before a final newline): not a step file, so
    not loaded; the run resumes from its own newest one."""
    marker = tmp_path / "created-by-unpickling"
    odd = run_dir / "checkpoints" / "step-00000009.ckpt\n"
    torch.save({"videotrain_format": 2, "model": {}, "x": CreatesAFile(marker)}, odd)
    with caplog.at_level(logging.INFO):
        results = run.train(compose_cfg(run_overrides(**BASE)), run_dir)
    newest = run_dir / "checkpoints" / "step-00000004.ckpt"
    assert f"resumed from {newest} at step 4" in caplog.text and results["steps"] == 4
    assert odd.exists() and not marker.exists()
