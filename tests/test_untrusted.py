"""``videotrain.untrusted``: values shown escaped and cut, and a run folder's files read and
written as what they are (no link followed, no FIFO waited on, no hard link appended to)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

from videotrain.untrusted import (
    UnsafeFileError,
    UnsafeRunFolder,
    check_run_folder,
    open_append,
    plain_tree_problem,
    quoted,
    read_text,
    shown,
    write_text,
)
from videotrain.untrusted.files import list_folder, point
from videotrain.untrusted.run_folder import RunFolderCheck, RunLogFile


def test_shown_keeps_plain_values_and_escapes_the_rest() -> None:
    assert shown("resnet10") == "resnet10" and shown(0.001) == "0.001" and shown(None) == "None"
    assert shown("a\nb") == "'a\\nb'" and shown("\x1b]52;c;x\x07") == "'\\x1b]52;c;x\\x07'"
    assert shown("\u202eevil") == "'\\u202eevil'" and shown("x\u2028y") == "'x\\u2028y'"
    long = shown("y" * 10_000)
    assert long.startswith("y" * 100) and long.endswith("...(10000 chars)") and len(long) < 130
    path = Path("/" + "d/" * 300)  # a path is shown whole up to PATH_CHARS, not cut at 100
    assert quoted("a") == "'a'" and shown(path) == str(path)


def test_shown_is_bounded_on_a_shared_reference_bomb() -> None:
    node: list = ["x"] * 9
    for _ in range(8):
        node = [node] * 9
    start = time.monotonic()
    assert len(shown(node)) <= 120 and time.monotonic() - start < 1
    assert "shared reference" in (plain_tree_problem({"a": node}) or "")
    assert plain_tree_problem({"a": [1, "b", {"c": None}]}) is None
    deep: dict = {}
    for _ in range(40):
        deep = {"k": deep}
    assert "nested" in (plain_tree_problem(deep) or "")


def test_write_text_replaces_a_link_and_leaves_its_target(tmp_path: Path) -> None:
    target, link = tmp_path / "bashrc", tmp_path / "run" / "results.json"
    target.write_text("mine\n")
    link.parent.mkdir()
    link.symlink_to(target)
    write_text(link, "{}\n")
    assert target.read_text() == "mine\n" and not link.is_symlink() and link.read_text() == "{}\n"
    assert [p.name for p in link.parent.iterdir()] == ["results.json"]  # no temporary left


def test_open_append_refuses_links_fifos_and_hard_links(tmp_path: Path) -> None:
    target = tmp_path / "authorized_keys"
    target.write_text("ssh-ed25519 mine\n")
    (tmp_path / "link.jsonl").symlink_to(target)
    os.mkfifo(tmp_path / "fifo.jsonl")
    os.link(target, tmp_path / "hard.jsonl")
    for name in ("link.jsonl", "fifo.jsonl", "hard.jsonl"):
        start = time.monotonic()
        with pytest.raises(UnsafeFileError):
            open_append(tmp_path / name)
        assert time.monotonic() - start < 1
    assert target.read_text() == "ssh-ed25519 mine\n"
    with open_append(tmp_path / "metrics.jsonl") as f:
        f.write("{}\n")
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


def test_read_text_refuses_links_fifos_and_large_files(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("password\n")
    (tmp_path / "config.yaml").symlink_to(tmp_path / "secret")
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "big.yaml").write_text("x" * 2000)
    for name, why in (("config.yaml", "symbolic link"), ("fifo.yaml", "FIFO"), ("big.yaml", "2000 bytes")):
        with pytest.raises(UnsafeFileError, match=why) as err:
            read_text(tmp_path / name, 1000)
        assert "password" not in str(err.value)
    assert read_text(tmp_path / "secret", 1000) == "password\n"


# ---------------------------------------------------------------------- run folders: fail closed
def _wandb_run_folder(run: Path) -> Path:
    """``run/wandb`` as wandb leaves it (its own links included: ``debug-core.log`` points into
    wandb's cache, outside the run)."""
    wandb_run = run / "wandb" / "offline-run-20260101_000000-abc123"
    (wandb_run / "logs").mkdir(parents=True)
    (wandb_run / "logs" / "debug.log").write_text("log\n")
    (wandb_run / "logs" / "debug-core.log").symlink_to("/nonexistent/.cache/wandb/core.log")
    (run / "wandb" / "latest-run").symlink_to(wandb_run.name)
    (run / "wandb" / "debug.log").symlink_to(f"{wandb_run.name}/logs/debug.log")
    (run / "wandb" / "debug-internal.log").symlink_to(f"{wandb_run.name}/logs/debug-internal.log")
    return wandb_run


def test_wandbs_own_links_pass_and_nothing_else_in_wandb_does(tmp_path: Path) -> None:
    """wandb's links (replaced by wandb, never written through) pass; a link at any other name
    inside ``wandb/``, a FIFO there, or ``wandb`` itself as a link is refused."""
    run = tmp_path / "run"
    wandb_run = _wandb_run_folder(run)
    check_run_folder(run)  # the run can be resumed with the same command
    (wandb_run / "files").mkdir()
    (wandb_run / "files" / "output.log").symlink_to(tmp_path / "bashrc")
    os.mkfifo(wandb_run / "run-abc123.wandb")
    with pytest.raises(UnsafeRunFolder) as err:
        check_run_folder(run)
    assert "files/output.log (a symbolic link" in str(err.value) and "(a FIFO)" in str(err.value)
    other = tmp_path / "other"
    _wandb_run_folder(other)
    shutil.rmtree(other / "wandb" / "offline-run-20260101_000000-abc123")
    os.rename(other / "wandb", tmp_path / "elsewhere")
    (other / "wandb").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeRunFolder, match=r"wandb \(a symbolic link"):
        check_run_folder(other)


def test_a_multiruns_jobs_keep_wandbs_links_and_nothing_else(tmp_path: Path) -> None:
    """A sweep folder (``hydra.sweep.dir``) checked as one: each job's ``wandb/`` links pass
    (the summary script reads such folders), a link elsewhere in a job does not."""
    sweep = tmp_path / "sweep"
    for job in ("0_keep=0.5", "1_keep=1.0"):
        _wandb_run_folder(sweep / job)
    check_run_folder(sweep, "read from")
    (sweep / "0_keep=0.5" / "debug.log").symlink_to(tmp_path / "bashrc")  # not in wandb/
    with pytest.raises(UnsafeRunFolder, match=r"0_keep=0.5/debug.log \(a symbolic link"):
        check_run_folder(sweep, "read from")


@pytest.mark.parametrize("target", ["checkpoints.other", "last-but-one.ckpt"])
def test_only_last_ckpt_may_be_a_link_and_only_to_a_file(target: str, tmp_path: Path) -> None:
    """``last.ckpt -> step-N.ckpt`` is the one link videotrain makes. A link at another name
    (even to a file beside it), or ``last.ckpt`` to a folder, is refused."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001.ckpt").write_bytes(b"x")
    (run / "checkpoints" / "last.ckpt").symlink_to("step-00000001.ckpt")
    check_run_folder(run)
    (run / "checkpoints.other").mkdir()
    (run / "checkpoints" / target).symlink_to("step-00000001.ckpt")
    (run / "last.ckpt").symlink_to("checkpoints.other")  # a folder beside it
    with pytest.raises(UnsafeRunFolder) as err:
        check_run_folder(run)
    assert f"checkpoints/{target} (a symbolic link" in str(err.value)
    assert "last.ckpt (a symbolic link to checkpoints.other, a folder)" in str(err.value)


def test_a_run_folder_that_is_a_link_is_refused(tmp_path: Path) -> None:
    """``hydra.run.dir=SHARED/run`` where ``run`` links to another run: refused by the check
    and by the writer (which opens the run folder itself with ``O_NOFOLLOW``)."""
    victim = tmp_path / "victim-run"
    victim.mkdir()
    (victim / "config.yaml").write_text("mine\n")
    link = tmp_path / "run"
    link.symlink_to(victim)
    with pytest.raises(UnsafeRunFolder, match="is a symbolic link"):
        check_run_folder(link)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        write_text(link / "config.yaml", "theirs\n", root=link)
    with pytest.raises(UnsafeFileError):
        open_append(link / "videotrain.log", root=link)
    assert sorted(p.name for p in victim.iterdir()) == ["config.yaml"]
    assert (victim / "config.yaml").read_text() == "mine\n"


def test_point_and_list_folder_follow_no_link(tmp_path: Path) -> None:
    """``point`` (last.ckpt, best.ckpt) replaces what stands at the name, never writes through
    it; below a run folder, a linked folder is neither listed nor written into."""
    run, victim = tmp_path / "run", tmp_path / "victim"
    (run / "checkpoints").mkdir(parents=True)
    victim.mkdir()
    (victim / "authorized_keys").write_text("mine\n")
    (run / "checkpoints" / "step-00000002.ckpt").write_bytes(b"new")
    (run / "checkpoints" / "last.ckpt").symlink_to(victim / "authorized_keys")
    (run / "checkpoints" / "best.ckpt").symlink_to(victim / "authorized_keys")
    point(run / "checkpoints" / "last.ckpt", "step-00000002.ckpt", root=run)
    point(run / "checkpoints" / "best.ckpt", "step-00000002.ckpt", root=run, symbolic=False)
    assert os.readlink(run / "checkpoints" / "last.ckpt") == "step-00000002.ckpt"
    best = run / "checkpoints" / "best.ckpt"
    assert not best.is_symlink() and os.path.samefile(best, run / "checkpoints" / "step-00000002.ckpt")
    assert (victim / "authorized_keys").read_text() == "mine\n"
    with pytest.raises(UnsafeFileError):
        point(run / "checkpoints" / "last.ckpt", "../../victim/authorized_keys", root=run)
    (run / "linked").symlink_to(victim)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        list_folder(run / "linked", root=run)
    assert list_folder(run / "missing", root=run) == []
    assert sorted(list_folder(run / "checkpoints", root=run)) == [
        "best.ckpt", "last.ckpt", "step-00000002.ckpt"]


def test_the_log_handler_appends_through_no_link(tmp_path: Path) -> None:
    """Hydra's job log file (``RunLogFile``, configs/hydra/job_logging/run_folder.yaml): a
    link at its name is refused; a fresh log file is appended to."""
    run, victim = tmp_path / "run", tmp_path / ".bashrc"
    run.mkdir()
    victim.write_text("# mine\n")
    (run / "videotrain.log").symlink_to(victim)
    with pytest.raises(UnsafeFileError):
        RunLogFile(str(run / "videotrain.log"), root=str(run))
    assert victim.read_text() == "# mine\n"
    (run / "videotrain.log").unlink()
    handler = RunLogFile(str(run / "videotrain.log"), root=str(run))
    handler.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None))
    handler.close()
    assert (run / "videotrain.log").read_text() == "hello\n"


def _hydra_job_config(out: Path, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict, read_write

    import videotrain.config.build

    with initialize_config_dir(config_dir=videotrain.config.build.CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.runtime.output_dir = str(out)
    return cfg


def test_hydra_files_are_written_by_the_callback_and_replace_a_link(tmp_path: Path) -> None:
    """``.hydra/`` comes from the callback through the one writer (Hydra's own plain writes are
    off: ``hydra.output_subdir: null``): a link planted at ``.hydra/config.yaml`` is replaced,
    the file behind it unchanged; the three files hold what Hydra wrote. The user's own
    ``hydra.output_subdir=X`` moves them, ``=null`` (DDP ranks other than 0) writes none."""
    out, victim = tmp_path / "run", tmp_path / "bashrc"
    victim.write_text("# mine\n")
    (out / ".hydra").mkdir(parents=True)
    (out / ".hydra" / "config.yaml").symlink_to(victim)
    cfg = _hydra_job_config(out, ["seed=3"])
    assert cfg.hydra.output_subdir is None
    callback = RunFolderCheck()
    callback.on_run_start(cfg)
    callback.on_job_start(cfg)
    assert victim.read_text() == "# mine\n" and not (out / ".hydra" / "config.yaml").is_symlink()
    assert yaml.safe_load((out / ".hydra" / "config.yaml").read_text())["seed"] == 3
    assert yaml.safe_load((out / ".hydra" / "overrides.yaml").read_text()) == ["seed=3"]
    saved = yaml.safe_load((out / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert saved["output_subdir"] == ".hydra" and saved["runtime"]["output_dir"] == str(out)
    for given, where in (("hydra.output_subdir=meta", "meta"), ("hydra.output_subdir=null", None)):
        other = tmp_path / given.split("=")[1]
        other.mkdir()  # Hydra makes the job's folder before it calls on_job_start
        cfg = _hydra_job_config(other, ["seed=3", given])
        callback = RunFolderCheck()
        callback.on_run_start(cfg)
        assert cfg.hydra.output_subdir is None  # Hydra itself writes nothing
        callback.on_job_start(cfg)
        assert sorted(p.name for p in other.iterdir()) == ([where] if where else [])
        if where:
            saved = yaml.safe_load((other / where / "hydra.yaml").read_text())["hydra"]
            assert saved["output_subdir"] == "meta" and given in saved["overrides"]["hydra"]
