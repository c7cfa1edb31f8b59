"""Attacks through shared files: a run folder, a checkpoint, a config or an annotation file that a
stranger shares, against resume (``python -m videotrain hydra.run.dir=SHARED``), ``eval``,
``predict`` and ``export``. Every case carries a harmless payload (a marker file that must not
appear, a file outside the run that must not change, a secret whose text must not be shown) and
ends with exit status 2 and one ``error:`` line within seconds, or succeeds where the input is a
legitimate one. Cases where a hang or memory growth is what went wrong run the command in a
fresh process (``_child``: a wall-clock bound and the child's peak RSS over a bare import of the
commands); the others run the commands' entry points in this process.

docs/cluster.md's threat-model table ("A shared run folder is untrusted input") lists these.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

import videotrain.run as run
from videotrain.config.build import clean_errors, validate
from videotrain.engine.checkpoints import format as ckpt
from videotrain.eval import run_eval
from videotrain.export import export
from videotrain.predict import predict

SECRET = "hunter2-SECRET-d41d8cd9"  # must never appear in any output or log
KEY_TEXT = ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA" + SECRET
            + "\n-----END OPENSSH PRIVATE KEY-----\n")
NETRC_TEXT = f"machine example.org login me password {SECRET}\n"
FAST_S = 10  # an attack case ends within this many seconds (in this process)
CHILD_S = 60  # a fresh interpreter's bound (imports torch: ~5 s on the 2-core CPU)
GROWTH_MB = 500  # a child's peak RSS over a bare import of the commands


# ---------------------------------------------------------------------- fixtures and helpers
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, run_overrides, compose_cfg) -> Path:
    """One tiny trained run (1 step): every case works on a copy of it."""
    run_dir = tmp_path_factory.mktemp("shared") / "run"
    run.train(compose_cfg(run_overrides(trainer__max_steps=1)), run_dir)
    return run_dir


@pytest.fixture
def shared(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run as a stranger shares it (links copied as links)."""
    dst = tmp_path / "shared"
    shutil.copytree(trained, dst, symlinks=True)
    return dst


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the run holding the user's files, which must not change."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text(KEY_TEXT)
    (home / ".netrc").write_text(NETRC_TEXT)
    (home / ".bashrc").write_text("# the user's bashrc\n")
    (home / "site-packages").mkdir()
    return home


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def _last(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.ckpt"


def _command(name: str, checkpoint: Path, tiny_root: Path, out: Path) -> list[str]:
    video = tiny_root / "val" / "right_then_up" / "right_then_up_0000.mp4"
    extra = {"eval": ["eval.clips=1", "eval.crops=1"], "predict": [f"video={video}"],
             "export": ["export.format=torch_export", f"export.out={out / 'model.pt2'}",
                        "export.check=false"]}[name]
    return [f"checkpoint={checkpoint}", *extra, "trainer.progress=false", "device=cpu"]


def _in_process(name: str, overrides: list[str], out: Path, compose_cfg,
                capsys: pytest.CaptureFixture) -> tuple[int, list[str], str]:
    """A command's entry point as its ``main`` runs it (``clean_errors``): exit status, the
    ``error:`` lines, and all it printed."""
    start = time.monotonic()
    code = 0
    try:
        with clean_errors():
            cfg = validate(compose_cfg(overrides))
            if name == "eval":
                run_eval(cfg, overrides, out)
            elif name == "predict":
                predict(cfg, overrides)
            elif name == "export":
                export(cfg, overrides, out)
            else:  # resume: python -m videotrain in the shared folder
                run.train(cfg, out)
    except SystemExit as done:
        code = int(done.code)
    assert time.monotonic() - start < FAST_S + 30, "a case must end within seconds"
    captured = capsys.readouterr()
    text = captured.out + captured.err
    return code, [ln for ln in captured.err.splitlines() if ln.startswith("error:")], text


def _refused(code: int, errors: list[str], text: str, *names: str) -> str:
    """Exit status 2, one ``error:`` line naming ``names``, and no secret anywhere."""
    assert code == 2, text[-2000:]
    assert len(errors) == 1, text[-2000:]
    for name in names:
        assert name in errors[0], errors[0]
    assert SECRET not in text and "\x1b" not in text
    return errors[0]


WRAPPER = ("import os, subprocess, sys\n"
           "p = subprocess.Popen(sys.argv[1:])\n"
           "_, status, ru = os.wait4(p.pid, 0)\n"
           "print(f'CHILD-PEAK-KB {ru.ru_maxrss}', file=sys.stderr)\n"
           "sys.exit(os.waitstatus_to_exitcode(status))\n")


def _wrapped(args: list[str], cwd: Path,
             prefix: tuple[str, ...] = ()) -> tuple[int, str, float, float]:
    """``python ARGS`` in a fresh process (run by ``prefix``: :func:`_privileges`), through a
    wrapper that reports the child's own peak RSS (``os.wait4``): exit status, all output, wall
    seconds, peak MB. Killed at ``CHILD_S``."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, *prefix, sys.executable, *args], cwd=cwd,
                            env=os.environ.copy(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=CHILD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the wrapper and the command it runs
        out, err = proc.communicate()
        pytest.fail(f"{args} still ran after {CHILD_S} s (killed): {err[-2000:]}")
    text = out + err
    peak = int(text.rsplit("CHILD-PEAK-KB ", 1)[1].split()[0]) / 1024
    return proc.returncode, text, time.monotonic() - start, peak


@pytest.fixture(scope="module")
def import_rss_mb(tmp_path_factory: pytest.TempPathFactory) -> float:
    """The peak RSS of a fresh interpreter that imports the commands (torch, torchvision, ...:
    about 840 MB here): the baseline a child's memory is measured against."""
    code, text, _, peak = _wrapped(["-c", "import videotrain.eval, videotrain.predict, "
                                    "videotrain.export, videotrain.__main__"],
                                   tmp_path_factory.mktemp("baseline"))
    assert code == 0, text[-2000:]
    return peak


def _child(module: str, args: list[str], cwd: Path, import_rss_mb: float,
           prefix: tuple[str, ...] = ()) -> tuple[str, str]:
    """``python -m MODULE ARGS`` in a fresh process: exit 2 within ``CHILD_S``, one ``error:``
    line, a peak RSS under ``import_rss_mb + GROWTH_MB``, no secret and no terminal escape in
    its output. Returns (the error line, all output)."""
    code, text, wall, peak = _wrapped(["-m", module, *args], cwd, prefix)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, text[-3000:]
    assert wall < CHILD_S and peak < import_rss_mb + GROWTH_MB, (wall, peak, import_rss_mb)
    assert SECRET not in text and "\x1b" not in text
    return errors[0], text


def _rewrite_checkpoint(path: Path, edit: Callable[[dict], None]) -> None:
    """Load ``path`` (following last.ckpt's link), ``edit`` it, save it back as a plain file."""
    blob = ckpt.load(path)
    edit(blob)
    path.unlink()
    torch.save(blob, path)


# ---------------------------------------------------------------------- high: writes through links
LINKED = ["config.yaml", "results.json", "metrics.jsonl", "videotrain.log", ".hydra"]


@pytest.mark.parametrize("name", LINKED)
def test_resume_does_not_write_through_a_link(name: str, shared: Path, outside: Path,
                                              run_overrides, compose_cfg,
                                              capsys: pytest.CaptureFixture) -> None:
    """A shared folder whose files are links to the user's files: resume refuses it, naming the
    link, and the files behind stay as they were (nothing appended, truncated or overwritten)."""
    target = outside / ".hydra-dir" if name == ".hydra" else outside / ".bashrc"
    if name == ".hydra":
        target.mkdir()
        shutil.rmtree(shared / ".hydra", ignore_errors=True)
    else:
        (shared / name).unlink(missing_ok=True)
    (shared / name).symlink_to(target)
    before = _snapshot(outside)
    code, errors, text = _in_process("resume", run_overrides(trainer__max_steps=2), shared,
                                     compose_cfg, capsys)
    line = _refused(code, errors, text, name, "symbolic link")
    assert "nothing was read or written" in line
    assert _snapshot(outside) == before
    if name == ".hydra":
        assert not any(target.iterdir())


@pytest.mark.parametrize("name", ["videotrain.log", ".hydra"])
def test_hydra_writes_nothing_through_a_link(name: str, shared: Path, outside: Path,
                                             run_overrides, import_rss_mb: float) -> None:
    """What Hydra itself writes (its log file, ``.hydra/``) before videotrain's code runs: the
    run-folder callback refuses the folder first. The log linked to a ``.pth`` file in the
    user's site-packages (which Python runs at start-up) is never created."""
    pth = outside / "site-packages" / "evil.pth"
    if name == ".hydra":
        shutil.rmtree(shared / ".hydra", ignore_errors=True)
        (shared / name).symlink_to(outside / "site-packages")
    else:
        (shared / name).unlink(missing_ok=True)
        (shared / name).symlink_to(pth)
    before = _snapshot(outside)
    line, _ = _child("videotrain", [*run_overrides(trainer__max_steps=2),
                                    f"hydra.run.dir={shared}"], outside, import_rss_mb)
    assert name in line and "symbolic link" in line
    assert not pth.exists() and _snapshot(outside) == before
    assert not list((outside / "site-packages").iterdir())


def test_stored_config_text_is_logged_escaped(shared: Path, outside: Path, run_overrides,
                                              compose_cfg, capsys: pytest.CaptureFixture,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint's stored config with a key whose value holds a newline and Python code: the
    resume check shows it escaped on one line (no line of the log or the error starts with the
    payload), both when it only warns (a key on one side) and when it refuses (a key compared)."""
    marker = Path.cwd() / "PAYLOAD-RAN"
    payload = "x\nimport os; open('PAYLOAD-RAN', 'w')\n\x1b[2J"

    def edit(blob: dict) -> None:
        blob["config"]["note"] = payload  # set on one side only: a warning, not a refusal
        blob["config"]["optim"]["lr"] = payload  # compared: refused

    _rewrite_checkpoint(shared / "checkpoints" / "step-00000001.ckpt", edit)
    with caplog.at_level("INFO"):
        code, errors, text = _in_process("resume", run_overrides(trainer__max_steps=1), shared,
                                         compose_cfg, capsys)
    _refused(code, errors, text, "optim.lr")
    shown = text + caplog.text
    assert "\\nimport os" in shown and "\\x1b[2J" in shown
    assert not any(ln.lstrip().startswith("import os") for ln in shown.splitlines())
    assert "\x1b" not in caplog.text and not marker.exists()


# ---------------------------------------------------------------------- high: the check fails closed
# Run as root and without root's privileges: a check that fails open often does so for one of
# them only (root lists a folder of mode 0333; an ordinary user, or root on NFS with root
# squash, cannot). This machine's interpreter may sit where only root reads (a pyenv under
# /root), so the unprivileged child is root with every capability dropped (``setpriv``): uid 0
# without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH gets exactly an ordinary user's permission
# checks, as root squash does. Not root: the child runs as this (unprivileged) user.
SETPRIV = ("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs")


@pytest.fixture(params=["root", "unprivileged"])
def privileges(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The command prefix that runs a child as root, or as an unprivileged user."""
    if os.geteuid() != 0:
        if request.param == "root":
            pytest.skip("not root: the unprivileged case runs as this user")
        return ()
    if request.param == "root":
        return ()
    if shutil.which(SETPRIV[0]) is None:
        pytest.fail("setpriv (util-linux) is needed to drop root's privileges in a child")
    return SETPRIV


def _resume_child(shared: Path, run_overrides, cwd: Path, import_rss_mb: float,
                  privileges: tuple[str, ...], *extra: str) -> str:
    line, _ = _child("videotrain", [*run_overrides(trainer__max_steps=2), *extra,
                                    f"hydra.run.dir={shared}"], cwd, import_rss_mb, privileges)
    return line


def test_an_unlistable_run_folder_is_refused(shared: Path, outside: Path, run_overrides,
                                             import_rss_mb: float,
                                             privileges: tuple[str, ...]) -> None:
    """A shared run folder of mode 0333 (entered and written, not listed) with
    ``videotrain.log`` linked to the user's ``.bashrc``: refused, root seeing the link, an
    unprivileged user because the folder cannot be listed (it passed as clean, and the log was
    appended through the link); nothing is appended."""
    (shared / "videotrain.log").unlink(missing_ok=True)
    (shared / "videotrain.log").symlink_to(outside / ".bashrc")
    before = _snapshot(outside)
    os.chmod(shared, 0o333)
    try:
        line = _resume_child(shared, run_overrides, outside, import_rss_mb, privileges)
    finally:
        os.chmod(shared, 0o755)
    why = "videotrain.log (a symbolic link" if not privileges else "cannot be listed"
    assert why in line and "nothing was read or written" in line, line
    assert _snapshot(outside) == before


def test_a_checkpoints_link_to_another_run_leaves_it_untouched(
        shared: Path, tmp_path: Path, outside: Path, run_overrides, import_rss_mb: float,
        privileges: tuple[str, ...]) -> None:
    """``checkpoints`` linked to another run's checkpoint folder: refused, under
    ``trainer.resume=false`` too (which moves the folder aside); resume deleted and wrote that
    run's files. The other run is byte for byte as it was."""
    other = Path(shutil.copytree(shared, tmp_path / "other", symlinks=True))
    shutil.rmtree(shared / "checkpoints")
    (shared / "checkpoints").symlink_to(other / "checkpoints")
    before = _snapshot(other)
    for extra in ((), ("trainer.resume=false",)):
        line = _resume_child(shared, run_overrides, outside, import_rss_mb, privileges, *extra)
        assert "checkpoints (a symbolic link" in line, line
    assert _snapshot(other) == before and os.readlink(other / "checkpoints" / "last.ckpt")


def test_a_run_folder_that_is_a_link_is_refused(shared: Path, tmp_path: Path, outside: Path,
                                                run_overrides, import_rss_mb: float,
                                                privileges: tuple[str, ...]) -> None:
    """``hydra.run.dir=SHARED/run`` where ``run`` is a link to another run folder: refused (it
    was followed, and that folder's files replaced); the folder behind it is unchanged."""
    link = tmp_path / "handed" / "run"
    link.parent.mkdir()
    link.symlink_to(shared)
    before = _snapshot(shared)
    line = _resume_child(link, run_overrides, outside, import_rss_mb, privileges)
    assert f"run folder {link} is a symbolic link" in line, line
    assert _snapshot(shared) == before


def test_a_hydra_file_link_is_refused_before_hydra_writes(
        shared: Path, outside: Path, run_overrides, import_rss_mb: float,
        privileges: tuple[str, ...]) -> None:
    """``.hydra/config.yaml`` linked to the user's ``.bashrc``: refused before the log is
    opened or ``.hydra/`` written (the callback writes ``.hydra/`` itself, replacing a link:
    tests/test_untrusted.py); the file behind it is unchanged."""
    (shared / ".hydra").mkdir(exist_ok=True)  # the in-process run that made it has none
    (shared / ".hydra" / "config.yaml").unlink(missing_ok=True)
    (shared / ".hydra" / "config.yaml").symlink_to(outside / ".bashrc")
    before = _snapshot(outside)
    line = _resume_child(shared, run_overrides, outside, import_rss_mb, privileges)
    assert ".hydra/config.yaml (a symbolic link" in line, line
    assert _snapshot(outside) == before


# ---------------------------------------------------------------------- medium: secrets, disk, hangs
@pytest.mark.parametrize("name", ["eval", "predict", "export"])
def test_config_yaml_linked_to_a_secret_is_refused(name: str, shared: Path, outside: Path,
                                                   tiny_root: Path, tmp_path: Path, compose_cfg,
                                                   capsys: pytest.CaptureFixture,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """``config.yaml`` linked to a private key: refused naming ``config.yaml``; the key's text
    appears in no output and no log (it was printed whole as "unknown config key ...")."""
    (shared / "config.yaml").unlink()
    (shared / "config.yaml").symlink_to(outside / ".ssh" / "id_ed25519")
    overrides = _command(name, _last(shared), tiny_root, tmp_path)
    code, errors, text = _in_process(name, overrides, tmp_path / "out", compose_cfg, capsys)
    _refused(code, errors, text, "config.yaml", "symbolic link")
    assert SECRET not in caplog.text and not (tmp_path / "model.pt2").exists()


def _edit_config(run_dir: Path, edit: Callable[[dict], None]) -> None:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    edit(config)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.parametrize(("key", "secret", "line"), [
    ("val_file", ".ssh/id_ed25519", 1),
    ("val_file", ".netrc", 1),
    ("classes_file", ".netrc", None),
])
def test_annotation_keys_pointing_at_secrets_show_no_content(
        key: str, secret: str, line: int | None, shared: Path, outside: Path, tiny_root: Path,
        tmp_path: Path, compose_cfg, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    """``data.val_file`` / ``data.classes_file`` naming the user's private key or ``.netrc``:
    the edited config is not sealed by this user, so it names no file to read; eval refuses its
    dataset naming the key (never its value), and the file is not read."""
    _edit_config(shared, lambda c: c["data"].update({key: str(outside / secret)}))
    overrides = _command("eval", _last(shared), tiny_root, tmp_path)
    code, errors, text = _in_process("eval", overrides, tmp_path / "out", compose_cfg, capsys)
    _refused(code, errors, text, "config.yaml", f"data.{key}")
    assert str(outside / secret) not in errors[0] and line in (1, None)
    assert SECRET not in caplog.text and "BEGIN OPENSSH" not in text and "machine" not in text


@pytest.fixture
def synthetic_data(compose_cfg, shrink_overrides: list[str],
                   tiny_synthetic_overrides: list[str]) -> Callable[..., dict]:
    """``synthetic_data(root, **sizes)``: a run config's ``data`` node for the tiny synthetic
    task (by default the session's cached data)."""

    def _data(root: str | None, **synthetic: int) -> dict:
        cfg = compose_cfg(["data=synthetic", f"data.root={root if root else 'null'}",
                           "data.sampling_rate=2", "data.fps=10", *shrink_overrides,
                           *tiny_synthetic_overrides,
                           *[f"data.synthetic.{k}={v}" for k, v in synthetic.items()]])
        return OmegaConf.to_container(cfg.data, resolve=True)

    return _data


@pytest.mark.parametrize("name", ["eval", "predict"])
def test_a_files_synthetic_root_is_not_written(name: str, shared: Path, outside: Path,
                                               tiny_root: Path, tmp_path: Path, compose_cfg,
                                               isolated_env: Path, synthetic_data,
                                               tiny_synthetic_overrides: list[str],
                                               capsys: pytest.CaptureFixture) -> None:
    """``data.name: synthetic`` with a ``data.root`` of the file's choosing: eval (and predict,
    for a checkpoint without class names) generate nothing there; the data comes from the
    user's own cache (here the session's, which holds this spec already: the user names the
    generator's settings, which a config they did not seal does not choose) and it works."""
    target = outside / "generated-here"
    _edit_config(shared, lambda c: c.update(data=synthetic_data(str(target))))
    if name == "predict":  # no class names in the checkpoint or results.json: the dataset's
        _rewrite_checkpoint(_last(shared), lambda b: b.pop("class_names"))
        (shared / "results.json").unlink()
    cache = sorted(p.name for p in isolated_env.iterdir())
    overrides = [*_command(name, _last(shared), tiny_root, tmp_path), *tiny_synthetic_overrides]
    code, errors, text = _in_process(name, overrides, tmp_path / "out", compose_cfg, capsys)
    assert code == 0 and not errors, text[-2000:]
    assert not target.exists() and sorted(p.name for p in isolated_env.iterdir()) == cache
    if name == "predict":
        assert "right_then_up" in text  # the cached dataset's class names


def test_synthetic_sizes_are_bounded(shared: Path, tiny_root: Path, tmp_path: Path, compose_cfg,
                                     isolated_env: Path, synthetic_data,
                                     capsys: pytest.CaptureFixture) -> None:
    """Sizes that would render for hours: refused naming the key, nothing generated."""
    _edit_config(shared, lambda c: c.update(data=synthetic_data(None, train_per_class=10**9)))
    cache = sorted(p.name for p in isolated_env.iterdir())
    code, errors, text = _in_process("eval", _command("eval", _last(shared), tiny_root, tmp_path),
                                     tmp_path / "out", compose_cfg, capsys)
    _refused(code, errors, text, "data.synthetic.train_per_class")
    assert sorted(p.name for p in isolated_env.iterdir()) == cache


def _alias_bomb_yaml(levels: int = 7) -> str:
    lines = ["  l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _shared_bomb() -> list:
    node: list = ["x"] * 9
    for _ in range(7):
        node = [node] * 9  # 9^8 leaves, one list per level: a pickle's memo keeps it small
    return node


def _plant_bomb(variant: str, shared: Path) -> None:
    if variant == "config.yaml":
        text = (shared / "config.yaml").read_text()
        (shared / "config.yaml").write_text(text.replace("data:\n", "data:\n" + _alias_bomb_yaml(), 1))
        assert len(_alias_bomb_yaml()) < 3000
    else:  # the same structure in the checkpoint's stored config, outside a run folder
        (shared / "config.yaml").unlink()
        _rewrite_checkpoint(_last(shared), lambda b: b["config"]["data"].update(bomb=_shared_bomb()))
        assert _last(shared).stat().st_size < 10**6


@pytest.mark.parametrize("variant", ["config.yaml", "stored"])
@pytest.mark.parametrize("name", ["eval", "predict", "export"])
def test_alias_bombs_are_refused_before_expansion(name: str, variant: str, shared: Path,
                                                  tiny_root: Path, tmp_path: Path, compose_cfg,
                                                  capsys: pytest.CaptureFixture) -> None:
    """A 2.4 KB YAML alias bomb in ``config.yaml``, or a 3 KB pickle-memo one in the stored
    config: refused at once (it hung in ``OmegaConf.load``/``create``, past 1.5 GB)."""
    _plant_bomb(variant, shared)
    start = time.monotonic()
    code, errors, text = _in_process(name, _command(name, _last(shared), tiny_root, tmp_path),
                                     tmp_path / "out", compose_cfg, capsys)
    assert time.monotonic() - start < FAST_S
    line = _refused(code, errors, text)
    assert ("anchor or alias" in line) if variant == "config.yaml" else ("shared reference" in line)


@pytest.mark.parametrize("variant", ["config.yaml", "stored"])
def test_alias_bombs_in_a_fresh_process(variant: str, shared: Path, tiny_root: Path,
                                        tmp_path: Path, import_rss_mb: float) -> None:
    """The same through ``python -m videotrain.eval`` / ``.predict``: bounded time and memory."""
    _plant_bomb(variant, shared)
    name = "eval" if variant == "config.yaml" else "predict"
    _child(f"videotrain.{name}", [*_command(name, _last(shared), tiny_root, tmp_path),
                                  f"hydra.run.dir={tmp_path / 'out'}"], tmp_path, import_rss_mb)


# ---------------------------------------------------------------------- low
def _deflated_copy(src: Path, dst: Path, record: str, inflated: int) -> None:
    """``src`` with ``record``'s bytes replaced by ``inflated`` zero bytes, deflated."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename != record:
                zout.writestr(info, zin.read(info))
                continue
            entry = zipfile.ZipInfo(info.filename)
            entry.compress_type = zipfile.ZIP_DEFLATED
            chunk = bytes(16 << 20)
            with zout.open(entry, "w", force_zip64=True) as f:
                for _ in range(inflated // len(chunk)):
                    f.write(chunk)


def test_a_compressed_record_is_refused_before_inflating(shared: Path, tiny_root: Path,
                                                         tmp_path: Path,
                                                         import_rss_mb: float) -> None:
    """A small checkpoint with one deflated record of 1 GiB of zeros: refused from the zip's
    directory (torch.save stores records uncompressed), in a child whose memory stays flat."""
    src = tmp_path / "plain.ckpt"
    shutil.copyfile(_last(shared), src)
    bomb = _last(shared)
    bomb.unlink()
    with zipfile.ZipFile(src) as z:
        record = next(i.filename for i in z.infolist() if "/data/" in i.filename)
    _deflated_copy(src, bomb, record, 1 << 30)
    assert bomb.stat().st_size < 5 * 2**20
    line, _ = _child("videotrain.eval", [*_command("eval", bomb, tiny_root, tmp_path),
                                         f"hydra.run.dir={tmp_path / 'out'}"], tmp_path,
                     import_rss_mb)
    assert "is compressed" in line and "1073741824" in line


def test_a_stride_zero_head_is_refused(shared: Path, tiny_root: Path, tmp_path: Path,
                                       import_rss_mb: float) -> None:
    """A head weight stored with stride 0 (4 bytes on disk read as 10^7 classes): predict
    refused it before building a head from it (it allocated 10 GB)."""
    def edit(blob: dict) -> None:
        hidden = blob["model"]["head.fc.weight"].shape[1]
        blob["model"]["head.fc.weight"] = torch.zeros(1).expand(10**7, hidden)
        blob["model"]["head.fc.bias"] = torch.zeros(1).expand(10**7)
        blob.pop("class_names")

    _rewrite_checkpoint(_last(shared), edit)
    (shared / "results.json").unlink()
    assert _last(shared).stat().st_size < 10**6
    line, _ = _child("videotrain.predict", [*_command("predict", _last(shared), tiny_root, tmp_path),
                                            f"hydra.run.dir={tmp_path / 'out'}"], tmp_path,
                     import_rss_mb)
    assert "head.fc" in line and "stride" in line


def test_tensors_are_checked_against_the_configured_model_first(
        shared: Path, tiny_root: Path, tmp_path: Path, compose_cfg,
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head of another width than the configured model's: refused naming the key and both
    shapes, after building the model on the meta device only (no real model is built)."""
    import videotrain.config.trained_run as trained_run

    built: list[str] = []
    real_build = trained_run.build_model

    def build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        built.append(next(model.parameters()).device.type)
        return model

    monkeypatch.setattr(trained_run, "build_model", build)
    _rewrite_checkpoint(_last(shared), lambda b: b["model"].update(
        {"head.fc.weight": torch.zeros(4, 99), "\x1b[2Jextra": torch.zeros(1)}))
    code, errors, text = _in_process("predict", _command("predict", _last(shared), tiny_root, tmp_path),
                                     tmp_path / "out", compose_cfg, capsys)
    line = _refused(code, errors, text, "does not fit the configured model",
                    "head.fc.weight (4, 99) vs (4, 16)", "\\x1b[2Jextra")
    assert built == ["meta"], (built, line)


def test_class_names_with_terminal_escapes_are_printed_escaped(
        shared: Path, tiny_root: Path, tmp_path: Path, compose_cfg,
        capsys: pytest.CaptureFixture) -> None:
    """Class names that clear the screen, write the clipboard (OSC 52) or forge output lines:
    predict prints them escaped, each on its own line, and still predicts."""
    names = ["\x1b[2J\x1b[Hcleared", "\x1b]52;c;ZWNobyBvd25lZA==\x07", "x\n  1. forged  1.0000",
             "\u202eevil"]
    _rewrite_checkpoint(_last(shared), lambda b: b.update(class_names=names))
    overrides = [*_command("predict", _last(shared), tiny_root, tmp_path), "predict.topk=4"]
    code, errors, text = _in_process("predict", overrides, tmp_path / "out", compose_cfg, capsys)
    assert code == 0 and not errors, text[-2000:]
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b[2J" in text and "\\x1b]52" in text and "\\u202e" in text
    assert not any(ln.startswith("  1. forged") for ln in text.splitlines())


def test_a_fifo_checkpoint_does_not_hang(tmp_path: Path, tiny_root: Path,
                                         import_rss_mb: float) -> None:
    """``checkpoint=`` a FIFO: refused (it waited forever for a writer)."""
    fifo = tmp_path / "shared.ckpt"
    os.mkfifo(fifo)
    line, _ = _child("videotrain.eval", [*_command("eval", fifo, tiny_root, tmp_path),
                                         f"hydra.run.dir={tmp_path / 'out'}"], tmp_path,
                     import_rss_mb)
    assert "FIFO" in line and str(fifo) in line


def test_a_fifo_in_the_run_folder_does_not_hang_resume(shared: Path, run_overrides,
                                                       import_rss_mb: float, tmp_path: Path) -> None:
    """A newer step file that is a FIFO in the folder resumed from: refused, not waited on."""
    os.mkfifo(shared / "checkpoints" / "step-00000009.ckpt")
    line, _ = _child("videotrain", [*run_overrides(trainer__max_steps=2),
                                    f"hydra.run.dir={shared}"], tmp_path, import_rss_mb)
    assert "step-00000009.ckpt (a FIFO)" in line


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_the_weights_only_refusal_names_the_global(tmp_path: Path, tiny_root: Path, compose_cfg,
                                                   capsys: pytest.CaptureFixture) -> None:
    """A checkpoint whose unpickling calls ``os.system``: refused naming ``posix.system`` (torch
    2.14 dropped it), without torch's advice to load it with ``weights_only=False``."""
    marker, evil = tmp_path / "PAYLOAD-RAN", tmp_path / "evil.ckpt"
    torch.save({"model": {}, "payload": RunsCode(marker)}, evil)
    code, errors, text = _in_process("eval", _command("eval", evil, tiny_root, tmp_path),
                                     tmp_path / "out", compose_cfg, capsys)
    line = _refused(code, errors, text, "unsupported global posix.system", str(evil))
    assert "weights_only=False" not in text and "set to `False`" not in text and "Re-running" not in line
    assert not marker.exists()


@pytest.mark.parametrize("key", ["model.init_from", "model.pretrained_path"])
def test_each_weights_key_names_itself(key: str, tmp_path: Path) -> None:
    """A bad ``.safetensors`` file: the error names the key that named it."""
    from videotrain.models.finetune import read_init_state
    from videotrain.models.weights import read_state_dict

    bad = tmp_path / "weights.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}" + SECRET.encode())
    with pytest.raises(ValueError) as err:
        read_init_state(bad) if key == "model.init_from" else read_state_dict(bad)
    assert str(err.value).startswith(f"{key}=") and SECRET not in str(err.value)
    other = "model.pretrained_path" if key == "model.init_from" else "model.init_from"
    assert other not in str(err.value)


# ---------------------------------------------------------------------- what still works
def test_links_in_a_run_folder_are_named_escaped(tmp_path: Path) -> None:
    """The refusal lists every offending entry, its name and target escaped and cut."""
    from videotrain.untrusted import UnsafeRunFolder, check_run_folder

    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "step-00000001.ckpt").write_bytes(b"x")
    (folder / "checkpoints" / "last.ckpt").symlink_to("step-00000001.ckpt")  # allowed
    (folder / "evil\x1b[2Jname").symlink_to("/" + "a" * 300)
    os.mkfifo(folder / "metrics.jsonl")
    os.link(tmp_path / "run" / "checkpoints" / "step-00000001.ckpt", folder / "results.json")
    with pytest.raises(UnsafeRunFolder) as err:
        check_run_folder(folder)
    text = str(err.value)
    assert "\x1b" not in text and "\\x1b[2J" in text and "\n" not in text and "a" * 200 not in text
    assert "metrics.jsonl (a FIFO)" in text and "results.json (a hard link" in text
    assert "last.ckpt" not in text and "3 entries" in text


def test_a_dataset_behind_links_still_works(shared: Path, tiny_root: Path, tmp_path: Path,
                                            compose_cfg, capsys: pytest.CaptureFixture) -> None:
    """Datasets are not run folders: ``data.root`` behind a link (a cluster's usual layout)
    evaluates the same as the folder itself; the run folder's own last.ckpt link is followed."""
    link = tmp_path / "data-link"
    link.symlink_to(tiny_root)
    base = _command("eval", _last(shared), tiny_root, tmp_path)
    direct = run_eval(validate(compose_cfg(base)), base, tmp_path / "a")
    linked = [*base, f"data.root={link}"]
    assert run_eval(validate(compose_cfg(linked)), linked, tmp_path / "b") == direct
    assert json.loads((tmp_path / "b" / "eval.json").read_text())["videos"] == 8


def test_wandb_replaces_links_planted_at_its_names(tmp_path: Path, outside: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule that lets wandb's links pass (videotrain.untrusted.run_folder._wandb_link),
    tried: links planted at ``wandb/latest-run``, ``debug.log``, ``debug-internal.log`` and at
    ``logs/debug-core.log`` of the run folders wandb would pick in the next minute are replaced
    or left aside by wandb (it makes a new run folder of its own), and nothing is written
    through any of them."""
    from videotrain.metrics.logger import MetricsLogger, WandbSettings
    from videotrain.untrusted import check_run_folder

    monkeypatch.delenv("WANDB_MODE", raising=False)  # conftest disables wandb
    run_dir = tmp_path / "run"
    (run_dir / "wandb").mkdir(parents=True)
    (run_dir / "wandb_run_id").write_text("abc123\n")
    victims = {name: outside / f"victim-{name}" for name in ("latest-run", "debug.log",
                                                            "debug-internal.log", "core")}
    for name, victim in victims.items():
        victim.write_text("the user's file\n")
        if name != "core":
            (run_dir / "wandb" / name).symlink_to(victim)
    now = time.time()
    for second in range(60):  # wandb names its run folder offline-run-DATE_TIME-ID
        stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(now + second))
        logs = run_dir / "wandb" / f"offline-run-{stamp}-abc123" / "logs"
        logs.mkdir(parents=True)
        (logs / "debug-core.log").symlink_to(victims["core"])
    check_run_folder(run_dir)  # wandb's names: they pass
    before = _snapshot(outside)
    logger = MetricsLogger(run_dir, wandb=WandbSettings(mode="offline"), run_name="run")
    try:
        logger.log({"train_loss": 1.0}, step=1)
    finally:
        logger.finish({"train_loss": 1.0})
    assert _snapshot(outside) == before
    for name in ("latest-run", "debug.log", "debug-internal.log"):
        target = os.readlink(run_dir / "wandb" / name)
        assert not target.startswith("/") and target.split("/")[0].startswith("offline-run-")
    new = run_dir / "wandb" / os.readlink(run_dir / "wandb" / "latest-run")
    assert (new / "logs" / "debug.log").is_file() and not (new / "logs" / "debug.log").is_symlink()
    assert os.readlink(new / "logs" / "debug-core.log") != str(victims["core"])
    check_run_folder(run_dir)  # and the run can be resumed again
