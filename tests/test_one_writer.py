"""Every file a command writes goes through the one writer (``videotrain.untrusted.files``),
called here as each command calls it: a symbolic link planted at a name it writes is replaced
by a new, real file, never written through; a link in place of a folder the project creates
(or was handed as a run folder) is refused, naming it, with nothing written; the user's own
folder (a cache or ``--out`` behind a link of theirs) is followed as given. The victim (a file
and a folder outside, where the links point) never changes. ``tests/untrusted/`` runs the
commands themselves on shared files, as root and as an unprivileged user."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks import equal_time
from benchmarks.clips import clip_set, probe, write_clip
from videotrain.bench import report
from videotrain.config import build
from videotrain.data.layouts import generate
from videotrain.data.loaders import read_index
from videotrain.data.preflight import preflight, report_bad
from videotrain.data.synthetic import SyntheticSpec, write_video
from videotrain.engine.inference import export_model, run_exported
from videotrain.metrics.eval_report import write_eval_report
from videotrain.prepare import __main__ as prepare_cli
from videotrain.prepare.kinetics import prepare_kinetics
from videotrain.untrusted import UnsafeFileError

KEY = "ssh-ed25519 AAAA the-user's-key\n"
FRAMES = np.random.default_rng(0).integers(0, 255, (4, 32, 32, 3), dtype=np.uint8)


def _shot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` and a digest of its bytes (a link: its target)."""
    shot = {}
    for here, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(here) / name
            shot[str(path.relative_to(folder))] = (
                f"-> {os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir()
                else hashlib.sha256(path.read_bytes()).hexdigest())
    return shot


class Victim:
    """The user's files a link points at: ``key`` (a file) and ``folder`` (a folder)."""

    def __init__(self, root: Path) -> None:
        self.folder = root / "victim"
        (self.folder / "site-packages").mkdir(parents=True)
        self.key = self.folder / "authorized_keys"
        self.key.write_text(KEY)
        self.before = _shot(self.folder)

    def unchanged(self) -> bool:
        return _shot(self.folder) == self.before and self.key.read_text() == KEY


@pytest.fixture
def victim(tmp_path: Path) -> Victim:
    return Victim(tmp_path)


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def real_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


# ---------------------------------------------------------------------- eval (and training's test)
CONFUSION = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
SUMMARY = {"video_top1": 0.75, "mean_class_acc": 0.75, "videos": 4, "clips": 1, "crops": 1,
           "aggregate": "mean"}


@pytest.mark.parametrize("name", ["eval.json", "per_class.csv", "confusion.png"])
def test_eval_report_replaces_a_link_at_each_name(name: str, tmp_path: Path,
                                                  victim: Victim) -> None:
    run = tmp_path / "run"
    plant(run / name, victim.key)
    files = write_eval_report(run, SUMMARY, CONFUSION, ["a", "b"])
    assert all(real_file(Path(p)) for p in files.values()) and victim.unchanged()
    assert (run / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_report_refuses_a_run_folder_that_is_a_link(tmp_path: Path, victim: Victim) -> None:
    """``hydra.run.dir=SHARED/eval`` where ``eval`` links to the user's folder: nothing written."""
    run = plant(tmp_path / "shared" / "eval", victim.folder)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        write_eval_report(run, SUMMARY, CONFUSION, ["a", "b"])
    assert victim.unchanged()


# ---------------------------------------------------------------------- preflight (train, eval)
@pytest.fixture
def half_missing(tmp_path: Path):
    """A Kinetics list of four videos, two of them missing."""
    root = tmp_path / "k"
    (root / "videos").mkdir(parents=True)
    for i in (0, 2):
        (root / "videos" / f"v{i}.mp4").write_bytes(b"not empty")
    (root / "train.csv").write_text("".join(f"v{i}.mp4 {i % 2}\n" for i in range(4)))
    return read_index("kinetics", root, "train", None, {"path_prefix": "videos"})


def test_missing_videos_list_replaces_a_link(tmp_path: Path, victim: Victim) -> None:
    run = tmp_path / "run"
    listing = plant(run / "missing_videos_train.txt", victim.key)
    assert report_bad(["/data/a.mp4"], 4, "train.csv", "train", run) == listing
    assert real_file(listing) and listing.read_text() == "/data/a.mp4\n" and victim.unchanged()
    with pytest.raises(UnsafeFileError, match="symbolic link"):  # the run folder itself a link
        report_bad(["/data/a.mp4"], 4, "train.csv", "train", plant(tmp_path / "r2", victim.folder))
    assert victim.unchanged()


def test_preflight_cache_follows_no_link_below_the_users_cache(tmp_path: Path, victim: Victim,
                                                               half_missing) -> None:
    """The cache folder is the user's own (a link of theirs is followed: ~/.cache on scratch);
    ``preflight/`` inside it is the project's: a link there is refused, nothing written."""
    real = tmp_path / "scratch" / "cache"
    real.mkdir(parents=True)
    cache = plant(tmp_path / "cache", real)
    assert len(preflight(half_missing, 1.0, cache_dir=cache)) == 2
    (written,) = (real / "preflight").iterdir()
    assert real_file(written)

    other = tmp_path / "cache2"
    plant(other / "preflight", victim.folder / "site-packages")
    with pytest.raises(UnsafeFileError, match="preflight"):
        preflight(half_missing, 1.0, cache_dir=other)
    assert victim.unchanged()


# ---------------------------------------------------------------------- synthetic data
@pytest.mark.parametrize("suffix", [".mp4", ".avi", ".webm"])
def test_synthetic_video_replaces_a_link(suffix: str, tmp_path: Path, victim: Victim) -> None:
    path = plant(tmp_path / f"clip{suffix}", victim.key)
    write_video(path, FRAMES, 10)
    assert real_file(path) and probe(path)["frames"] == len(FRAMES) and victim.unchanged()


def test_synthetic_video_follows_no_folder_link_below_its_root(tmp_path: Path,
                                                              victim: Victim) -> None:
    root = tmp_path / "dataset"
    plant(root / "train", victim.folder)
    with pytest.raises(UnsafeFileError, match="train"):
        write_video(root / "train" / "a" / "clip.mp4", FRAMES, 10, root)
    assert victim.unchanged()


def test_generate_refuses_a_link_at_its_working_folder(tmp_path: Path, victim: Victim) -> None:
    """The tree is written in ``NAME.tmpPID`` and renamed: a link there is not written into."""
    spec = SyntheticSpec(train_per_class=1, val_per_class=1, num_frames=4, size=32)
    plant(tmp_path / f"set.tmp{os.getpid()}", victim.folder)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        generate(tmp_path / "set", spec)
    assert victim.unchanged() and not (tmp_path / "set").exists()


def test_generate_into_the_users_own_linked_folder(tmp_path: Path) -> None:
    real = tmp_path / "scratch"
    real.mkdir()
    spec = SyntheticSpec(train_per_class=1, val_per_class=1, num_frames=4, size=32)
    root = generate(plant(tmp_path / "cache", real) / "set", spec)
    assert root == tmp_path / "cache" / "set" and real_file(real / "set" / "spec.json")
    assert len(list((real / "set").rglob("*.mp4"))) == 8


# ---------------------------------------------------------------------- prepare
@pytest.fixture
def download(tmp_path: Path) -> tuple[Path, Path]:
    """A release CSV of one row and its (real, decodable) video."""
    csv = tmp_path / "train.csv"
    csv.write_text("label,youtube_id,time_start,time_end,split\nabseiling,aaaaaaaaaaa,0,10,train\n"
                   "abseiling,bbbbbbbbbbb,0,10,train\n")
    videos = tmp_path / "videos"
    videos.mkdir()
    write_video(videos / "aaaaaaaaaaa_000000_000010.mp4", FRAMES, 10)
    return csv, videos


def _prepare(csv: Path, videos: Path, out: Path,
             capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    """``python -m videotrain.prepare kinetics ... --resize 256``: its status and error lines."""
    code = prepare_cli.main(["kinetics", "--csv", str(csv), "--videos", str(videos),
                             "--out", str(out), "--resize", "256", "--workers", "1"])
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]


@pytest.mark.parametrize("name", ["classes.txt", "train.csv", "missing_train.csv",
                                  "videos_256/train/aaaaaaaaaaa_000000_000010.mp4"])
def test_prepare_replaces_a_link_at_each_output(name: str, tmp_path: Path, victim: Victim,
                                                download, capsys: pytest.CaptureFixture) -> None:
    """A new file in the link's place, or one ``error:`` line and exit status 2 (an existing
    ``classes.txt`` is read first, and one that does not list the labels is refused). A link at
    a re-encoded video's name is no finished output: encoded over, not skipped."""
    csv, videos = download
    out = tmp_path / "out"
    plant(out / name, victim.key)
    code, errors = _prepare(csv, videos, out, capsys)
    assert victim.unchanged()
    if code == 2:
        assert len(errors) == 1 and name == "classes.txt" and KEY.strip() not in errors[0]
        return
    assert code == 0 and not errors and real_file(out / name)
    assert probe(out / "videos_256" / "train" / "aaaaaaaaaaa_000000_000010.mp4")["frames"] == 4


def test_prepare_removes_a_stale_link_not_its_target(tmp_path: Path, victim: Victim,
                                                     download) -> None:
    """No video missing now: an earlier ``missing_train.csv`` (here a link) is removed."""
    csv, videos = download
    csv.write_text(csv.read_text().splitlines(keepends=True)[0]
                   + "abseiling,aaaaaaaaaaa,0,10,train\n")
    out = tmp_path / "out"
    plant(out / "missing_train.csv", victim.key)
    prepare_kinetics([csv], videos, out, log=lambda m: None)
    assert not os.path.lexists(out / "missing_train.csv") and victim.unchanged()


def test_prepare_refuses_a_linked_video_folder(tmp_path: Path, victim: Victim, download,
                                               capsys: pytest.CaptureFixture) -> None:
    """``--out`` holding ``videos_256`` as a link: one ``error:`` line, exit status 2, before
    anything is encoded."""
    csv, videos = download
    out = tmp_path / "out"
    plant(out / "videos_256", victim.folder)
    code, errors = _prepare(csv, videos, out, capsys)
    assert code == 2 and len(errors) == 1 and "videos_256" in errors[0] and victim.unchanged()


def test_prepare_into_the_users_own_linked_out(tmp_path: Path, download) -> None:
    """``--out`` a link of the user's own (to a bigger disk): followed as given, and the lists
    name the videos relative to ``--out`` as before."""
    csv, videos = download
    real = tmp_path / "disk" / "k400"
    real.mkdir(parents=True)
    prepare_kinetics([csv], videos, plant(tmp_path / "out", real), resize=256,
                     log=lambda m: None, warn=lambda m: None)
    assert (real / "train.csv").read_text() == "videos_256/train/aaaaaaaaaaa_000000_000010.mp4 0\n"
    assert real_file(real / "videos_256" / "train" / "aaaaaaaaaaa_000000_000010.mp4")


# ---------------------------------------------------------------------- export
class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * 3 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


EXAMPLE = torch.randn(2, 2, 3, 8, 8)


def test_torch_export_replaces_a_link(tmp_path: Path, victim: Victim) -> None:
    out = plant(tmp_path / "model.pt2", victim.key)
    export_model(Flat(), EXAMPLE, out, "torch_export")
    assert real_file(out) and run_exported(out, "torch_export", EXAMPLE).shape == (2, 4)
    assert victim.unchanged()


def test_onnx_export_replaces_links_at_the_model_and_its_weights(tmp_path: Path,
                                                                 victim: Victim) -> None:
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    out = plant(tmp_path / "model.onnx", victim.key)
    plant(tmp_path / "model.onnx.data", victim.folder / "site-packages" / "evil.pth")
    model = Flat().eval()
    export_model(model, EXAMPLE, out, "onnx")
    assert real_file(out) and victim.unchanged()
    with torch.no_grad():
        torch.testing.assert_close(run_exported(out, "onnx", EXAMPLE), model(EXAMPLE),
                                   rtol=1e-4, atol=1e-4)
    assert not (tmp_path / "model.onnx.data").is_symlink()


def test_export_refuses_a_run_folder_that_is_a_link(tmp_path: Path, victim: Victim) -> None:
    run = plant(tmp_path / "run", victim.folder)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        export_model(Flat(), EXAMPLE, run / "model.pt2", "torch_export", root=run)
    assert victim.unchanged()


# ---------------------------------------------------------------------- the run folder's claim
def test_unique_dir_passes_over_a_link_at_the_run_folders_name(tmp_path: Path,
                                                               victim: Victim) -> None:
    base = str(plant(tmp_path / "outputs" / "12-00-00", victim.folder))
    claimed = build.unique_dir(base)
    assert claimed == base + "-1" and Path(claimed).is_dir() and not Path(claimed).is_symlink()
    assert victim.unchanged()


def test_unique_dir_follows_no_link_below_the_working_folder(
        tmp_path: Path, victim: Victim, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """The default run folder (``outputs/DATE/TIME``, relative) is the project's: an ``outputs``
    linked to the user's folder ends the command with one ``error:`` line, exit status 2."""
    monkeypatch.chdir(tmp_path)
    plant(tmp_path / "outputs", victim.folder)
    with pytest.raises(SystemExit) as done:
        build.unique_dir("outputs/2026-01-01/12-00-00")
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert done.value.code == 2 and len(errors) == 1 and "outputs" in errors[0]
    assert victim.unchanged()
    (tmp_path / "outputs").unlink()
    assert build.unique_dir("outputs/2026-01-01/12-00-01") == "outputs/2026-01-01/12-00-01"
    assert (tmp_path / "outputs" / "2026-01-01" / "12-00-01").is_dir()


# ---------------------------------------------------------------------- bench and benchmarks
def test_bench_report_replaces_links_in_the_users_out(tmp_path: Path, victim: Victim) -> None:
    out = tmp_path / "bench"
    for name in ("bench.json", "bench.md", "bench.png"):
        plant(out / name, victim.key)
    setting = {"batch_size": 1, "frames": 4, "size": 32, "steps": 1, "extra_overrides": []}
    row = {"name": "e2e", "backbone": "vit_tiny", "strategy": "e2e", "granularity": None,
           "policy": None, "keep_ratio": 1.0, "peak_mem_mb": 1.0, "step_time_s": 0.1,
           "saved_act_mb": 1.0}
    report.add_ratios([row])
    report.write(out, [row], {"device": "cpu", "torch": "2", "setting": setting, "machine": {}})
    assert all(real_file(out / n) for n in ("bench.json", "bench.md", "bench.png"))
    assert victim.unchanged()


def test_equal_time_follows_no_link_in_its_out(tmp_path: Path, victim: Victim,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    """``benchmarks.equal_time --out`` a folder whose ``step_times.json`` is a link (not read:
    it would show the user's file) or whose ``conf`` is one: one ``error:`` line, exit status
    2; a real record is used, and the row config written, as before."""
    monkeypatch.setattr(equal_time, "measure_step_times",
                        lambda rows, *a, **k: dict.fromkeys(rows, 1.0))
    monkeypatch.setattr(equal_time, "e2e_steps", lambda extra: (4, 8))
    args = ["--rows", "sbp-frame-0.5", "--measure-only"]
    for link, target in (("step_times.json", victim.key), ("conf", victim.folder)):
        out = tmp_path / link.replace(".", "_")
        plant(out / link, target)
        assert equal_time.main([*args, "--out", str(out)]) == 2
        errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and link in errors[0] and KEY.strip() not in errors[0]
        assert victim.unchanged()
    out = tmp_path / "own"
    assert equal_time.main([*args, "--out", str(out)]) == 0
    assert real_file(out / "step_times.json")
    assert real_file(out / "conf" / "row" / "sbp-frame-0.5-at-time.yaml")


def test_benchmark_clip_replaces_a_link(tmp_path: Path, victim: Victim) -> None:
    spec = clip_set("kinetics", 1, seconds=0.5, width=32, height=32, fps=8, preset="veryfast")
    path = plant(tmp_path / "clip.mp4", victim.key)
    assert write_clip(path, spec, 0) == path.stat().st_size > 0
    assert real_file(path) and probe(path)["frames"] == 4 and victim.unchanged()
