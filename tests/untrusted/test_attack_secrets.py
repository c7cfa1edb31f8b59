"""Secrets printed or shipped: a shared run's config (its ``config.yaml``, or the config stored
in a checkpoint shared alone) naming the user's private files as its annotation or class files
(absolute paths, ``/proc/self/environ``, which holds a token here), against eval, predict and
export; and class names that carry terminal escapes, from a shared dataset's ``classes.txt``,
against train and eval's missing-classes hints and predict's output. The secret's bytes reach no
output, no log and no file written (``predict.out``, the exported metadata), and no escape
reaches the terminal (``Outcome.judge``), as root and as ``nobody``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import yaml

from videotrain.engine.checkpoints import format as ckpt

if TYPE_CHECKING:
    from conftest import Workspace

# clears the screen, sets the clipboard (OSC 52)
ESCAPED_NAME = "\x1b[2J\x1b]52;c;ZWNobyBvd25lZA==\x07cleared"


def rewrite_checkpoint(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    """``src`` (a link followed) loaded, ``edit``-ed and saved as the plain file ``dst``."""
    blob = ckpt.load(src)
    edit(blob)
    dst.unlink(missing_ok=True)
    torch.save(blob, dst)
    return dst


def edit_config(run: Path, edit: Callable[[dict], None]) -> None:
    config = yaml.safe_load((run / "config.yaml").read_text())
    edit(config)
    (run / "config.yaml").write_text(yaml.safe_dump(config))


def without_class_names(blob: dict) -> None:
    """Where the checkpoint names no classes, predict and export read the dataset's."""
    blob.pop("class_names", None)


def command(name: str, checkpoint: Path, ws: Workspace, data_args: list[str],
            video: Path) -> list[str]:
    """``name``'s command line on a shared checkpoint, its outputs in the workspace."""
    extra = {"eval": ["eval.clips=1", "eval.crops=1"],
             "predict": [f"video={video}", f"predict.out={ws.work / 'predictions.json'}"],
             "export": ["export.format=torch_export", f"export.out={ws.work / 'model.pt2'}",
                        "export.check=false"]}[name]
    return [f"checkpoint={checkpoint}", *data_args, *extra, "device=cpu",
            f"hydra.run.dir={ws.work / 'out'}"]


@pytest.fixture
def video(public_data: Path) -> Path:
    return next((public_data / "val").rglob("*.mp4"))


def _target(ws: Workspace, secret: str) -> str:
    return "/proc/self/environ" if secret == "environ" else str(ws.victim / secret)


SECRETS = [("classes_file", ".netrc"), ("val_file", ".ssh/id_ed25519"),
           ("classes_file", "environ")]


@pytest.mark.parametrize(("key", "secret"), SECRETS, ids=[f"{k}-{s}" for k, s in SECRETS])
@pytest.mark.parametrize("name", ["eval", "predict", "export"])
def test_a_run_config_reads_no_file_of_the_user(name: str, key: str, secret: str, ws: Workspace,
                                                shared: Path, data_args: list[str],
                                                video: Path) -> None:
    """``config.yaml`` of a shared run names ``data.KEY`` = one of the user's private files:
    the file's text is shown nowhere, written nowhere (the value is ignored or refused)."""
    edit_config(shared, lambda c: c["data"].update({key: _target(ws, secret)}))
    last = shared / "checkpoints" / "last.ckpt"
    rewrite_checkpoint(last, last.resolve(), without_class_names)
    (shared / "results.json").unlink()
    ws.run(name, command(name, last, ws, data_args, video)).judge("either")


@pytest.mark.parametrize("name", ["eval", "predict", "export"])
def test_a_stored_config_reads_no_file_of_the_user(name: str, ws: Workspace, shared: Path,
                                                   data_args: list[str], video: Path) -> None:
    """The same through a checkpoint shared alone: its stored config names ``.netrc``."""
    def edit(blob: dict) -> None:
        without_class_names(blob)
        blob["config"]["data"]["classes_file"] = str(ws.victim / ".netrc")

    alone = rewrite_checkpoint(shared / "checkpoints" / "last.ckpt", ws.work / "shared.ckpt", edit)
    ws.run(name, command(name, alone, ws, data_args, video)).judge("either")


# ---------------------------------------------------------------------- class names from a dataset
def escaped_dataset(ws: Workspace, public_data: Path, emptied: str | None) -> Path:
    """A shared copy of the dataset whose first class is named with terminal escapes; with
    ``emptied``, that class's videos of this split are gone (the missing-classes hint, under
    ``data.max_bad_fraction=0.5``)."""
    data = Path(shutil.copytree(public_data, ws.root / "dataset"))
    names = (data / "classes.txt").read_text().splitlines()
    (data / "classes.txt").write_text("\n".join([ESCAPED_NAME, *names[1:]]) + "\n")
    if emptied is not None:
        for video in (data / emptied / names[0]).glob("*.mp4"):
            video.unlink()
    return data


def test_train_hint_shows_class_names_escaped(ws: Workspace, public_data: Path,
                                              train_args) -> None:
    """Training on a shared dataset whose class without videos has an escape in its name:
    one ``error:`` line with the ``data.drop_classes`` hint, the name escaped."""
    data = escaped_dataset(ws, public_data, "train")
    ws.run("train", [*train_args(trainer__max_steps=1), f"data.root={data}",
                     "data.max_bad_fraction=0.5", f"hydra.run.dir={ws.work / 'run'}"]
           ).judge("refused", "data.drop_classes")


def test_eval_hint_shows_class_names_escaped(ws: Workspace, public_data: Path, shared: Path,
                                            dataset_args) -> None:
    """Evaluating on the same dataset, described whole on the command line: the hint names
    the class escaped."""
    data = escaped_dataset(ws, public_data, "val")
    ws.run("eval", [f"checkpoint={shared}/checkpoints/last.ckpt", *dataset_args(data),
                    "data.max_bad_fraction=0.5", "eval.clips=1", "eval.crops=1", "device=cpu",
                    f"hydra.run.dir={ws.work / 'out'}"]).judge("refused", "data.drop_classes")


@pytest.mark.parametrize("name", ["predict", "export"])
def test_class_names_are_shown_and_shipped_escaped(name: str, ws: Workspace, public_data: Path,
                                                   shared: Path, video: Path) -> None:
    """A checkpoint without class names and a shared dataset that names them with escapes:
    predict prints them escaped (and writes them to ``predict.out``), export writes them into
    its metadata; either succeeds."""
    data = escaped_dataset(ws, public_data, None)
    last = shared / "checkpoints" / "last.ckpt"
    rewrite_checkpoint(last, last.resolve(), without_class_names)
    (shared / "results.json").unlink()
    ws.run(name, command(name, last, ws, [f"data.root={data}"], video)).judge("ok")


# ---------------------------------------------------------------------- prepare's downloads
def _download(ws: Workspace, rows: str) -> tuple[Path, Path]:
    """A downloaded Kinetics folder: its release CSV (``rows`` under the header) and one video."""
    download = ws.root / "kinetics400"
    (download / "videos").mkdir(parents=True)
    (download / "videos" / "aaaaaaaaaaa_000000_000010.mp4").write_bytes(b"\0" * 64)
    (download / "train.csv").write_text("label,youtube_id,time_start,time_end,split\n" + rows)
    return download / "train.csv", download / "videos"


def test_prepare_shows_no_line_of_a_linked_csv(ws: Workspace) -> None:
    """A downloaded folder whose release CSV links to the user's ``.netrc``."""
    csv, videos = _download(ws, "")
    csv.unlink()
    csv.symlink_to(ws.victim / ".netrc")
    ws.run("prepare", ["kinetics", "--csv", csv, "--videos", videos,
                       "--out", ws.work / "prepared"]).judge("either")


@pytest.mark.parametrize("field", ["label", "time_start"])
def test_prepare_shows_csv_fields_escaped(field: str, ws: Workspace) -> None:
    """A release CSV whose label (or time) holds terminal escapes and a newline."""
    label, start = ("abseiling", "0") if field != "label" else (ESCAPED_NAME, "0")
    if field == "time_start":
        start = ESCAPED_NAME
    csv, videos = _download(ws, f'"{label}\nforged",aaaaaaaaaaa,"{start}",10,train\n')
    ws.run("prepare", ["kinetics", "--csv", csv, "--videos", videos,
                       "--out", ws.work / "prepared"]).judge("either")
