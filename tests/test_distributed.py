"""DDP on the CPU (gloo) through torchrun: the CLI on two ranks, exact resume (after a crash
and after a SIGTERM to one rank), the world-size policy on resume, every strategy.

Each test starts one ``torchrun --standalone --nproc_per_node=2`` (the process start-up is most
of the cost), on the tiny session dataset with a tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import videotrain.run as run
from videotrain.engine.distributed import DistContext

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def torchrun(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([*TORCHRUN, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]


def test_torchrun_two_ranks_cli(tiny_synthetic_overrides, shrink_overrides, tiny_model_overrides,
                                tmp_path: Path) -> None:
    args = [*tiny_synthetic_overrides, *shrink_overrides, *tiny_model_overrides,
            "data.batch_size=2", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
            "optim.lr_scaling=linear", "optim.base_batch_size=2"]
    done = torchrun(["-m", "videotrain", *args], cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    # one run directory (the ranks agreed on its timestamp), written by rank 0 alone
    assert len(list(tmp_path.glob("outputs/*/*"))) == 1, list(tmp_path.rglob("*"))
    found = list(tmp_path.rglob("results.json"))
    assert len(found) == 1, found
    run_dir = found[0].parent
    assert len(list(tmp_path.rglob("metrics.jsonl"))) == 1
    assert len(list(tmp_path.rglob("last.ckpt"))) == 1
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / "config.yaml").exists()

    results = json.loads(found[0].read_text())
    assert results["world_size"] == 2 and results["steps"] == 2
    assert results["batch_size_per_process"] == 2 and results["global_batch_size"] == 4
    assert results["lr"] == pytest.approx(2e-3)  # adamw's 1e-3 x 4 / 2, as configured
    # after the steps, both replicas hold bit-identical parameters
    digests = results["param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1] and results["replicas_in_sync"]
    assert results["val_videos"] == 8  # every val video counted once over the two shards
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows if "train_loss" in r] == [1, 2]
    assert [r["step"] for r in rows if "val_top1" in r] == [2]


# SBP (frame level, BN full-batch policy) on the BN backbone, with head dropout so that the
# global RNG matters too; 16 videos / (2 per rank x 2 ranks) = 4 steps, checkpoints every 2.
DDP_RUN = ["trainer.max_epochs=1", "trainer.checkpoint_every_n_steps=2", "data.batch_size=2",
           "trainer.log_every_n_steps=1"]
SBP = ["model/backbone=resnet10", "model.backbone.temporal_shift=0", "memory=sbp", "memory.keep_ratio=0.5",
       "model.head.dropout=0.5"]
STRATEGIES = {
    "frame_dropout": ["memory=frame_dropout", "memory.keep_ratio=0.5", "trainer.max_steps=2"],
    "sbp_shift": ["model/backbone=resnet10", "memory=sbp", "trainer.max_steps=2"],  # lockstep, shifted
    "recompute": ["memory=recompute", "trainer.max_steps=2"],
    "e2e_accum": ["trainer.grad_accum=2", "data.batch_size=1", "trainer.max_steps=2"],
}


def test_ddp_resume_and_every_strategy(run_overrides, compose_cfg, tmp_path: Path) -> None:
    spec = {"out": str(tmp_path), "overrides": [*run_overrides(), *DDP_RUN],
            "sbp_overrides": SBP, "crash_at_step": 3, "strategies": STRATEGIES}
    done = torchrun([str(ROOT / "tests" / "ddp_worker.py"), json.dumps(spec)], cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    checks = json.loads((tmp_path / "checks.json").read_text())
    assert checks["crashed_ckpt"]
    assert checks["reduced"] == {"mean": {"x": 0.5, "only_rank1": 3.0, "none": None},
                                 "max": {"x": 1.0, "only_rank1": 3.0, "none": None}}

    # the crashed-then-resumed run repeats the uninterrupted one step for step
    a, b = read_rows(tmp_path / "sbp_a"), read_rows(tmp_path / "sbp_b")
    loss_a = [(r["step"], r["train_loss"]) for r in a if "train_loss" in r]
    loss_b = [(r["step"], r["train_loss"]) for r in b if "train_loss" in r]
    assert [s for s, _ in loss_a] == [s for s, _ in loss_b] == [1, 2, 3, 4]
    for (step, la), (_, lb) in zip(loss_a, loss_b, strict=True):
        assert abs(la - lb) <= 1e-5 * abs(la), f"step {step}: {la} vs {lb}"
    res_a = json.loads((tmp_path / "sbp_a" / "results.json").read_text())
    res_b = json.loads((tmp_path / "sbp_b" / "results.json").read_text())
    for key in ("val_top1", "val_loss", "steps"):
        assert res_b[key] == pytest.approx(res_a[key], rel=1e-5), key
    assert res_a["param_digests"] == res_b["param_digests"]  # the very same weights

    # a SIGTERM to rank 1 alone: both ranks stopped after the same step, then resumed exactly
    assert checks["preempted"] == [3, 3]
    c = read_rows(tmp_path / "sbp_c")
    assert [(r["step"], r["train_loss"]) for r in c if "train_loss" in r] == loss_a
    res_c = json.loads((tmp_path / "sbp_c" / "results.json").read_text())
    assert res_c["param_digests"] == res_a["param_digests"]

    # the world-size policy on files written by two ranks: one process may not resume them
    base = [*run_overrides(), *DDP_RUN]
    sbp_cfg = compose_cfg([o for o in base if not o.startswith(("model/backbone=", "model.backbone."))]
                          + SBP)
    from videotrain.engine.checkpoints.run import ResumeRefused

    with pytest.raises(ResumeRefused, match=r"world_size \(DDP processes\): 2 -> 1"):
        run.train(sbp_cfg, tmp_path / "sbp_a")  # an epoch-end checkpoint: like a config change
    (tmp_path / "sbp_a" / "checkpoints" / "step-00000004.ckpt").unlink()  # newest: mid-epoch
    sbp_cfg.trainer.resume = "force"
    with pytest.raises(ResumeRefused, match=r"written mid-epoch by 2 process\(es\), and this run has 1"):
        run.train(sbp_cfg, tmp_path / "sbp_a")

    # masks: the rank enters the seed (ranks differ), and the resumed stream is the same
    runs = checks["runs"]
    for name in ("sbp_a", "sbp_b", "frame_dropout", "sbp_shift"):
        probe = runs[name]
        assert [p["sampler_rank"] for p in probe] == [0, 1], name
    assert runs["sbp_a"][0]["last_keep"] != runs["sbp_a"][1]["last_keep"]
    assert runs["frame_dropout"][0]["last_keep"] != runs["frame_dropout"][1]["last_keep"]
    assert [p["last_keep"] for p in runs["sbp_a"]] == [p["last_keep"] for p in runs["sbp_b"]]

    # every strategy trains under DDP and keeps the replicas identical
    for name in ("sbp_a", "sbp_b", *STRATEGIES):
        res = json.loads((tmp_path / name / "results.json").read_text())
        assert res["replicas_in_sync"] and len(set(res["param_digests"])) == 1, name
        assert res["world_size"] == 2, name
    accum = json.loads((tmp_path / "e2e_accum" / "results.json").read_text())
    assert accum["global_batch_size"] == 4 and accum["steps"] == 2


COMPILED = {
    "e2e": [],
    "sbp": ["model/backbone=resnet10", "model.backbone.temporal_shift=0", "memory=sbp"],
    "recompute": ["memory=recompute"],
}


def test_ddp_compiled_compiles_once_and_trains_as_eager(run_overrides, tmp_path: Path) -> None:
    """trainer.compile=true on two ranks: no rank compiles anything after its first step, the
    losses are eager's and the replicas stay identical."""
    spec = {"out": str(tmp_path), "overrides": [*run_overrides(), *DDP_RUN], "strategies": COMPILED}
    done = torchrun([str(ROOT / "tests" / "ddp_compile_worker.py"), json.dumps(spec)], cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    counts = json.loads((tmp_path / "compile.json").read_text())
    for name in COMPILED:
        for rank_counts in counts[f"{name}_compiled"]:
            assert len(rank_counts) == 4 and rank_counts[0] > 0, (name, rank_counts)
            assert rank_counts[-1] == rank_counts[0], (name, rank_counts)  # 0 recompiles
        assert all(c == [0] * 4 for c in counts[f"{name}_eager"]), name
        eager, compiled = (read_rows(tmp_path / f"{name}_{mode}") for mode in ("eager", "compiled"))
        losses = [[r["train_loss"] for r in rows if "train_loss" in r] for rows in (eager, compiled)]
        assert losses[1] == pytest.approx(losses[0], rel=1e-4), name
        res = json.loads((tmp_path / f"{name}_compiled" / "results.json").read_text())
        assert res["replicas_in_sync"] and res["world_size"] == 2, name


# ------------------------------------------------------------------- single-process checks


def test_launch_time_is_shared_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import datetime

    from videotrain.engine import distributed

    stamp = datetime(2024, 5, 6, 7, 8, 9).timestamp()
    monkeypatch.setenv(distributed.LAUNCH_TIME_ENV, repr(stamp))
    assert distributed.launch_time("%Y-%m-%d/%H-%M-%S") == "2024-05-06/07-08-09"
    monkeypatch.delenv(distributed.LAUNCH_TIME_ENV)
    assert distributed.share_launch_time(DistContext()) == pytest.approx(
        datetime.now().timestamp(), abs=60)  # one process: its own clock, exported
    assert os.environ[distributed.LAUNCH_TIME_ENV]


def test_worker_ranks_write_no_hydra_files() -> None:
    from videotrain.__main__ import worker_overrides

    assert worker_overrides(["memory=sbp"]) == [
        "hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.job_logging.root.level=WARNING"]
    assert worker_overrides(["hydra.output_subdir=.h", "hydra/job_logging=none"]) == []


def test_single_process_comm_is_the_identity() -> None:
    from videotrain.engine.distributed import Comm

    comm = Comm()
    assert comm.is_main and comm.world_size == 1 and not comm.active
    assert comm.reduce({"a": 1.0, "b": None}, "max") == {"a": 1.0, "b": None}
    assert comm.all_gather({"x": 1}) == [{"x": 1}] and comm.broadcast(3) == 3
    with pytest.raises(ValueError, match="op must be"):
        comm.reduce({}, "sum")


def test_lr_scaling_is_explicit() -> None:
    from videotrain.engine.optim import scaled_lr

    assert scaled_lr(0.1, "none", None, 64) == 0.1
    assert scaled_lr(0.1, "linear", 16, 64) == pytest.approx(0.4)
    assert scaled_lr(0.1, "sqrt", 16, 64) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="optim.lr_scaling must be one of"):
        scaled_lr(0.1, "quadratic", 16, 64)
    with pytest.raises(ValueError, match="optim.base_batch_size must be a positive integer"):
        scaled_lr(0.1, "linear", 0, 64)


def test_val_shards_are_not_padded() -> None:
    from videotrain.data.loaders import ResumableSampler

    data = list(range(5))
    shards = [[k.index for k in ResumableSampler(data, shuffle=False, seed=0, rank=r, world_size=2,
                                                 pad=False)] for r in range(2)]
    assert shards == [[0, 2, 4], [1, 3]]  # DistributedSampler would repeat item 0 on rank 1
    with pytest.raises(ValueError, match="pad=False"):
        ResumableSampler(data, shuffle=True, seed=0, pad=False)


def test_sync_bn_choices(compose_cfg) -> None:
    import torch
    from torch import nn

    import videotrain.config.build as builder

    cfg = compose_cfg(["model/backbone=resnet10", "trainer.sync_bn=true"])
    two = DistContext(rank=0, world_size=2)
    with pytest.raises(ValueError, match="trainer.sync_bn=true needs CUDA"):
        builder.use_sync_bn(cfg, two, torch.device("cpu"))
    assert builder.use_sync_bn(cfg, DistContext(), torch.device("cpu")) is False  # one process
    model = builder.build_model(cfg, num_classes=4, sync_bn=True)
    kinds = {type(m) for m in model.modules()}
    assert nn.SyncBatchNorm in kinds and nn.BatchNorm2d not in kinds
    sbp = compose_cfg(["model/backbone=resnet10", "memory=sbp"])
    with pytest.raises(ValueError, match="trainer.sync_bn=true does not combine with"):
        builder.build_model(sbp, num_classes=4, sync_bn=True)


def test_device_under_ddp_names_the_key() -> None:
    import videotrain.config.build as builder

    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        builder.resolve_device("tpu")
    assert builder.resolve_device("cpu", DistContext(rank=1, world_size=2)).type == "cpu"


def test_ddp_sharded_test_after_fit_and_a_hung_rank(run_overrides, compose_cfg, tmp_path: Path) -> None:
    """Under torchrun, trainer.test_after_fit runs the multi-view test sharded over the ranks
    (the same figures as one process); a rank whose decoding hangs fails every rank within
    data.worker_timeout plus the collective margin, naming it (tests/ddp_cluster_worker.py)."""
    base = [*run_overrides(), "data.batch_size=2", "trainer.max_steps=2"]
    sharded = ["trainer.test_after_fit=true", "eval.clips=2", "eval.crops=1"]
    timeout = 4
    spec = {"out": str(tmp_path), "overrides": base, "sharded": sharded, "hang_s": 60,
            "hung": ["data.num_workers=1", f"data.worker_timeout={timeout}"]}
    done = torchrun([str(ROOT / "tests" / "ddp_cluster_worker.py"), json.dumps(spec)], cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    tests = [json.loads((tmp_path / f"sharded_rank{r}.json").read_text()) for r in (0, 1)]
    assert tests[0] == tests[1]  # reduced: every rank has the whole test's figures
    assert (tmp_path / "sharded" / "eval.json").exists()
    from videotrain.eval import evaluate_checkpoint

    ckpt = tmp_path / "sharded" / "checkpoints" / "last.ckpt"
    single = evaluate_checkpoint(compose_cfg([*base, *sharded, f"checkpoint={ckpt}"]), tmp_path / "one")
    assert tests[0]["videos"] == single["videos"] > 0  # every video once over the two shards
    for key in ("video_top1", "video_top5", "clip_top1", "mean_class_acc"):
        assert tests[0][key] == pytest.approx(single[key], abs=1e-6), key

    hung = [json.loads((tmp_path / f"hung_rank{r}.json").read_text()) for r in (0, 1)]
    for r, got in enumerate(hung):
        assert got["error"] and "rank 1" in got["error"], (r, got)
        assert got["seconds"] < timeout + 10 + 30, (r, got)  # timeout + margin + start-up
    assert "data.worker_timeout" in hung[1]["error"]


@pytest.mark.slow  # one torchrun with two ranks (~30 s)
def test_torchrun_data_error_is_one_error_line(run_overrides, tiny_copy: Path, tmp_path: Path) -> None:
    """Under torchrun, a data error is one line: rank 0's preflight finds too many missing videos; every
    rank raises it, rank 0 alone prints it as one `error:` line and the first rank to exit does
    so with status 2, no traceback of ours (torchrun itself then stops the other ranks, prints
    its report of their exit codes and exits 1)."""
    for video in sorted((tiny_copy / "train").rglob("*.mp4"))[:6]:
        video.unlink()
    args = [*run_overrides(root=tiny_copy), "data.batch_size=2", f"hydra.run.dir={tmp_path / 'run'}"]
    done = torchrun(["-m", "videotrain", *args], cwd=tmp_path)
    assert done.returncode != 0
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, done.stderr[-4000:]
    assert errors[0].startswith(f"error: BadDataError: {tiny_copy / 'train.csv'}: 6 of 16 videos")
    # the first rank to exit does so with status 2 (torchrun then stops the other, SIGTERM)
    root_cause = done.stderr.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root_cause, done.stderr[-4000:]
    assert f'File "{ROOT / "videotrain"}' not in done.stderr


def test_a_peers_data_error_stays_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 stopped in a collective because rank 1 failed on its share of the data: rank 0's
    error names rank 1's and is still a user error (one `error:` line, exit status 2); a peer's
    crash stays a RuntimeError (a traceback)."""
    from videotrain.config.build import user_error
    from videotrain.engine import distributed

    peers = {1: "rank 1: BadDataError: train split: 3 of 8 videos are unreadable"}
    monkeypatch.setattr(distributed, "report_failure", lambda *a, **k: None)
    monkeypatch.setattr(distributed, "failed_peers", lambda ws, me, user=False: dict(peers))
    ctx = DistContext(rank=0, world_size=2)
    err = run.name_the_rank(RuntimeError("Connection closed by peer"), ctx, 600.0)
    assert isinstance(err, run.PeerDataError) and user_error(err) is err
    assert str(err).startswith(f"rank 0 stopped because rank 1 failed ({peers[1]})")
    monkeypatch.setattr(distributed, "failed_peers",
                        lambda ws, me, user=False: {} if user else dict(peers))
    err = run.name_the_rank(RuntimeError("Connection closed by peer"), ctx, 600.0)
    assert type(err) is RuntimeError and user_error(err) is None
