"""Media within bounds: the entry points that decode videos (``predict``, ``eval``, training)
on videos a stranger made (``tests/data/hostile_media.py``: an 8192x8192 frame, a header that
declares fifty million frames, a header that lies about the frame size, a thousand frames a
second in one clip window, a text file named ``.mp4``, an empty and a truncated file), as root
and as ``nobody``. Each case is judged by ``Outcome.judge``: ``predict`` on one such file ends
in exit status 2 with one ``error:`` line naming the file; a folder, ``eval`` and training go on
without the bad videos (never another video in their place); and none passes 10 s of CPU or
500 MB of memory, which decoding any of them whole would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Workspace

REPO = Path(__file__).resolve().parents[2]
REFUSED = ["frame_8192.mp4", "frame_6000.mp4", "declared_frames.mp4", "lying_header.mp4",
           "dense_window.mp4", "text.mp4", "empty.mp4", "truncated.mp4"]
# a file name that would clear the screen and forge a line, were it printed raw
EVIL_NAME = "evil\x1b[2J\x07\nerror: forged.mp4"


@pytest.fixture(scope="session")
def hostile_videos(public_root: Path) -> Path:
    """The hostile videos, world-readable, written by a process of their own."""
    folder = public_root / "hostile"
    subprocess.run([sys.executable, str(REPO / "tests/data/hostile_media.py"), str(folder)],
                   check=True, timeout=120)
    for path in [folder, *folder.iterdir()]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return folder


def _predict(ws: Workspace, shared: Path, data_args: list[str], video: Path, *extra: str):
    return ws.run("predict", [f"checkpoint={shared}/checkpoints/last.ckpt", *data_args,
                              f"video={video}", "device=cpu", f"hydra.run.dir={ws.work / 'run'}",
                              *extra])


@pytest.mark.parametrize("clips", [10, 1])
@pytest.mark.parametrize("name", REFUSED)
def test_predict_refuses_a_hostile_video(name: str, clips: int, ws: Workspace, shared: Path,
                                         data_args: list[str], hostile_videos: Path) -> None:
    """One error line naming the file, before any frame of it becomes RGB. With ``eval.clips``
    10 the dense video's RGB frames are refused before decoding; with 1, its decoded frames
    waiting in the window while they arrive."""
    video = Path(shutil.copy(hostile_videos / name, ws.root / name))
    line = _predict(ws, shared, data_args, video, f"eval.clips={clips}").judge("refused", name)
    assert line.startswith(f"error: UnreadableVideo: video: {video}: cannot ")
    if name not in ("text.mp4", "empty.mp4", "truncated.mp4"):
        assert "VideoTooLarge" in line and "over the budget" in line, line


def test_predict_goes_on_past_hostile_videos_in_a_folder(ws: Workspace, shared: Path,
                                                         data_args: list[str], public_data: Path,
                                                         hostile_videos: Path) -> None:
    """A folder of every hostile video, one whose name holds terminal escapes and a newline,
    and one real video: the real one is predicted, every other is named (escaped) as not read."""
    folder = ws.root / "videos"
    shutil.copytree(hostile_videos, folder)
    (folder / "frame_4096.mp4").unlink()  # within the budgets (with few frames): not hostile
    shutil.copy(hostile_videos / "text.mp4", folder / EVIL_NAME)
    real = Path(shutil.copy(next((public_data / "val").rglob("*.mp4")), folder / "real.mp4"))
    out = ws.work / "predictions.json"
    outcome = _predict(ws, shared, data_args, folder, f"predict.out={out}", "eval.clips=2")
    outcome.judge("ok")
    summary = json.loads(out.read_text())
    assert [p["video"] for p in summary["predictions"]] == [str(real)]
    assert sorted(Path(e["video"]).name for e in summary["errors"]) == sorted([*REFUSED, EVIL_NAME])
    assert f"{len(REFUSED) + 1} of {len(REFUSED) + 2} videos could not be read" in outcome.ran.out
    assert repr(EVIL_NAME)[1:-1] in outcome.ran.text  # shown escaped
    assert "\nerror: forged" not in outcome.ran.text


def _dataset_with(ws: Workspace, public_data: Path, hostile_videos: Path, run_overrides,
                  swaps: dict[str, str]) -> list[str]:
    """The user's copy of the dataset, some of its videos replaced by hostile ones, as the
    ``data.*`` of their command line (a stranger's run chooses no dataset)."""
    root = Path(shutil.copytree(public_data, ws.root / "data"))
    for rel, name in swaps.items():
        shutil.copy(hostile_videos / name, root / rel)
    return [o for o in run_overrides(root) if o.startswith("data")]


def test_eval_skips_hostile_videos_and_scores_no_other(ws: Workspace, shared: Path,
                                                       public_data: Path, hostile_videos: Path,
                                                       run_overrides) -> None:
    """Two of the 8 validation videos are hostile: evaluation scores the other 6, says so,
    and stays within the budgets (``data.max_bad_fraction`` raised on the command line)."""
    swaps = {"val/right_then_up/right_then_up_0000.mp4": "frame_8192.mp4",
             "val/left_then_up/left_then_up_0001.mp4": "dense_window.mp4"}
    data = _dataset_with(ws, public_data, hostile_videos, run_overrides, swaps)
    out = ws.work / "eval"
    ws.run("eval", [f"checkpoint={shared}/checkpoints/last.ckpt", *data,
                    "data.max_bad_fraction=0.3", "eval.clips=2", "eval.crops=1", "device=cpu",
                    f"hydra.run.dir={out}"]).judge("ok")
    report = json.loads((out / "eval.json").read_text())
    assert (report["videos"], report["videos_listed"]) == (6, 8)


def test_eval_refuses_too_many_hostile_videos(ws: Workspace, shared: Path, public_data: Path,
                                              hostile_videos: Path, run_overrides) -> None:
    """The same two at the default ``data.max_bad_fraction`` (0.1): one error line."""
    swaps = {"val/right_then_up/right_then_up_0000.mp4": "lying_header.mp4",
             "val/left_then_up/left_then_up_0001.mp4": "declared_frames.mp4"}
    data = _dataset_with(ws, public_data, hostile_videos, run_overrides, swaps)
    ws.run("eval", [f"checkpoint={shared}/checkpoints/last.ckpt", *data,
                    "eval.clips=2", "eval.crops=1", "device=cpu",
                    f"hydra.run.dir={ws.work / 'eval'}"]).judge("refused", "data.max_bad_fraction")
