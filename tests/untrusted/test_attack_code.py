"""Code runs, text forges: a shared config whose ``_target_`` or resolver would run code, a
checkpoint whose unpickling would, a sweep's YAML with a tag that would; and text from those
files (a job's fields in ``results.json``, its folder's name, a key of a checkpoint's weights)
with newlines and terminal escapes, which must reach the terminal and the files written as one
escaped line, never as a forged row or a cleared screen. No payload runs (the marker file never
appears: ``Outcome.judge``), as root and as ``nobody``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import yaml

from videotrain.engine.checkpoints import format as ckpt

if TYPE_CHECKING:
    from conftest import Workspace

FORGED = "sbp\n| forged | row | 1.000 |\n\x1b[2J\x1b]52;c;ZWNobyBvd25lZA==\x07"


def payload(ws: Workspace) -> dict:
    """A config node whose instantiation creates the marker file."""
    return {"_target_": "os.system", "_args_": [f"touch {ws.marker}"]}


class RunsCode:
    """Unpickling this calls ``os.system`` (what a crafted checkpoint does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def edit_config(run: Path, edit: Callable[[dict], None]) -> None:
    config = yaml.safe_load((run / "config.yaml").read_text())
    edit(config)
    (run / "config.yaml").write_text(yaml.safe_dump(config))


def command(name: str, checkpoint: Path, ws: Workspace, public_data: Path) -> list[str]:
    video = next((public_data / "val").rglob("*.mp4"))
    extra = {"eval": ["eval.clips=1", "eval.crops=1"], "predict": [f"video={video}"],
             "export": ["export.format=torch_export", f"export.out={ws.work / 'model.pt2'}",
                        "export.check=false"]}[name]
    return [f"checkpoint={checkpoint}", f"data.root={public_data}", *extra, "device=cpu",
            f"hydra.run.dir={ws.work / 'out'}"]


# ---------------------------------------------------------------------- payloads
CONFIG_PAYLOADS: dict[str, Callable[[dict, Workspace], None]] = {
    "a _target_ under model.head": lambda c, ws: c["model"]["head"].update(extra=payload(ws)),
    "a _target_ as the memory group": lambda c, ws: c.update(memory=payload(ws)),
    "a resolver reading the environment": lambda c, ws: c["model"]["head"].update(
        dropout="${oc.env:VIDEOTRAIN_TEST_TOKEN}"),
}


@pytest.mark.parametrize("how", list(CONFIG_PAYLOADS))
@pytest.mark.parametrize("name", ["eval", "predict", "export"])
def test_a_run_config_runs_nothing(name: str, how: str, ws: Workspace, shared: Path,
                                   public_data: Path) -> None:
    """``config.yaml`` of a shared run carrying a payload: nothing of it runs or resolves."""
    edit_config(shared, lambda c: CONFIG_PAYLOADS[how](c, ws))
    last = shared / "checkpoints" / "last.ckpt"
    ws.run(name, command(name, last, ws, public_data)).judge("either")


@pytest.mark.parametrize("name", ["eval", "predict", "export"])
def test_a_stored_config_runs_nothing(name: str, ws: Workspace, shared: Path,
                                      public_data: Path) -> None:
    """A checkpoint shared alone whose stored config names a ``_target_``."""
    blob = ckpt.load(shared / "checkpoints" / "last.ckpt")
    blob["config"]["model"]["head"]["extra"] = payload(ws)
    torch.save(blob, ws.work / "shared.ckpt")
    ws.run(name, command(name, ws.work / "shared.ckpt", ws, public_data)).judge("either")


@pytest.mark.parametrize("name", ["eval", "predict", "export", "resume"])
def test_a_pickle_that_runs_code_is_refused(name: str, ws: Workspace, shared: Path,
                                            public_data: Path, train_args) -> None:
    """A checkpoint whose unpickling calls ``os.system``: refused before any of it runs (for
    resume, the newest step file of the shared folder)."""
    blob = ckpt.load(shared / "checkpoints" / "step-00000001.ckpt")
    blob["payload"] = RunsCode(ws.marker)
    if name == "resume":
        torch.save(blob, shared / "checkpoints" / "step-00000009.ckpt")
        args = [*train_args(trainer__max_steps=2), f"hydra.run.dir={shared}"]
    else:
        torch.save(blob, ws.work / "shared.ckpt")
        args = command(name, ws.work / "shared.ckpt", ws, public_data)
    ws.run(name, args).judge("refused")


def test_a_sweep_yaml_tag_runs_nothing(ws: Workspace, sweep_folder) -> None:
    """``.hydra/overrides.yaml`` and ``.hydra/config.yaml`` with a tag that constructs a
    Python call: read as data or not at all, the job failed or refused, never a traceback."""
    sweep = sweep_folder(ws.work / "multirun")
    job = sorted(p for p in sweep.iterdir() if p.is_dir())[0]
    tag = f"!!python/object/apply:os.system ['touch {ws.marker}']"
    (job / ".hydra" / "overrides.yaml").write_text(f"- memory=sbp\n- {tag}\n")
    (job / ".hydra" / "config.yaml").write_text(f"memory:\n  _target_: {tag}\n")
    ws.run("summarize_sweep", [sweep]).judge("either")


def test_a_strangers_gpu_estimate_folder_runs_nothing(ws: Workspace) -> None:
    """``benchmarks.gpu_estimate_cuda_bn TOOL_DIR`` on a folder whose ``estimate_step.py`` (and
    a planted ``__pycache__``) would run a payload: refused by its digest before anything of
    the folder is imported."""
    tool = ws.work / "gpu_estimate"
    (tool / "__pycache__").mkdir(parents=True)
    code = f"import os\nos.system('touch {ws.marker}')\n"
    for name in ("estimate_step.py", "roofline.py", "rows.py", "step_trace.py", "vt.py", "host_proxy.py"):
        (tool / name).write_text(code)
    (tool / "calibration.json").write_text("{}")
    (tool / "__pycache__" / "estimate_step.cpython-311.pyc").write_bytes(b"\0" * 64)
    ws.run("benchmarks.gpu_estimate_cuda_bn", [tool, "--rows", "resnet50/e2e"]).judge(
        "refused", "estimate_step.py", "sha256 differs")


# ---------------------------------------------------------------------- text
def _no_forged_lines(text: str) -> None:
    assert not any(ln.lstrip().startswith("| forged") for ln in text.splitlines()), text[-2000:]
    assert "\x1b" not in text and "\x07" not in text


@pytest.mark.parametrize("where", ["results.json", "the job's folder name"])
def test_summary_cells_are_one_escaped_line(where: str, ws: Workspace, sweep_folder) -> None:
    """A job's ``memory_strategy`` (or its folder's name) holding newlines, a forged table row
    and escapes: the summary's table and what it prints hold neither."""
    sweep = sweep_folder(ws.work / "multirun")
    job = sorted(p for p in sweep.iterdir() if p.is_dir())[0]
    if where == "results.json":
        results = json.loads((job / "results.json").read_text())
        (job / "results.json").write_text(json.dumps({**results, "memory_strategy": FORGED}))
    else:
        job.rename(job.with_name("0_" + FORGED.replace("/", "_")))
    outcome = ws.run("summarize_sweep", [sweep])
    outcome.judge("either")
    _no_forged_lines(outcome.ran.text)
    if (sweep / "summary.md").is_file():
        _no_forged_lines((sweep / "summary.md").read_text())


def test_an_extra_weights_key_is_shown_escaped_by_resume(ws: Workspace, shared: Path,
                                                         train_args) -> None:
    """A newer step file whose weights hold an extra key named with escapes: resume checks the
    keys and shapes as eval does, one ``error:`` line with the key escaped (it was a
    traceback with the key raw)."""
    blob = ckpt.load(shared / "checkpoints" / "step-00000001.ckpt")
    blob["model"]["\x1b[2Jextra\nforged"] = torch.zeros(1)
    torch.save(blob, shared / "checkpoints" / "step-00000009.ckpt")
    outcome = ws.run("resume", [*train_args(trainer__max_steps=2), f"hydra.run.dir={shared}"])
    outcome.judge("either")
    _no_forged_lines(outcome.ran.text)
