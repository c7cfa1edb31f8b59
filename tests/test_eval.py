"""Multi-view evaluation: aggregation against hand-computed expectations, the report files,
``trainer.test_after_fit``, and ``python -m videotrain.eval checkpoint=PATH``."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import videotrain.run as run
from videotrain.config.trained_run import apply_overrides
from videotrain.engine.evaluate import EvalSettings, evaluate
from videotrain.engine.precision import Precision
from videotrain.metrics.accuracy import MultiViewAccuracy
from videotrain.metrics.eval_report import write_eval_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CPU = torch.device("cpu")


class PixelLogits(nn.Module):
    """A tiny model whose logits for a clip are the first pixel of its first frame, one
    channel per class: ``logits[n, k] = clip[n, 0, k, 0, 0]``. Views can thus be given any
    logits by hand."""

    def forward(self, video: torch.Tensor) -> torch.Tensor:  # (N, T, C, H, W) -> (N, K)
        return video[:, 0, :, 0, 0]


# Five videos x three views, K = 3 classes: (label, logits of each view).
VIDEOS = [
    (0, [[2, 0, 0], [2, 0, 0], [0, 0, 4]]),  # mean: right; max: the confident view 2 wins
    (1, [[0, 1, 0], [0, 1, 0], [0, 1, 0]]),  # right whatever the aggregate
    (2, [[3, 0, 0], [0, 0, 1], [0, 0, 1]]),  # two mild right views lose to one confident wrong
    (1, [[3, 0, 0], [3, 0, 0], [3, 0, 0]]),  # wrong
    (1, [[0, 2, 0], [0, 2, 0], [0, 2, 0]]),  # right
]


def _softmax(row: list[float]) -> list[float]:
    e = [math.exp(x) for x in row]
    return [x / sum(e) for x in e]


def _expected(aggregate: str) -> list[int]:
    """The predicted class of each video, computed by hand from the softmax of its views."""
    preds = []
    for _, views in VIDEOS:
        probs = [_softmax(v) for v in views]
        per_class = list(zip(*probs, strict=True))
        scores = [max(c) if aggregate == "max" else sum(c) / (len(c) if aggregate == "mean" else 1)
                  for c in per_class]
        preds.append(scores.index(max(scores)))
    return preds


def _loader(batch_size: int = 2) -> list[dict]:
    batches = []
    for i in range(0, len(VIDEOS), batch_size):
        chunk = VIDEOS[i : i + batch_size]
        video = torch.zeros(len(chunk), 3, 2, 3, 1, 1)  # (B, V, T, C, H, W)
        for b, (_, views) in enumerate(chunk):
            video[b, :, 0, :, 0, 0] = torch.tensor(views, dtype=torch.float32)
        batches.append({"video": video, "label": torch.tensor([lab for lab, _ in chunk]),
                        "skipped": []})
    return batches


def test_hand_computed_expectations() -> None:
    # the premises of the table above, by hand
    assert _expected("mean") == [0, 1, 0, 0, 1] and _expected("max") == [2, 1, 0, 0, 1]
    assert _expected("sum") == _expected("mean")
    p = _softmax([2, 0, 0])[0], _softmax([0, 0, 4])[0]
    assert (2 * p[0] + p[1]) / 3 == pytest.approx(0.5306, abs=1e-4)


@pytest.mark.parametrize("aggregate", ["mean", "sum", "max"])
def test_multi_view_aggregation_on_a_tiny_model(aggregate: str) -> None:
    meter = MultiViewAccuracy((1, 5), num_classes=3, aggregate=aggregate)
    m = evaluate(PixelLogits(), _loader(), Precision("32", CPU), CPU, meter=meter)
    labels = [lab for lab, _ in VIDEOS]
    preds = _expected(aggregate)
    assert m["val_top1"] == pytest.approx(sum(p == y for p, y in zip(preds, labels, strict=True)) / 5)
    # clip level does not depend on the aggregate: each view's own argmax
    clip_hits = sum(max(range(3), key=lambda k, v=v: v[k]) == y for y, views in VIDEOS for v in views)
    assert clip_hits == 2 + 3 + 2 + 0 + 3
    assert m["val_clip_top1"] == pytest.approx(clip_hits / 15)
    assert m["val_top5"] == m["val_clip_top5"] == 1.0  # K = 3 < 5
    # per class: class 0 has video 0; class 1 videos 1, 3, 4; class 2 video 2
    per_class = {0: [0], 1: [1, 3, 4], 2: [2]}
    accs = [sum(preds[i] == c for i in idx) / len(idx) for c, idx in per_class.items()]
    assert m["val_mean_class_acc"] == pytest.approx(sum(accs) / 3)
    expected_conf = torch.zeros(3, 3)
    for y, p in zip(labels, preds, strict=True):
        expected_conf[y, p] += 1
    assert torch.equal(meter.confusion.float(), expected_conf)
    # the loss is the NLL of the mean softmax, whatever the aggregate
    nll = -sum(math.log(sum(_softmax(v)[y] for v in views) / 3) for y, views in VIDEOS) / 5
    assert m["val_loss"] == pytest.approx(nll, rel=1e-5)


def test_aggregates_differ_where_they_should() -> None:
    out = {}
    for aggregate in ("mean", "max"):
        out[aggregate] = evaluate(PixelLogits(), _loader(batch_size=5), Precision("32", CPU), CPU,
                                  num_classes=3, aggregate=aggregate)
    assert out["mean"]["val_top1"] == pytest.approx(3 / 5)
    assert out["max"]["val_top1"] == pytest.approx(2 / 5)
    assert out["mean"]["val_mean_class_acc"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert out["max"]["val_mean_class_acc"] == pytest.approx((0 + 2 / 3 + 0) / 3)


def test_report_files(tmp_path: Path) -> None:
    meter = MultiViewAccuracy((1, 5), num_classes=3)
    evaluate(PixelLogits(), _loader(), Precision("32", CPU), CPU, meter=meter)
    summary = {"video_top1": 0.6, "mean_class_acc": 0.556, "videos": 5, "clips": 3, "crops": 1,
               "aggregate": "mean"}
    names = ["jumping", "running", "swimming"]
    files = write_eval_report(tmp_path, summary, meter.confusion, names)
    rows = list(csv.DictReader(open(files["per_class"])))
    assert [r["class_name"] for r in rows] == names
    assert [(r["videos"], r["correct"]) for r in rows] == [("1", "1"), ("3", "2"), ("1", "0")]
    assert rows[1]["top1"] == "0.6667" and rows[1]["most_confused_with"] == "jumping"
    assert rows[2]["most_confused_with"] == "jumping" and rows[0]["most_confused_with"] == ""
    assert json.loads(Path(files["eval"]).read_text())["files"] == files
    assert Path(files["confusion"]).read_bytes()[:8] == PNG_MAGIC


def test_report_draws_class_names_as_plain_text(tmp_path: Path) -> None:
    """Class names come from a stranger's annotation file: one that is broken mathtext is drawn
    as it is, and the report is whole (savefig raised on it, before eval.json was written)."""
    names = ["a $ sign", "$\\frac{$", "$x^2$"]
    summary = {"video_top1": 0.0, "mean_class_acc": 0.0, "videos": 3, "clips": 1, "crops": 1,
               "aggregate": "mean"}
    files = write_eval_report(tmp_path, summary, torch.eye(3), names)
    assert json.loads(Path(files["eval"]).read_text())["videos"] == 3
    assert Path(files["confusion"]).read_bytes()[:8] == PNG_MAGIC
    assert [r["class_name"] for r in csv.DictReader(open(files["per_class"]))] == names


def test_eval_settings_validation() -> None:
    with pytest.raises(ValueError, match="eval.aggregate must be one of mean, sum, max"):
        EvalSettings(aggregate="median")
    with pytest.raises(ValueError, match="eval.clips must be >= 1"):
        EvalSettings(clips=0)
    for bad in (0, "big", 2.5):
        with pytest.raises(ValueError, match="eval.frame_chunk must be auto, null or a number"):
            EvalSettings(frame_chunk=bad)
    assert EvalSettings(frame_chunk=None).frame_chunk is None


# ------------------------------------------------------------------- end to end


def test_test_after_fit_matches_the_last_validation(run_overrides, compose_cfg, tmp_path: Path,
                                                    tiny_root: Path) -> None:
    """With the validation's views (1 clip x 1 crop), the test after fit sees exactly what the
    last validation saw; the report lands next to results.json."""
    cfg = compose_cfg(run_overrides(trainer__max_steps=2, trainer__test_after_fit=True,
                                    data__val_clips=1, data__val_crops=1, eval__clips=1,
                                    eval__crops=1, eval__batch_size=3))
    results = run.train(cfg, tmp_path)
    test = results["test"]
    assert test["videos"] == 8 and test["views"] == 1 and test["num_classes"] == 4
    assert test["video_top1"] == results["val_top1"] == results["test_video_top1"]
    assert test["clip_top1"] == results["val_clip_top1"]
    assert test["mean_class_acc"] == pytest.approx(results["val_mean_class_acc"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["test"]["video_top1"] == test["video_top1"]
    assert json.loads((tmp_path / "eval.json").read_text())["video_top1"] == test["video_top1"]
    names = [r["class_name"] for r in csv.DictReader(open(tmp_path / "per_class.csv"))]
    assert names == (tiny_root / "classes.txt").read_text().split()
    assert (tmp_path / "confusion.png").read_bytes()[:8] == PNG_MAGIC


def test_evaluate_checkpoint_with_the_run_config(run_overrides, compose_cfg, tmp_path: Path) -> None:
    """What the command does, in-process: the run's config.yaml, then the eval settings."""
    from videotrain.config.trained_run import find_run_config
    from videotrain.eval import evaluate_checkpoint

    run_dir = tmp_path / "run"
    results = run.train(compose_cfg(run_overrides(trainer__max_steps=2)), run_dir)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert find_run_config(ckpt) == run_dir / "config.yaml"
    overrides = [f"checkpoint={ckpt}", "eval.clips=1", "eval.crops=1", "eval.batch_size=8"]
    cfg = apply_overrides(OmegaConf.load(run_dir / "config.yaml"), compose_cfg(overrides), overrides)
    report = evaluate_checkpoint(cfg, tmp_path / "eval")
    # the default config (resnet10) would not load this checkpoint (a one-layer ViT); with the
    # validation's single centre view, the evaluation repeats the run's last validation
    assert report["video_top1"] == results["val_top1"] and report["views"] == 1
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["checkpoint"] == str(ckpt)


@pytest.mark.slow  # a fresh interpreter (~15 s); the same path runs in-process above
def test_eval_cli_on_a_training_checkpoint(run_overrides, compose_cfg, tmp_path: Path) -> None:
    """Train two steps, then ``python -m videotrain.eval checkpoint=PATH`` with 2 clips x 3
    crops: the model config comes from the run's config.yaml."""
    run_dir = tmp_path / "run"
    run.train(compose_cfg(run_overrides(trainer__max_steps=2)), run_dir)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "videotrain.eval", f"checkpoint={ckpt}", "eval.clips=2",
           "eval.crops=3", "eval.aggregate=max", f"hydra.run.dir={out}", "trainer.progress=false"]
    done = subprocess.run(cmd, cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["checkpoint"] == str(ckpt) and report["views"] == 6
    assert report["aggregate"] == "max" and report["videos"] == 8
    for key in ("video_top1", "video_top5", "clip_top1", "clip_top5", "mean_class_acc"):
        assert 0.0 <= report[key] <= 1.0, key
    assert report["video_top5"] == 1.0 and report["skipped_videos"] == 0
    assert len(list(csv.DictReader(open(out / "per_class.csv")))) == 4
    assert (out / "confusion.png").read_bytes()[:8] == PNG_MAGIC
    # the run's model (a one-layer ViT of width 32), not the default config's resnet10
    assert "does not fit" not in done.stderr


def test_eval_errors(compose_cfg, tmp_path: Path, run_overrides) -> None:
    from videotrain.eval import evaluate_checkpoint

    with pytest.raises(ValueError, match="checkpoint=PATH is required"):
        evaluate_checkpoint(compose_cfg(run_overrides()), tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpoint: file not found"):
        evaluate_checkpoint(compose_cfg(run_overrides(checkpoint=tmp_path / "x.ckpt")), tmp_path)
    bogus = tmp_path / "other.ckpt"
    torch.save({"model": nn.Linear(2, 2).state_dict()}, bogus)
    with pytest.raises(ValueError, match="does not fit the configured model"):
        evaluate_checkpoint(compose_cfg(run_overrides(checkpoint=bogus, eval__clips=1,
                                                      eval__crops=1)), tmp_path)


def test_eval_keys_are_eval_settings(compose_cfg) -> None:
    import dataclasses

    cfg = compose_cfg()
    assert set(cfg.eval) == {f.name for f in dataclasses.fields(EvalSettings)}
    assert (cfg.eval.clips, cfg.eval.crops, cfg.eval.aggregate) == (10, 3, "mean")  # Kinetics
    assert cfg.checkpoint is None and cfg.trainer.test_after_fit is False


class CreatesAFile:
    """Unpickling this calls ``open(path, "w")``: what a malicious checkpoint could do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_eval_cli_refuses_an_unsafe_checkpoint(tmp_path: Path) -> None:
    """``python -m videotrain.eval`` reads checkpoints with torch.load(weights_only=True), first
    thing: a file whose unpickling would run code is refused, naming the file, and its code
    never runs."""
    marker = tmp_path / "created-by-unpickling"
    evil = tmp_path / "evil.ckpt"
    torch.save({"model": {}, "payload": CreatesAFile(marker)}, evil)
    cmd = [sys.executable, "-m", "videotrain.eval", f"checkpoint={evil}",
           f"hydra.run.dir={tmp_path / 'out'}", "trainer.progress=false", "device=cpu"]
    done = subprocess.run(cmd, cwd=tmp_path, env=os.environ.copy(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0, done.stderr[-3000:]
    assert (f"{evil} is not a safe videotrain checkpoint: it needs arbitrary unpickling "
            "(unsupported global io.open)") in done.stderr
    assert "weights_only=False" not in done.stderr and "set to `False`" not in done.stderr
    assert done.returncode == 2 and len([ln for ln in done.stderr.splitlines()
                                         if ln.startswith("error:")]) == 1
    assert "refusing to load it" in done.stderr
    assert not marker.exists()


def test_eval_scores_only_the_videos_that_are_there(run_overrides, compose_cfg, tiny_copy: Path,
                                                     tmp_path: Path, capsys) -> None:
    """``videotrain.eval``: a missing val video is not replaced by another one; eval.json counts
    7 evaluated of 8 listed and the eval folder lists the missing one. Its data errors are one
    `error:` line with exit status 2."""
    from videotrain.config.build import clean_errors
    from videotrain.eval import evaluate_checkpoint

    run_dir = tmp_path / "run"
    run.train(compose_cfg(run_overrides(root=tiny_copy, trainer__max_steps=1)), run_dir)
    gone = tiny_copy / "val/right_then_up/right_then_up_0000.mp4"
    gone.unlink()
    overrides = [f"checkpoint={run_dir / 'checkpoints' / 'last.ckpt'}", "eval.clips=1", "eval.crops=1",
                 "data.max_bad_fraction=0.2"]
    cfg = apply_overrides(OmegaConf.load(run_dir / "config.yaml"), compose_cfg(overrides), overrides)
    report = evaluate_checkpoint(cfg, tmp_path / "eval")
    assert report["videos"] == 7 and report["videos_listed"] == 8
    assert report["skipped_paths"] == [str(gone)]
    assert (tmp_path / "eval" / "missing_videos_val.txt").read_text() == f"{gone}\n"

    cfg.checkpoint = str(tmp_path / "nothing.ckpt")
    with pytest.raises(SystemExit) as done, clean_errors():
        evaluate_checkpoint(cfg, tmp_path / "eval2")
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: checkpoint: file not found: {tmp_path / 'nothing.ckpt'}"]
