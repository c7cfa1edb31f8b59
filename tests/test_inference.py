"""Using a trained model: ``python -m videotrain.predict`` (top-k classes of video files, with
the evaluation's views) and ``python -m videotrain.export`` (torch.export / ONNX graphs whose
logits equal the eager model's). The checkpoint comes from a tiny run trained with SBP, so the
exported graph is the evaluation forward without SBP's machinery."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import videotrain.run as run
from videotrain.config.build import build_model
from videotrain.config.trained_run import load_trained
from videotrain.data.dataset import BadVideo
from videotrain.engine.checkpoints import format as ckpt
from videotrain.engine.inference import ExportSettings, PredictSettings, run_exported
from videotrain.export import export
from videotrain.predict import predict
from videotrain.untrusted import NAME_CHARS, shown_name

CLASSES = ["right_then_down", "right_then_up", "left_then_down", "left_then_up"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, run_overrides, compose_cfg) -> Path:
    """A two-step run (tiny ViT, SBP); returns its last checkpoint."""
    run_dir = tmp_path_factory.mktemp("inference") / "run"
    run.train(compose_cfg(run_overrides(trainer__max_steps=2, memory="sbp")), run_dir)
    return run_dir / "checkpoints" / "last.ckpt"


def _predict(compose_cfg, ckpt: Path, video: Path, *extra: str) -> dict:
    overrides = [f"checkpoint={ckpt}", f"video={video}", "eval.clips=2", "eval.crops=3", *extra]
    return predict(compose_cfg(overrides), overrides)


def test_one_video_prints_its_top_classes(trained, compose_cfg, tiny_root: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    video = tiny_root / "val" / "right_then_up" / "right_then_up_0000.mp4"
    out = tmp_path / "pred.json"
    summary = _predict(compose_cfg, trained, video, f"predict.out={out}")
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == str(video) and len(printed) == 5  # the path, then 4 classes (K = 4)
    (pred,) = summary["predictions"]
    top = pred["top"]
    # class names from the run's results.json, ranked, probabilities of the aggregated views
    assert sorted(t["class"] for t in top) == sorted(CLASSES)
    assert [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)
    assert sum(t["prob"] for t in top) == pytest.approx(1.0, abs=1e-5)
    for line, t in zip(printed[1:], top, strict=True):
        assert t["class"] in line and f"{t['prob']:.4f}" in line
    assert json.loads(out.read_text()) == summary
    assert (summary["clips"], summary["crops"], summary["errors"]) == (2, 3, [])


def test_folder_reports_bad_videos_and_goes_on(trained, compose_cfg, tiny_root: Path,
                                               tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "videos"
    shutil.copytree(tiny_root / "val", folder)
    corrupt = folder / "right_then_up" / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    (folder / "notes.txt").write_text("not a video: ignored")
    summary = _predict(compose_cfg, trained, folder, "predict.topk=2")
    assert len(summary["predictions"]) == 8 and all(len(p["top"]) == 2 for p in summary["predictions"])
    (error,) = summary["errors"]
    assert error["video"] == str(corrupt) and str(corrupt) in error["error"]
    assert f"1 of 9 videos could not be read: {corrupt}" in capsys.readouterr().out


def test_missing_and_corrupt_videos_name_the_file(trained, compose_cfg, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"video: no such file or folder: {tmp_path / 'x.mp4'}"):
        _predict(compose_cfg, trained, tmp_path / "x.mp4")
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"garbage")
    with pytest.raises(BadVideo, match=f"video: {bad}: cannot open"):
        _predict(compose_cfg, trained, bad)
    with pytest.raises(ValueError, match="predict.topk must be >= 1"):
        PredictSettings(topk=0)


def test_checkpoint_outside_its_run_uses_its_stored_config(trained, compose_cfg, tiny_root: Path,
                                                           tmp_path: Path) -> None:
    """No config.yaml or results.json beside it: the config stored in the checkpoint describes
    the model, and the class names come from the dataset's annotations."""
    alone = tmp_path / "alone.ckpt"
    shutil.copy(trained, alone)
    summary = _predict(compose_cfg, alone, tiny_root / "val" / "left_then_up")
    assert {t["class"] for p in summary["predictions"] for t in p["top"]} == set(CLASSES)


def _export(compose_cfg, ckpt: Path, out: Path, fmt: str) -> dict:
    overrides = [f"checkpoint={ckpt}", f"export.format={fmt}", f"export.out={out}"]
    return export(compose_cfg(overrides), overrides)


@pytest.mark.parametrize("fmt", ["torch_export", "onnx"])
def test_export_equals_the_eager_model(trained, compose_cfg, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / ("model.pt2" if fmt == "torch_export" else "model.onnx")
    meta = _export(compose_cfg, trained, out, fmt)
    assert meta["path"] == str(out) and out.is_file()
    assert meta["max_abs_diff_vs_eager"] <= 1e-4
    assert json.loads(Path(f"{out}.json").read_text())["class_names"] == CLASSES
    t, size = meta["input"]["shape"][1], meta["input"]["shape"][3]
    # the run's own model (SBP) in eval mode: the same logits
    run_cfg = OmegaConf.load(trained.parent.parent / "config.yaml")
    own = build_model(run_cfg, num_classes=4)
    own.load_state_dict(ckpt.load(trained)["model"])
    own.eval().eval_frame_chunk = None
    for batch in (1, 3):  # the batch dimension is dynamic
        video = torch.randn(batch, t, 3, size, size)
        with torch.no_grad():
            want = own(video)
        got = run_exported(out, fmt, video)
        assert got.shape == (batch, 4)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_export_settings_and_missing_extra(trained, compose_cfg, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="export.format must be one of torch_export, onnx"):
        ExportSettings(format="tflite")
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"the 'export' extra .*videotrain\[export\]"):
        _export(compose_cfg, trained, tmp_path / "m.onnx", "onnx")
    # the model is loaded once and on the CPU whatever the run's device
    model = load_trained(compose_cfg([f"checkpoint={trained}"]), [f"checkpoint={trained}"],
                         device="cpu").model
    assert not model.training and next(model.parameters()).device.type == "cpu"


@pytest.mark.slow  # ~40 s of training on 2 CPU cores, then a fresh interpreter
def test_predict_cli_prints_the_true_class_first(run_overrides, compose_cfg, tiny_root: Path,
                                                 tmp_path: Path) -> None:
    """The default model (resnet10 + tconv head) trained 100 steps on the tiny synthetic set
    (all 8 frames) has learned its training clips; ``python -m videotrain.predict`` prints a
    generated clip's true class first."""
    run_dir = tmp_path / "run"
    default_model = [o for o in run_overrides() if not o.startswith("model")]
    run.train(compose_cfg([*default_model, "model.head.hidden_dim=16", "data.num_frames=8",
                           "data.sampling_rate=1", "trainer.max_steps=100", "trainer.max_epochs=100",
                           "trainer.checkpoint_every_n_steps=null"]), run_dir)
    video = tiny_root / "train" / "left_then_down" / "left_then_down_0000.mp4"
    out = tmp_path / "pred.json"
    cmd = [sys.executable, "-m", "videotrain.predict", f"checkpoint={run_dir / 'checkpoints' / 'last.ckpt'}",
           f"video={video}", f"predict.out={out}", f"hydra.run.dir={tmp_path / 'out'}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()  # (Hydra's log lines go to stdout too)
    at = lines.index(str(video))
    assert lines[at + 1].split()[:2] == ["1.", "left_then_down"], done.stdout
    assert json.loads(out.read_text())["predictions"][0]["top"][0]["class"] == "left_then_down"


HOSTILE_NAMES = ["x\n  1. forged  1.0000", "\x1b[2J\x1b]52;c;ZWNobw==\x07cleared", "\u202eevil",
                 "n" * 500]


def test_class_names_from_a_checkpoint_are_escaped_in_every_sink(
        trained, compose_cfg, tiny_root: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    """Class names with a newline, terminal escapes (clear, OSC 52), a bidirectional control
    and 500 characters: predict's terminal output, ``predict.out`` and the export's metadata
    hold them escaped and cut to ``NAME_CHARS``; no control character reaches any of them, and
    the names still tell the classes apart."""
    hostile = tmp_path / "hostile.ckpt"
    blob = ckpt.load(trained)
    blob["class_names"] = HOSTILE_NAMES
    torch.save(blob, hostile)
    video = tiny_root / "val" / "right_then_up" / "right_then_up_0000.mp4"
    out = tmp_path / "pred.json"
    with caplog.at_level("INFO"):
        summary = _predict(compose_cfg, hostile, video, f"predict.out={out}", "predict.topk=4")
        meta = _export(compose_cfg, hostile, tmp_path / "model.pt2", "torch_export")
    printed = capsys.readouterr().out
    shipped = [t["class"] for t in json.loads(out.read_text())["predictions"][0]["top"]]
    recorded = json.loads(Path(f"{tmp_path / 'model.pt2'}.json").read_text())["class_names"]
    assert recorded == meta["class_names"] and len(recorded) == 4
    assert sorted(shipped) == sorted(recorded) == sorted(shown_name(n) for n in HOSTILE_NAMES)
    assert len(set(recorded)) == 4
    for text in (printed, caplog.text, *shipped, *recorded):
        assert not any(not c.isprintable() for c in text.replace("\n", "")), repr(text)
        assert "\x1b" not in text and "\u202e" not in text and "n" * (NAME_CHARS + 1) not in text
    assert not any(line.startswith("  1. forged") for line in printed.splitlines())
    assert "\\x1b[2J" in printed and "\\u202e" in printed and "(500 chars)" in printed
    assert summary["predictions"][0]["top"][0]["class"] in recorded
