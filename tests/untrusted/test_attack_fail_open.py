"""The check fails open: a folder that can be entered and written but not listed (mode 0333:
as ``nobody``, its owner, nothing inside can be seen; root sees through it), a ``checkpoints``
folder that is a link to another run (directly, or through a link beside it), a run folder that
is itself a link, a step file whose name ends in a newline. Each is refused, or (the newline)
passed over, before anything is written; the other run and the user's files stay as they were
(``Outcome.judge``), as root and as ``nobody``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Workspace

UNLISTABLE = 0o333  # write and search, no read


def _link(path: Path, target: Path | str) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def other_run(ws: Workspace, stranger_run: Path) -> Path:
    """Another of the user's runs, in the user's files: it must not change."""
    return Path(shutil.copytree(stranger_run, ws.victim / "other-run", symlinks=True))


# ---------------------------------------------------------------------- unlistable folders
@pytest.mark.parametrize("where", [".", "checkpoints"])
def test_resume_refuses_a_folder_it_cannot_list(where: str, ws: Workspace, shared: Path,
                                                train_args) -> None:
    """The shared run folder of mode 0333 holding the log linked to ``authorized_keys`` (or
    its ``checkpoints`` folder of mode 0333 holding the next step file linked to ``.bashrc``):
    refused, nothing appended or replaced."""
    if where == ".":
        _link(shared / "videotrain.log", ws.victim / ".ssh/authorized_keys")
    else:
        _link(shared / "checkpoints" / "step-00000002.ckpt", ws.victim / ".bashrc")
    os.chmod(shared / where, UNLISTABLE)
    ws.run("resume", [*train_args(trainer__max_steps=2),
                      f"hydra.run.dir={shared}"]).judge("refused")


def test_eval_refuses_an_output_folder_it_cannot_list(ws: Workspace, shared: Path, dataset_args,
                                                      public_data: Path) -> None:
    """``hydra.run.dir`` a folder of mode 0333 whose ``eval.json`` links to ``.bashrc``."""
    out = ws.work / "eval"
    out.mkdir()
    _link(out / "eval.json", ws.victim / ".bashrc")
    _link(out / "videotrain.log", ws.victim / ".ssh/authorized_keys")
    os.chmod(out, UNLISTABLE)
    ws.run("eval", [f"checkpoint={shared}/checkpoints/last.ckpt", *dataset_args(public_data),
                    "eval.clips=1", "eval.crops=1", "device=cpu",
                    f"hydra.run.dir={out}"]).judge("refused")


def test_summarize_sweep_refuses_an_out_folder_it_cannot_list(ws: Workspace, sweep_folder) -> None:
    """``--out`` a folder of mode 0333 whose ``summary.md`` links to a ``.pth`` file."""
    sweep = sweep_folder(ws.work / "multirun")
    out = ws.work / "summary"
    out.mkdir()
    _link(out / "summary.md", ws.victim / "site-packages" / "evil.pth")
    os.chmod(out, UNLISTABLE)
    ws.run("summarize_sweep", [sweep, "--out", out]).judge("either")


def test_summarize_sweep_refuses_a_sweep_it_cannot_list(ws: Workspace, sweep_folder) -> None:
    """A sweep folder of mode 0333 (to its owner, its jobs cannot be found, its links not
    seen), which also holds ``summary.md`` linked to a ``.pth`` file: refused as ``nobody``;
    root lists it, and either refuses or replaces the link."""
    sweep = sweep_folder(ws.work / "multirun")
    _link(sweep / "summary.md", ws.victim / "site-packages" / "evil.pth")
    os.chmod(sweep, UNLISTABLE)
    ws.run("summarize_sweep", [sweep]).judge("either" if ws.privileged else "refused")


# ---------------------------------------------------------------------- links to another run
@pytest.mark.parametrize("how", ["absolute", "through a sibling"])
def test_checkpoints_linked_to_another_run_are_refused(how: str, ws: Workspace, shared: Path,
                                                       stranger_run: Path, train_args) -> None:
    """``checkpoints`` a link to another of the user's runs: resume would prune and write that
    run's checkpoints. Refused, the other run unchanged."""
    other = other_run(ws, stranger_run)
    shutil.rmtree(shared / "checkpoints")
    if how == "absolute":
        _link(shared / "checkpoints", other / "checkpoints")
    else:  # a link to a name beside it, which is itself a link out
        _link(shared / "checkpoints", "ckpts")
        _link(shared / "ckpts", other / "checkpoints")
    ws.run("resume", [*train_args(trainer__max_steps=2, trainer__keep_last_k=1),
                      f"hydra.run.dir={shared}"]).judge("refused")


@pytest.mark.parametrize("name", ["resume", "eval"])
def test_a_run_folder_that_is_a_link_is_refused(name: str, ws: Workspace, stranger_run: Path,
                                                train_args, dataset_args,
                                                public_data: Path) -> None:
    """``hydra.run.dir=SHARED/run`` where ``run`` links to another of the user's runs: its
    files would be replaced. Refused, the other run unchanged."""
    other = other_run(ws, stranger_run)
    run = ws.work / "run"
    _link(run, other)
    args = ([*train_args(trainer__max_steps=2)] if name == "resume" else
            [f"checkpoint={other}/checkpoints/last.ckpt", *dataset_args(public_data),
             "eval.clips=1", "eval.crops=1", "device=cpu"])
    ws.run(name, [*args, f"hydra.run.dir={run}"]).judge("refused")


# ---------------------------------------------------------------------- names
def test_a_step_file_named_with_a_newline_is_not_resumed(ws: Workspace, shared: Path,
                                                         train_args) -> None:
    """``step-00000009.ckpt\\n`` beside the real step file: not resumed from (refused naming
    it escaped, or passed over: the run then resumes from step 1 and trains step 2)."""
    checkpoints = shared / "checkpoints"
    shutil.copyfile(checkpoints / "step-00000001.ckpt", checkpoints / "step-00000009.ckpt\n")
    line = ws.run("resume", [*train_args(trainer__max_steps=2),
                             f"hydra.run.dir={shared}"]).judge("either")
    if not line:
        rows = [json.loads(r) for r in (shared / "metrics.jsonl").read_text().splitlines() if r]
        assert [r["step"] for r in rows if "train_loss" in r] == [1, 2]
        assert (checkpoints / "step-00000002.ckpt").is_file()
