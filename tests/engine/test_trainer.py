"""The training loop: step planning, schedule, optimizer groups, and exact resume.

Resume is checked two ways: in-process, by making an optimizer step raise right after a
checkpoint (deterministic, runs by default), and for real, by SIGKILLing ``python -m
videotrain`` once ``last.ckpt`` exists and re-running the same command (``-m slow``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import videotrain.config.build as builder
import videotrain.run as run
from videotrain.engine.optim import build_optimizer, param_groups, warmup_cosine
from videotrain.engine.trainer import Trainer, TrainerSettings, plan_steps

# ------------------------------------------------------------------- planning and schedule


def test_plan_steps() -> None:
    assert plan_steps(10, TrainerSettings(max_epochs=2, grad_accum=3)) == (3, 6)
    assert plan_steps(10, TrainerSettings(max_epochs=2, max_steps=4)) == (10, 4)
    assert plan_steps(10, TrainerSettings(max_epochs=1, max_steps=50)) == (10, 10)
    with pytest.raises(ValueError, match="fewer than trainer.grad_accum=4"):
        plan_steps(3, TrainerSettings(grad_accum=4))


@pytest.mark.parametrize(
    "kwargs,key",
    [({"grad_accum": 0}, "trainer.grad_accum"), ({"max_epochs": 0}, "trainer.max_epochs"),
     ({"max_steps": 0}, "trainer.max_steps"), ({"label_smoothing": 1.0}, "trainer.label_smoothing")],
)
def test_settings_validation_names_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        TrainerSettings(**kwargs)



def test_trainer_settings_take_every_trainer_key() -> None:
    """build.trainer_settings copies no field by hand: every trainer key reaches TrainerSettings
    (set away from its default here), data.max_bad_fraction too, and a key the dataclass does not
    declare is refused naming it."""
    from omegaconf import OmegaConf

    from videotrain.config.schema import UnknownConfigKey

    cfg = builder.compose_cfg(["trainer.max_epochs=3", "trainer.grad_clip=null", "trainer.sync_bn=true",
                               "trainer.precision=bf16", "trainer.channels_last=false", "trainer.resume=false",
                               "trainer.checkpoint_every_n_steps=7", "data.max_bad_fraction=0.25"])
    s = builder.trainer_settings(cfg)
    assert (s.max_epochs, s.grad_clip, s.sync_bn, s.precision, s.channels_last, s.resume) == (
        3, None, True, "bf16", False, "false")
    assert (s.checkpoint_every_n_steps, s.max_bad_fraction) == (7, 0.25)
    plain = OmegaConf.create({"trainer": {"max_epochs": 2, "max_epoch": 3}, "data": {"max_bad_fraction": 0.1}})
    with pytest.raises(UnknownConfigKey, match="unknown config key trainer.max_epoch "):
        builder.trainer_settings(plain)

def test_warmup_cosine_schedule() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine(opt, total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    lrs = []
    for _ in range(12):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])  # linear warmup, then the peak
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:], strict=False))  # then decays ...
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5)  # ... through the cosine midpoint ...
    assert lrs[10] == lrs[11] == pytest.approx(0.1)  # ... to min_lr_ratio, and stays there


def test_param_groups_and_optimizer_choice() -> None:
    head = nn.Module()  # named like TransformerHead's class token and position embedding
    head.cls = nn.Parameter(torch.zeros(1, 1, 4))
    head.pos = nn.Embedding(8, 4)
    model = nn.ModuleDict({"lin": nn.Linear(3, 4), "norm": nn.LayerNorm(4), "head": head})
    groups = param_groups(model, 0.05, lr=1e-3)
    decay = [p for g in groups if g["weight_decay"] == 0.05 for p in g["params"]]
    no_decay = [p for g in groups if g["weight_decay"] == 0.0 for p in g["params"]]
    assert [p.shape for p in decay] == [torch.Size([4, 3])]  # only the matrix decays
    assert len(no_decay) == 5  # bias, norm weight and bias, cls token, positions
    assert {g["lr"] for g in groups} == {1e-3}
    assert isinstance(build_optimizer(model, "adamw", 1e-3, 0.05), torch.optim.AdamW)
    sgd = build_optimizer(model, "sgd", 0.1, momentum=0.9)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"]
    with pytest.raises(ValueError, match="optim.name must be 'adamw' or 'sgd', got 'foo'"):
        build_optimizer(model, "foo", 0.1)


# ------------------------------------------------------------------- in-process runs


def _train_losses(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]


def _assert_same_losses(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> None:
    assert [s for s, _ in b] == [s for s, _ in a], "steps differ"
    assert all(n == 1 for n in Counter(s for s, _ in b).values()), "a step was logged twice"
    for (step, la), (_, lb) in zip(a, b, strict=True):
        assert abs(la - lb) <= 1e-5 * abs(la), f"step {step}: {la} vs {lb}"


RESUME_EXTRA = dict(trainer__max_epochs=2, trainer__checkpoint_every_n_steps=2,
                    # dropout makes the model consume the global RNG, which resume must restore
                    model__head__dropout=0.5)


@pytest.fixture(scope="module")
def uninterrupted(run_overrides, compose_cfg, tmp_path_factory) -> tuple[list[str], Path, dict]:
    overrides = run_overrides(**RESUME_EXTRA)
    out = tmp_path_factory.mktemp("uninterrupted")
    results = run.train(compose_cfg(overrides), out)
    return overrides, out, results


def test_run_outputs(uninterrupted, metrics_rows) -> None:
    _, out, results = uninterrupted
    assert results["steps"] == 8 and results["epochs"] == 2  # 16 videos / batch 4, 2 epochs
    saved = json.loads((out / "results.json").read_text())
    assert saved["steps"] == 8 and saved["class_names"] == results["class_names"]
    rows = metrics_rows(out)
    assert [s for s, _ in _train_losses(rows)] == list(range(1, 9))
    assert [r["step"] for r in rows if "val_top1" in r] == [4, 8]  # once per epoch
    assert (out / "checkpoints" / "last.ckpt").exists() and (out / "config.yaml").exists()


@pytest.mark.parametrize("crash_at_step", [3, 6], ids=["mid-epoch", "after-epoch-boundary"])
def test_resume_after_crash_matches_uninterrupted(
    uninterrupted, compose_cfg, metrics_rows, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, crash_at_step: int,
) -> None:
    overrides, out_a, results_a = uninterrupted
    cfg = compose_cfg(overrides)
    out_b = tmp_path / "run"
    real_step = Trainer._optimizer_step

    def crash(self):
        if self.state.step == crash_at_step - 1:
            raise RuntimeError("simulated crash")
        return real_step(self)

    monkeypatch.setattr(Trainer, "_optimizer_step", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run.train(cfg, out_b)
    assert not (out_b / "results.json").exists()
    monkeypatch.setattr(Trainer, "_optimizer_step", real_step)

    calls = []
    real_loss = Trainer._loss
    monkeypatch.setattr(Trainer, "_loss", lambda self, v, y: calls.append(1) or real_loss(self, v, y))
    with caplog.at_level(logging.INFO, logger="videotrain.engine.checkpoints.run"):  # resume
        results_b = run.train(cfg, out_b)
    # the last checkpoint before the crash was at an even step: only the rest was retrained
    resumed_from = (crash_at_step - 1) // 2 * 2
    assert f"at step {resumed_from}" in caplog.text and "resumed from" in caplog.text
    assert len(calls) == 8 - resumed_from
    _assert_same_losses(_train_losses(metrics_rows(out_a)), _train_losses(metrics_rows(out_b)))
    for key in ("val_top1", "val_loss", "steps", "epochs"):
        assert results_b[key] == pytest.approx(results_a[key], rel=1e-5), key


def test_grad_accum_and_max_steps(run_overrides, compose_cfg, metrics_rows, tmp_path: Path) -> None:
    cfg = compose_cfg(run_overrides(trainer__grad_accum=2, trainer__max_epochs=3,
                                    trainer__max_steps=3, data__batch_size=2))
    results = run.train(cfg, tmp_path)
    # 16 videos / batch 2 = 8 micro-batches = 4 optimizer steps per epoch; max_steps stops at 3
    assert results["steps"] == 3 and results["epochs"] == 0
    assert results["clips_per_s"] > 0 and results["step_time_s"] > 0
    rows = metrics_rows(tmp_path)
    assert [s for s, _ in _train_losses(rows)] == [1, 2, 3]
    assert [r["step"] for r in rows if "val_top1" in r] == [3]  # validated where it stopped
    assert [r["lr"] for r in rows if "lr" in r] == sorted(r["lr"] for r in rows if "lr" in r)


def test_step_peaks_reach_strategies_that_observe_them(run_overrides, compose_cfg, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The generic hook (memory.base.StepObserver): any strategy with ``observe_step`` gets each
    optimizer step's measured peak, so the loop needs no branch on the strategy; the gradient
    buffers are zeroed in place across epochs, so no step's peak counts their allocation."""
    from videotrain.memory.e2e import EndToEnd

    seen: list[tuple[int, float]] = []
    monkeypatch.setattr(EndToEnd, "observe_step", lambda self, step, peak: seen.append((step, peak)),
                        raising=False)
    grads: list[torch.Tensor] = []
    real_build = builder.build_optimizer

    def build(model, **kw):
        opt = real_build(model, **kw)
        first = next(model.parameters())
        opt.register_step_pre_hook(lambda o, a, k: grads.append(first.grad))
        return opt

    monkeypatch.setattr(builder, "build_optimizer", build)
    results = run.train(compose_cfg(run_overrides(trainer__max_epochs=2)), tmp_path)
    assert [s for s, _ in seen] == list(range(1, 9))  # 2 epochs of 4 steps
    assert all(isinstance(p, float) and p >= 0 for _, p in seen)
    assert max(p for _, p in seen[1:]) == results["train_peak_mem_mb"]
    assert len(grads) == 8 and all(g is grads[0] for g in grads)  # one buffer, both epochs


def test_a_step_reads_the_device_only_after_its_optimizer_step(run_overrides, compose_cfg, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop reads no value from the device (``float(tensor)``: a host sync on a GPU)
    between a micro-batch's backward and the optimizer step: the loss and the gradient norm are
    read after the step, where the trainer waits for the device anyway (its step time). A read
    in between would keep the host from queueing the optimizer's kernels while the GPU is
    still running the backward."""
    from videotrain.engine.precision import Precision

    events: list[str] = []
    real_backward, real_float = Precision.backward, torch.Tensor.__float__

    def backward(self, loss, scaler=None):
        real_backward(self, loss, scaler)
        events.append("backward")

    def traced_float(self):
        if sys._getframe(1).f_code.co_filename.endswith(os.path.join("engine", "trainer.py")):
            events.append("read")
        return real_float(self)

    real_build = builder.build_optimizer

    def build(model, **kw):
        opt = real_build(model, **kw)
        opt.register_step_post_hook(lambda o, a, k: events.append("step"))
        return opt

    monkeypatch.setattr(Precision, "backward", backward)
    monkeypatch.setattr(torch.Tensor, "__float__", traced_float)
    monkeypatch.setattr(builder, "build_optimizer", build)
    cfg = compose_cfg(run_overrides(trainer__grad_accum=2, trainer__max_steps=3, data__batch_size=2,
                                    trainer__grad_clip=1.0, trainer__log_every_n_steps=1))
    run.train(cfg, tmp_path)
    steps = "".join({"backward": "b", "step": "s", "read": "r"}[e] for e in events)
    assert steps.startswith("bbs") and steps.count("s") == 3, steps
    for between in steps.split("s")[:-1]:  # what each step did before its optimizer step
        assert between.lstrip("r") == "bb", steps  # reads (the last step's) only before its backwards
    assert "r" in steps.split("s")[1], steps  # the loss and grad norm are read, after the step


# ------------------------------------------------------------------- the real thing: SIGKILL


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted(run_overrides, metrics_rows,
                                                    tmp_path: Path) -> None:
    def command(run_dir: Path) -> list[str]:
        args = run_overrides(**{**RESUME_EXTRA, "trainer__max_epochs": 3})
        return [sys.executable, "-m", "videotrain", *args, f"hydra.run.dir={run_dir}"]

    def finish(run_dir: Path) -> None:
        done = subprocess.run(command(run_dir), cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env=os.environ.copy())
        assert done.returncode == 0, done.stderr[-3000:]

    run_a, run_b = tmp_path / "a", tmp_path / "b"
    finish(run_a)

    proc = subprocess.Popen(command(run_b), cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=os.environ.copy())
    ckpt = run_b / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert ckpt.exists() and not (run_b / "results.json").exists()

    finish(run_b)
    _assert_same_losses(_train_losses(metrics_rows(run_a)), _train_losses(metrics_rows(run_b)))
    assert len(_train_losses(metrics_rows(run_b))) == 12  # 3 epochs x 4 steps
    assert [p.name for p in run_b.glob("**/results.json")] == ["results.json"]
    a = json.loads((run_a / "results.json").read_text())
    b = json.loads((run_b / "results.json").read_text())
    for key in ("val_top1", "val_loss", "steps", "epochs"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key


# ------------------------------------------------------------------- recomputation in the loop


@pytest.fixture(scope="module")
def e2e_four_steps(run_overrides, compose_cfg, tmp_path_factory) -> list[tuple[int, float]]:
    out = tmp_path_factory.mktemp("e2e4")
    run.train(compose_cfg(run_overrides(trainer__max_steps=4)), out)
    return [(r["step"], r["train_loss"]) for r in map(json.loads, (out / "metrics.jsonl").open())
            if "train_loss" in r]


@pytest.mark.parametrize("policy", ["blocks", "sqrt", "optimal"])
def test_checkpoint_policies_log_e2e_losses(e2e_four_steps, run_overrides, compose_cfg, metrics_rows,
                                            tmp_path: Path, policy: str) -> None:
    """Four real training steps with recomputation log e2e's per-step train_loss."""
    cfg = compose_cfg(run_overrides(trainer__max_steps=4, memory="recompute", memory__policy=policy))
    run.train(cfg, tmp_path)
    got = _train_losses(metrics_rows(tmp_path))
    assert [s for s, _ in got] == [1, 2, 3, 4]
    for (step, want), (_, loss) in zip(e2e_four_steps, got, strict=True):
        assert abs(loss - want) <= 1e-4 * abs(want), f"step {step}: {loss} vs e2e {want}"


def test_a_run_in_channels_last_trains_validates_and_resumes(run_overrides, compose_cfg, metrics_rows,
                                                             tmp_path: Path) -> None:
    """trainer.channels_last=true forced on the CPU, with recomputation: the run trains,
    validates and checkpoints; its losses equal the NCHW run's to float tolerance, and the
    checkpoint's conv weights load back into an NHWC model."""
    extra = dict(trainer__max_epochs=1, memory="recompute", memory__policy="sqrt")
    nhwc = run.train(compose_cfg(run_overrides(trainer__channels_last="true", **extra)), tmp_path / "nhwc")
    nchw = run.train(compose_cfg(run_overrides(trainer__channels_last="false", **extra)), tmp_path / "nchw")
    a, b = _train_losses(metrics_rows(tmp_path / "nhwc")), _train_losses(metrics_rows(tmp_path / "nchw"))
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    for (_, la), (_, lb) in zip(a, b, strict=True):
        assert abs(la - lb) <= 1e-3 * abs(lb)
    assert nhwc["val_top1"] == pytest.approx(nchw["val_top1"])
    cfg = compose_cfg(run_overrides(trainer__channels_last="true", **extra))
    model = builder.build_model(cfg, num_classes=nhwc["num_classes"] if "num_classes" in nhwc
                                else len(nhwc["class_names"]))
    state = torch.load(tmp_path / "nhwc" / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    model.load_state_dict(state)
    conv = next(m for m in model.backbone.modules() if isinstance(m, nn.Conv2d))
    assert model.channels_last and conv.weight.is_contiguous(memory_format=torch.channels_last)
