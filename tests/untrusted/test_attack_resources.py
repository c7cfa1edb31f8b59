"""Memory and time from a few bytes: every value read from a checkpoint, a config, a sweep
folder, ``metrics.jsonl`` or an annotation file is bounded before it is used. Shared references
(a pickle's memo: 9^8 leaves in a few KB), deep nesting, a long string where a number is
expected, a 40 MB pickle of empty dicts, a sparse 64 GiB checkpoint, a file of newlines as
``metrics.jsonl``, a 64 MB annotation list, a YAML alias bomb in a sweep's overrides, a huge
crop or worker count in a shared config: each case ends within ``TIME_S`` of CPU time and
``GROWTH_MB`` of memory (refused, or the value ignored), as root and as ``nobody``.
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import yaml

from videotrain.engine.checkpoints import format as ckpt

if TYPE_CHECKING:
    from conftest import Workspace

PLACEHOLDER = "CRAFTED-FIELD-PLACEHOLDER"
DEEP = 100_000  # levels of nesting: past any recursion limit
PICKLE_DICTS = 40_000_000  # one byte each in the pickle, ~70 bytes each once unpickled


def shared_bomb() -> list:
    node: list = ["x"] * 9
    for _ in range(7):
        node = [node] * 9  # 9^8 leaves, one list per level: the pickle's memo keeps it small
    return node


def deep_list_ops(levels: int = DEEP) -> bytes:
    """Pickle opcodes for a list nested ``levels`` deep: ``levels`` empty lists, each appended
    to the one below it."""
    return b"]" * levels + b"a" * (levels - 1)


def empty_dicts_ops(count: int = PICKLE_DICTS) -> bytes:
    """Pickle opcodes for a list of ``count`` empty dicts (one byte each)."""
    return b"](" + b"}" * count + b"e"


def crafted(blob: dict, field: str, ops: bytes, dst: Path) -> Path:
    """``blob`` saved with ``torch.save`` at ``dst``, its ``field`` replaced by the object that
    the pickle opcodes ``ops`` build (spliced into ``data.pkl`` where a placeholder string was):
    a checkpoint valid in every other field."""
    tmp = dst.with_suffix(".plain")
    torch.save({**blob, field: PLACEHOLDER}, tmp)
    marker = pickletools.optimize(pickle.dumps(PLACEHOLDER, protocol=2))[2:-1]
    with zipfile.ZipFile(tmp) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):
                assert data.count(marker) == 1
                data = data.replace(marker, ops)
            zout.writestr(info, data)
    tmp.unlink()
    return dst


def edited(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    blob = ckpt.load(src)
    edit(blob)
    dst.unlink(missing_ok=True)
    torch.save(blob, dst)
    return dst


def resume_args(train_args, shared: Path) -> list[str]:
    return [*train_args(trainer__max_steps=2), f"hydra.run.dir={shared}"]


def eval_args(checkpoint: Path, ws: Workspace, dataset: list[str]) -> list[str]:
    return [f"checkpoint={checkpoint}", *dataset, "eval.clips=1", "eval.crops=1", "device=cpu",
            f"hydra.run.dir={ws.work / 'out'}"]


# ---------------------------------------------------------------------- checkpoint fields
def _newer_step(shared: Path) -> Path:
    return shared / "checkpoints" / "step-00000009.ckpt"


CHECKPOINT_BOMBS: dict[str, Callable[[Path, Path], Path]] = {
    "shared references in last_val": lambda src, dst: edited(
        src, dst, lambda b: b.update(last_val={"bomb": shared_bomb()})),
    "deep nesting in skipped": lambda src, dst: crafted(ckpt.load(src), "skipped",
                                                        deep_list_ops(), dst),
    "a long string in step_times": lambda src, dst: edited(
        src, dst, lambda b: b.update(step_times=["9" * 10**8])),
    "a 40 MB pickle in data_waits": lambda src, dst: crafted(ckpt.load(src), "data_waits",
                                                             empty_dicts_ops(), dst),
}


@pytest.mark.parametrize("bomb", list(CHECKPOINT_BOMBS))
def test_resume_bounds_every_checkpoint_field(bomb: str, ws: Workspace, shared: Path,
                                              train_args) -> None:
    """A newer step file whose non-config field is a bomb: resume refuses it (or sets it aside
    and resumes from the step before) within the bounds."""
    step = CHECKPOINT_BOMBS[bomb](shared / "checkpoints" / "step-00000001.ckpt",
                                  _newer_step(shared))
    assert step.stat().st_size < 128 << 20
    ws.run("resume", resume_args(train_args, shared)).judge("either")


@pytest.mark.parametrize("name", ["eval", "predict"])
def test_a_long_string_for_the_peaks_is_refused(name: str, ws: Workspace, shared: Path,
                                                dataset_args, public_data: Path) -> None:
    """``peaks`` (the training steps' memory, a list of numbers) holding a 1 KB string: it
    became the evaluation budget, a gigabyte string (``peak * 2**20``)."""
    alone = edited(shared / "checkpoints" / "last.ckpt", ws.work / "shared.ckpt",
                   lambda b: b.update(peaks=["9" * 1024, "9" * 1024]))
    video = next((public_data / "val").rglob("*.mp4"))
    args = (eval_args(alone, ws, dataset_args(public_data)) if name == "eval" else
            [f"checkpoint={alone}", f"video={video}", "device=cpu",
             f"hydra.run.dir={ws.work / 'out'}"])
    ws.run(name, args).judge("either")


@pytest.mark.parametrize("name", ["eval", "resume"])
@pytest.mark.parametrize("kind", ["sparse", "40 MB pickle"])
def test_large_checkpoints_are_refused_before_reading(kind: str, name: str, ws: Workspace,
                                                      shared: Path, train_args, dataset_args,
                                                      public_data: Path) -> None:
    """A sparse 64 GiB checkpoint (no disk used) and a 40 MB pickle of empty dicts (3 GB once
    unpickled): refused from their sizes, before the unpickler runs."""
    path = _newer_step(shared) if name == "resume" else ws.work / "shared.ckpt"
    if kind == "sparse":
        shutil.copyfile(shared / "checkpoints" / "step-00000001.ckpt", path)
        os.truncate(path, 64 << 30)
    else:
        crafted(ckpt.load(shared / "checkpoints" / "step-00000001.ckpt"), "data_waits",
                empty_dicts_ops(), path)
    args = (resume_args(train_args, shared) if name == "resume" else
            eval_args(path, ws, dataset_args(public_data)))
    ws.run(name, args).judge("either")


# ---------------------------------------------------------------------- configs
def _edit_config(run: Path, edit: Callable[[dict], None]) -> None:
    config = yaml.safe_load((run / "config.yaml").read_text())
    edit(config)
    (run / "config.yaml").write_text(yaml.safe_dump(config))


def test_a_shared_configs_crop_is_bounded(ws: Workspace, shared: Path, public_data: Path) -> None:
    """``data.short_side`` / ``data.crop_size`` of 4096 in a shared ``config.yaml``: predict
    allocated 10.7 GB for the views."""
    _edit_config(shared, lambda c: c["data"].update(short_side=4096, crop_size=4096))
    video = next((public_data / "val").rglob("*.mp4"))
    ws.run("predict", [f"checkpoint={shared}/checkpoints/last.ckpt", f"video={video}",
                       "device=cpu", f"hydra.run.dir={ws.work / 'out'}"]).judge("either")


def test_a_shared_configs_workers_are_not_honoured(ws: Workspace, shared: Path, dataset_args,
                                                   public_data: Path) -> None:
    """``data.num_workers: 64`` in a shared ``config.yaml``, none on the command line."""
    _edit_config(shared, lambda c: c["data"].update(num_workers=64))
    dataset = [a for a in dataset_args(public_data) if not a.startswith("data.num_workers=")]
    ws.run("eval", eval_args(shared / "checkpoints" / "last.ckpt", ws, dataset)).judge("either")


def test_a_deeply_nested_config_is_one_error(ws: Workspace, shared: Path, dataset_args,
                                             public_data: Path) -> None:
    """A ``config.yaml`` nested 100,000 lists deep: one ``error:`` line, not a
    ``RecursionError`` traceback."""
    text = (shared / "config.yaml").read_text()
    (shared / "config.yaml").write_text(text + "deep: " + "[" * DEEP + "]" * DEEP + "\n")
    ws.run("eval", eval_args(shared / "checkpoints" / "last.ckpt", ws,
                             dataset_args(public_data))).judge("refused")


def test_deeply_nested_results_are_one_error(ws: Workspace, shared: Path,
                                             public_data: Path) -> None:
    """predict reads class names from ``results.json`` when the checkpoint has none: nested
    100,000 deep it is one ``error:`` line or passed over."""
    last = shared / "checkpoints" / "last.ckpt"
    edited(last, last.resolve(), lambda b: b.pop("class_names"))
    (shared / "results.json").write_text('{"class_names": ' + "[" * DEEP + "]" * DEEP + "}")
    video = next((public_data / "val").rglob("*.mp4"))
    ws.run("predict", [f"checkpoint={last}", f"video={video}", "device=cpu",
                       f"hydra.run.dir={ws.work / 'out'}"]).judge("either")


# ---------------------------------------------------------------------- run and sweep files
def test_a_metrics_file_of_newlines_is_bounded(ws: Workspace, shared: Path, train_args) -> None:
    """``metrics.jsonl`` of 100 MB of newlines (resume cuts it back to the checkpoint's
    step): a list of 10^8 lines."""
    with open(shared / "metrics.jsonl", "ab") as f:
        f.write(b"\n" * 100_000_000)
    ws.run("resume", resume_args(train_args, shared)).judge("either")


ALIAS_BOMB = "- &a [x, x, x, x, x, x, x, x, x]\n" + "".join(  # 9^9 leaves in 300 bytes
    f"- &{c} [" + ", ".join([f"*{p}"] * 9) + "]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True))
SWEEP_BOMBS = {
    "an alias bomb in overrides.yaml": (".hydra/overrides.yaml", ALIAS_BOMB),
    "deep nesting in overrides.yaml": (".hydra/overrides.yaml", "[" * DEEP + "]" * DEEP + "\n"),
    "deep nesting in results.json": ("results.json", "[" * DEEP + "]" * DEEP),
    "a 40 MB results.json": ("results.json", "[" + "{}," * 13_000_000 + "{}]"),
    "a long string for val_top1": ("results.json", json.dumps({"val_top1": "9" * 10**7})),
}


@pytest.mark.parametrize("bomb", list(SWEEP_BOMBS))
def test_summarize_sweep_bounds_what_it_reads(bomb: str, ws: Workspace, sweep_folder) -> None:
    """A shared sweep whose first job's file is a bomb: the summary is written (that job
    failed) or refused, within the bounds, and no cell holds the long string."""
    sweep = sweep_folder(ws.work / "multirun")
    rel, text = SWEEP_BOMBS[bomb]
    job = sorted(p for p in sweep.iterdir() if p.is_dir())[0]
    (job / rel).write_text(text)
    ws.run("summarize_sweep", [sweep]).judge("either")
    summary = sweep / "summary.md"
    assert not summary.exists() or "9" * 1000 not in summary.read_text()


def _big_annotations(ws: Workspace, public_data: Path) -> Path:
    """The dataset with a 64 MB ``val.csv`` (short lines: 8 million entries)."""
    data = Path(shutil.copytree(public_data, ws.root / "dataset"))
    with open(data / "val.csv", "w") as f:
        for i in range(8):
            f.write(f"v/{i % 10}.mp4 0\n" * 1_000_000)
    assert (data / "val.csv").stat().st_size >= 64 * 10**6
    return data


@pytest.mark.parametrize("name", ["train", "eval"])
def test_a_large_annotation_file_is_bounded(name: str, ws: Workspace, public_data: Path,
                                            shared: Path, train_args, dataset_args) -> None:
    """A shared dataset whose ``val.csv`` is 64 MB of short lines: refused from its size or
    read within the bounds."""
    data = _big_annotations(ws, public_data)
    args = ([*train_args(trainer__max_steps=1), f"data.root={data}",
             f"hydra.run.dir={ws.work / 'run'}"] if name == "train" else
            eval_args(shared / "checkpoints" / "last.ckpt", ws, dataset_args(data)))
    ws.run(name, args).judge("either")


STEP_TIMES = {"a long string": "9" * 10**6, "a huge number": 1e308, "zero": 0.0,
              "a nested bomb": [[[[[[[[[[]]]]]]]]]] * 10}


@pytest.mark.parametrize("value", list(STEP_TIMES))
def test_equal_time_bounds_the_recorded_step_times(value: str, ws: Workspace) -> None:
    """A shared sweep folder's ``step_times.json`` (reused, so nothing is measured again) whose
    e2e time is not a positive number of seconds: refused, or measured again, within bounds."""
    out = ws.work / "sweep"
    out.mkdir()
    times = {"e2e": STEP_TIMES[value], "sbp-frame-0.5": 0.1}
    (out / "step_times.json").write_text(json.dumps({"step_s": times, "threads": 1, "steps": 1}))
    ws.run("benchmarks.equal_time", ["--rows", "sbp-frame-0.5", "--out", out, "--measure-only",
                                     "--steps", "1", "--warmup", "0"]).judge("either")
