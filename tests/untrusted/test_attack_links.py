"""Code runs, files change: a link planted at every name an entry point writes, pointing at the
user's files (``authorized_keys``, ``.bashrc``, a ``.pth`` in ``site-packages``, which the next
Python start runs). Each entry point either refuses (one ``error:`` line) or writes a new file
in the link's place; the file behind the link never changes (``Outcome.judge``), as root and as
``nobody``. Writers of entry points that measure for minutes (the bench, the data benchmark,
the annotation benchmark) are run as those commands call them, after their measurement.
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

EVIL_PTH = "site-packages/evil.pth"  # Python runs a .pth file's `import` lines at start-up


def _plant(link: Path, target: Path) -> None:
    """``link`` -> ``target``, replacing whatever was there."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    else:
        link.unlink(missing_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def _lands_as_a_file(link: Path) -> None:
    """Where an entry point succeeded, its file replaced the link (or it wrote nothing)."""
    assert not link.is_symlink() or not link.exists() or link.resolve().parent != link.parent


# ---------------------------------------------------------------------- resume and train
RESUME_WRITES = ["config.yaml", "results.json", "metrics.jsonl", "videotrain.log", ".hydra",
                 ".hydra/overrides.yaml", "wandb_run_id", "checkpoints", "checkpoints/last.ckpt",
                 "checkpoints/step-00000002.ckpt"]


@pytest.mark.parametrize("name", RESUME_WRITES)
def test_resume_writes_through_no_link(name: str, ws: Workspace, shared: Path, train_args) -> None:
    """A shared run folder whose files (or folders) are links into the user's files: resume
    refuses it naming the link, before Hydra or the trainer write anything."""
    target = ws.victim / ("site-packages" if name in (".hydra", "checkpoints") else
                          EVIL_PTH if name == "videotrain.log" else ".ssh/authorized_keys")
    _plant(shared / name, target)
    ws.run("resume", [*train_args(trainer__max_steps=2), f"hydra.run.dir={shared}"]).judge(
        "refused", os.path.basename(name))


def test_train_follows_no_link_into_the_run_folder(ws: Workspace, train_args) -> None:
    """``python -m videotrain`` in a folder whose ``outputs`` is a link to the user's
    ``site-packages``: the default run folder (``outputs/DATE/TIME``) is not created there."""
    _plant(ws.work / "outputs", ws.victim / "site-packages")
    ws.run("train", train_args(trainer__max_steps=1)).judge("either")


# ---------------------------------------------------------------------- eval, predict, export
EVAL_WRITES = ["eval.json", "per_class.csv", "confusion.png", "videotrain.log"]


@pytest.mark.parametrize("name", EVAL_WRITES)
def test_eval_writes_through_no_link(name: str, ws: Workspace, shared: Path, dataset_args,
                                     public_data: Path) -> None:
    """``hydra.run.dir`` in the shared folder (``SHARED/eval``), which holds links at eval's
    outputs: refused before anything is written."""
    out = shared / "eval"
    _plant(out / name, ws.victim / (EVIL_PTH if name == "videotrain.log" else ".bashrc"))
    ws.run("eval", [f"checkpoint={shared}/checkpoints/last.ckpt", *dataset_args(public_data),
                    "eval.clips=1",
                    "eval.crops=1", "device=cpu", f"hydra.run.dir={out}"]).judge("refused", name)


def test_predict_out_replaces_a_link(ws: Workspace, shared: Path, data_args: list[str],
                                     public_data: Path) -> None:
    """``predict.out`` naming a link to ``authorized_keys``: a new file in its place."""
    out = ws.work / "predictions.json"
    _plant(out, ws.victim / ".ssh/authorized_keys")
    video = next((public_data / "val").rglob("*.mp4"))
    ws.run("predict", [f"checkpoint={shared}/checkpoints/last.ckpt", *data_args, f"video={video}",
                       f"predict.out={out}", "device=cpu",
                       f"hydra.run.dir={ws.work / 'run'}"]).judge("either")
    _lands_as_a_file(out)


@pytest.mark.parametrize("name", ["model.pt2", "model.pt2.json"])
def test_export_replaces_a_link(name: str, ws: Workspace, shared: Path,
                                data_args: list[str]) -> None:
    """``export.out`` (and the metadata beside it) naming links into the user's files."""
    _plant(ws.work / name, ws.victim / (EVIL_PTH if name.endswith(".json") else ".bashrc"))
    ws.run("export", [f"checkpoint={shared}/checkpoints/last.ckpt", *data_args,
                      "export.format=torch_export", f"export.out={ws.work / 'model.pt2'}",
                      "export.check=false", f"hydra.run.dir={ws.work / 'run'}"]).judge("either")
    _lands_as_a_file(ws.work / name)


# ---------------------------------------------------------------------- plan, prepare, bench
def test_plan_out_replaces_a_link(ws: Workspace, tiny_model_overrides: list[str]) -> None:
    out = ws.work / "plan.json"
    _plant(out, ws.victim / EVIL_PTH)
    ws.run("plan", ["--out", out, "memory=recompute", *tiny_model_overrides, "data.batch_size=1",
                    "data.num_frames=4", "data.crop_size=32", "device=cpu"]).judge("either")
    _lands_as_a_file(out)


@pytest.mark.parametrize("name", ["classes.txt", "train.csv", "missing_train.csv"])
def test_prepare_out_replaces_a_link(name: str, ws: Workspace) -> None:
    """``prepare kinetics --out`` a folder someone else made, holding links at its lists."""
    csv, videos, out = ws.work / "train.csv", ws.work / "videos", ws.work / "prepared"
    csv.write_text("label,youtube_id,time_start,time_end,split\nabseiling,aaaaaaaaaaa,0,10,train\n")
    videos.mkdir()
    (videos / "aaaaaaaaaaa_000000_000010.mp4").write_bytes(b"\0" * 64)
    _plant(out / name, ws.victim / ".ssh/authorized_keys")
    ws.run("prepare", ["kinetics", "--csv", csv, "--videos", videos, "--out", out]).judge("either")
    _lands_as_a_file(out / name)


def _bench_report(out: Path) -> None:
    from videotrain.bench import report

    setting = {"batch_size": 1, "frames": 4, "size": 32, "steps": 1, "extra_overrides": []}
    row = {"name": "e2e", "backbone": "vit_tiny", "strategy": "e2e", "granularity": None,
           "policy": None, "keep_ratio": 1.0, "peak_mem_mb": 1.0, "step_time_s": 0.1,
           "saved_act_mb": 1.0}
    report.add_ratios([row])
    report.write(out, [row], {"device": "cpu", "torch": "2", "setting": setting, "machine": {}})


def _annotations_report(out: Path) -> None:
    from benchmarks.annotations import write_annotations

    row = {"name": "x", "entries": 1, "plain_s": 0.1, "build_s": 0.1, "ratio": 1.0,
           "target": "< 1 s", "meets_target": True, "paid": "once"}
    write_annotations(out, [row], {"machine": {}, "torch": "2", "scale": 1.0, "repeat": 1,
                                   "load_avg_start": None})


def _data_report(out: Path) -> None:
    from benchmarks.data_report import write_data

    setting = {"num_frames": 4, "sampling_rate": 2, "crop_size": 32, "val_clips": 1,
               "val_crops": 1, "rounds": 1, "extra_overrides": [], "sets": {}}
    write_data(out, [], {"device": "cpu", "machine": {}, "torch": "2", "setting": setting})


WRITERS = {"bench": (_bench_report, ["bench.json", "bench.md", "bench.png"]),
           # benchmarks.sac_milp runs videotrain.bench's runner, which writes this same report
           "benchmarks.sac_milp": (_bench_report, ["bench.json", "bench.md", "bench.png"]),
           "benchmarks.annotations": (_annotations_report, ["bench.json", "bench.md"]),
           "benchmarks.data": (_data_report, ["bench.json", "bench.md", "bench.png"])}


@pytest.mark.parametrize(("entry", "name"), [(e, n) for e, (_, ns) in WRITERS.items() for n in ns])
def test_benchmark_reports_replace_a_link(entry: str, name: str, ws: Workspace) -> None:
    """``--out`` a folder holding links at the report's names: the report the command writes
    after its rows (the rows themselves take minutes) lands as new files."""
    out = ws.work / "bench"
    _plant(out / name, ws.victim / (EVIL_PTH if name.endswith(".md") else ".bashrc"))
    write, _ = WRITERS[entry]
    ws.run_call(lambda: write(out)).judge("either")
    _lands_as_a_file(out / name)


def _equal_time_out(out: Path) -> None:
    """A sweep folder whose step times are recorded (nothing is measured again)."""
    out.mkdir(parents=True, exist_ok=True)
    times = {"e2e": 0.2, "sbp-frame-0.5": 0.1}
    (out / "step_times.json").write_text(json.dumps({"step_s": times, "threads": 1, "steps": 1}))


def test_equal_time_row_config_replaces_a_link(ws: Workspace) -> None:
    """``benchmarks.equal_time --out`` a shared sweep folder: the row config it writes (and
    hands to Hydra's search path) replaces a link planted there."""
    out = ws.work / "sweep"
    _equal_time_out(out)
    row = out / "conf" / "row" / "sbp-frame-0.5-at-time.yaml"
    _plant(row, ws.victim / ".bashrc")
    ws.run("benchmarks.equal_time", ["--rows", "sbp-frame-0.5", "--out", out,
                                     "--measure-only"]).judge("either")
    _lands_as_a_file(row)


# ---------------------------------------------------------------------- scripts
@pytest.mark.parametrize("name", ["summary.md", "summary.png"])
def test_summarize_sweep_writes_through_no_link(name: str, ws: Workspace, sweep_folder) -> None:
    """A shared sweep folder whose ``summary.md`` links to a ``.pth`` file in the user's
    ``site-packages`` (the next Python start ran it): the summary lands as a new file or the
    folder is refused."""
    sweep = sweep_folder(ws.work / "multirun")
    _plant(sweep / name, ws.victim / (EVIL_PTH if name == "summary.md" else ".bashrc"))
    ws.run("summarize_sweep", [sweep]).judge("either")
    _lands_as_a_file(sweep / name)


def test_check_sbp_autocast_grads_writes_nothing(ws: Workspace) -> None:
    """The script reads no one's files and writes none: its working folder stays empty."""
    ws.run("check_sbp_autocast_grads", ["vit-frame"]).judge("ok", time_s=60)
    assert sorted(p.name for p in ws.work.iterdir()) == []
