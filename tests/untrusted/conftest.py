"""The harness of the attack matrix (issue "trust by construction"): every entry point the
project ships (``ENTRY_POINTS``: the commands, resume, the bench, ``benchmarks/``, ``scripts/``),
run in a child process on files a stranger could share, as root and as an unprivileged user.

A case runs in a child forked from the test process (``Workspace.run``): no second import of
torch, so a case costs what the command costs. The child drops to ``nobody`` (uid/gid 65534, no
supplementary groups) for the ``nobody`` parametrization, runs the entry point as ``python -m``
or ``python SCRIPT`` runs it (``runpy``, ``__name__ == "__main__"``), and is killed past
``WALL_S``. Judged (``Outcome.judge``): exit status 0, or 2 with exactly one ``error:`` line
and no traceback; at most ``TIME_S`` of CPU time; at most ``GROWTH_MB`` of anonymous memory
over what the child started with (``RssAnon`` sampled from ``/proc`` every few milliseconds: a
forked child's peak RSS would count the parent's library pages it touches again; the child
also runs under an ``RLIMIT_DATA`` well above it, so a bomb cannot take the machine); no
marker file (no payload ran); the victim's files (``Workspace.victim``: an SSH key,
``authorized_keys``, ``.netrc``, ``.bashrc``, a ``site-packages``, another run) unchanged; the
secret's bytes in no output and in no file under the workspace; no terminal escape in any
output. A workspace lives under a world-readable folder in ``/tmp`` (pytest's own is mode
0700) and is handed to the user before a case runs, as a download would be. Where the tests
do not run as root, the ``root`` cases skip (saying so) and the others run as that user.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import io
import json
import logging
import multiprocessing
import os
import resource
import runpy
import shutil
import signal
import stat
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SECRET = "hunter2-SECRET-d41d8cd9"  # in the victim's files and the environment; never shown
# four lines each, as many as the tiny runs have classes: read as a class list, they would be
# the class names predict prints
KEY_TEXT = ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA" + SECRET
            + "\nQyNTUxOQAAACBmaW5nZXJwcmludAAAAA\n-----END OPENSSH PRIVATE KEY-----\n")
NETRC_TEXT = "".join(f"machine host{i}.example.org login me password {SECRET}\n" for i in range(4))
AUTHORIZED = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMine me@laptop\n"
TIME_S = 10  # CPU seconds a case may take (the bound)
WALL_S = 40  # wall-clock seconds before a case is killed: a hang (two cores, shared)
GROWTH_MB = 500  # anonymous memory a case may add to what its process started with
SAFETY_MB = 3000  # RLIMIT_DATA headroom: a bomb fails to allocate instead of eating the machine
NOBODY = 65534


@dataclass(frozen=True)
class EntryPoint:
    """A command or script the project ships, as docs/cluster.md's entry-point table names it
    (``command``), and how ``python`` runs it (a module for ``-m``, or a script's path)."""

    command: str
    module: str | None = None
    script: str | None = None


ENTRY_POINTS: dict[str, EntryPoint] = {
    "train": EntryPoint("python -m videotrain", module="videotrain"),
    "resume": EntryPoint("python -m videotrain hydra.run.dir=RUN", module="videotrain"),
    "eval": EntryPoint("python -m videotrain.eval", module="videotrain.eval"),
    "predict": EntryPoint("python -m videotrain.predict", module="videotrain.predict"),
    "export": EntryPoint("python -m videotrain.export", module="videotrain.export"),
    "plan": EntryPoint("python -m videotrain.plan", module="videotrain.plan"),
    "prepare": EntryPoint("python -m videotrain.prepare", module="videotrain.prepare"),
    "bench": EntryPoint("python -m videotrain.bench", module="videotrain.bench"),
    "benchmarks.annotations": EntryPoint("python -m benchmarks.annotations",
                                         module="benchmarks.annotations"),
    "benchmarks.data": EntryPoint("python -m benchmarks.data", module="benchmarks.data"),
    "benchmarks.equal_time": EntryPoint("python -m benchmarks.equal_time",
                                        module="benchmarks.equal_time"),
    "benchmarks.sac_milp": EntryPoint("python -m benchmarks.sac_milp", module="benchmarks.sac_milp"),
    "benchmarks.gpu_estimate_cuda_bn": EntryPoint("python -m benchmarks.gpu_estimate_cuda_bn",
                                                  module="benchmarks.gpu_estimate_cuda_bn"),
    "summarize_sweep": EntryPoint("python scripts/summarize_sweep.py",
                                  script="scripts/summarize_sweep.py"),
    "check_sbp_autocast_grads": EntryPoint("python scripts/check_sbp_autocast_grads.py",
                                           script="scripts/check_sbp_autocast_grads.py"),
}


# ---------------------------------------------------------------------- the child process
def _status_kb(pid: int | str, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _world_readable(path: Path) -> bool:
    """Whether any user can read ``path``: a folder others may read and search, below folders
    others may search."""
    try:
        if os.stat(path).st_mode & 0o005 != 0o005:
            return False
        return all(os.stat(p).st_mode & 0o001 for p in path.parents)
    except OSError:
        return False


# A development machine's interpreter may sit where only root reads (a pyenv under /root); a
# child that dropped every privilege could import nothing more from it. There the child keeps
# root as its saved user id and reads only the interpreter's own files as root (`_RootImports`);
# everything the command itself opens is opened as the unprivileged user.
PRIVATE_INTERPRETER = not _world_readable(Path(sysconfig.get_paths()["stdlib"]))


class _AsRoot(contextlib.AbstractContextManager):
    def __enter__(self) -> None:
        self.uid = os.geteuid()
        os.seteuid(0)

    def __exit__(self, *exc: object) -> None:
        os.seteuid(self.uid)


class _RootLoader(importlib.abc.Loader):
    """A loader whose module file only root can read: created and executed as root."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> object:
        with _AsRoot():
            return self.inner.create_module(spec)

    def exec_module(self, module: object) -> None:
        with _AsRoot():
            self.inner.exec_module(module)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class _RootImports(importlib.abc.MetaPathFinder):
    """Finds modules as root; a module the user cannot read is loaded by ``_RootLoader``."""

    def find_spec(self, name: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        with _AsRoot():
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or spec.origin is None:
            return spec
        if not os.access(spec.origin, os.R_OK):
            spec.loader = _RootLoader(spec.loader)
        return spec


def _drop_to(uid: int) -> None:
    """Become ``uid`` (its group too, no supplementary groups): for good where the interpreter
    is world-readable, else with root kept as the saved user id for imports only."""
    os.setgroups([])
    if not PRIVATE_INTERPRETER:
        os.setgid(uid)
        os.setuid(uid)
        return
    os.setresgid(uid, uid, 0)
    os.setresuid(uid, uid, 0)
    sys.meta_path.insert(0, _RootImports())
    sys.path_importer_cache.clear()


def _child(target: Callable[[], object], uid: int | None, cwd: Path, env: dict[str, str],
           out: Path, err: Path) -> None:
    """In the forked child: its own session, output to files, the user's environment and
    identity, a data limit; runs ``target`` and exits with its status (never returns)."""
    code = 1
    try:
        os.setsid()
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        os.environ.clear()
        os.environ.update(env)
        # a fresh process has no temporary folder yet: the forked test worker's (root's, mode
        # 0700) would be reused by multiprocessing and tempfile, which the user cannot enter
        tempfile.tempdir = None
        multiprocessing.current_process()._config.pop("tempdir", None)
        if uid is not None:
            _drop_to(uid)
        os.chdir(cwd)
        logging.root.handlers.clear()  # pytest's capture: a fresh process has none
        data = (_status_kb("self", "VmData") or 0) * 1024 + SAFETY_MB * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (data, data))
        try:
            target()
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if isinstance(done.code, str):
                print(done.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what a fresh interpreter prints
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


@dataclass
class Ran:
    """What a child did: exit status, output, wall and CPU seconds, anonymous memory growth."""

    code: int
    out: str
    err: str
    wall_s: float
    cpu_s: float
    grew_mb: float
    killed: bool

    @property
    def text(self) -> str:
        return self.out + self.err

    @property
    def errors(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith("error:")]


def _forked_autograd_works() -> bool:
    """Whether a child forked from this process can run a backward (PyTorch refuses it in a
    child of a process whose autograd device threads have started)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        with contextlib.suppress(BaseException):
            import torch

            torch.ones(1, requires_grad=True).sum().backward()
            code = 0
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def run_child(target: Callable[[], object], uid: int | None, cwd: Path, env: dict[str, str],
              wall_s: float = WALL_S) -> Ran:
    """``target()`` in a forked child (``_child``), watched: killed (its whole session) past
    ``wall_s``; its anonymous memory sampled from ``/proc`` until it exits."""
    if not _forked_autograd_works():
        pytest.fail("this test process has started autograd's device threads (a fake-tensor "
                    "backward ran in it), so a forked child cannot run autograd: the untrusted "
                    "tests must run before any such test (tests/conftest.py orders them first)")
    logs = Path(tempfile.mkdtemp(prefix="videotrain-case-"))
    out, err = logs / "out", logs / "err"
    base = _status_kb("self", "RssAnon") or 0  # the child starts with the parent's pages
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(target, uid, cwd, env, out, err)
    peak, killed = base, False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        peak = max(peak, _status_kb(pid, "RssAnon") or 0)
        if time.monotonic() - start > wall_s and not killed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            killed = True
        time.sleep(0.005)
    wall = time.monotonic() - start
    with contextlib.suppress(ProcessLookupError):  # a grandchild left behind (a worker)
        os.killpg(pid, signal.SIGKILL)
    ran = Ran(os.waitstatus_to_exitcode(status), out.read_text(errors="backslashreplace"),
              err.read_text(errors="backslashreplace"), wall, usage.ru_utime + usage.ru_stime,
              (peak - base) / 1024, killed)
    shutil.rmtree(logs, ignore_errors=True)
    return ran


def entry_target(name: str, args: list[str]) -> Callable[[], object]:
    """What ``python -m MODULE ARGS`` / ``python SCRIPT ARGS`` runs, for the child."""
    entry = ENTRY_POINTS[name]

    def run() -> None:
        if entry.module is not None:
            sys.argv = [entry.module, *args]
            runpy.run_module(entry.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [str(REPO / entry.script), *args]
            runpy.run_path(str(REPO / entry.script), run_name="__main__")

    return run


# ---------------------------------------------------------------------- the workspace
def _tree(folder: Path) -> Iterator[Path]:
    """Every entry under ``folder`` (itself first), never following a link."""
    yield folder
    for here, dirs, files in os.walk(folder):
        for name in dirs + files:
            yield Path(here) / name


def snapshot(folder: Path) -> dict[str, tuple]:
    """Each entry's kind, mode, mtime and contents (a link's target), by relative path."""
    shot: dict[str, tuple] = {}
    for path in _tree(folder):
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            what: object = os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            what = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            what = None
        shot[str(path.relative_to(folder))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                               st.st_mtime_ns if not stat.S_ISDIR(st.st_mode)
                                               else None, what)
    return shot


def files_holding(folder: Path, needle: bytes, skip: tuple[Path, ...] = ()) -> list[str]:
    """Regular files under ``folder`` (outside ``skip``) whose bytes contain ``needle``."""
    found = []
    for path in _tree(folder):
        if (any(path == s or s in path.parents for s in skip) or not path.is_file()
                or path.is_symlink()):
            continue
        st = path.stat()
        if st.st_size > 256 << 20 or st.st_blocks * 512 < st.st_size // 2:
            continue  # a planted bomb (sparse, or huge): no entry point wrote it
        with open(path, "rb") as f:
            tail = b""
            while chunk := f.read(1 << 22):
                if needle in tail + chunk:
                    found.append(str(path.relative_to(folder)))
                    break
                tail = chunk[-len(needle):]
    return found


@dataclass
class Workspace:
    """One case's folder: ``victim`` (the user's files an attack aims at), ``home`` (``$HOME``,
    where libraries keep caches), ``cache`` (``$VIDEOTRAIN_CACHE``: the user's own, holding the
    seal key), ``work`` (the working directory), and what the test plants beside them."""

    root: Path
    user: str
    marker: Path = field(init=False)

    def __post_init__(self) -> None:
        self.victim, self.home = self.root / "victim", self.root / "home"
        self.cache, self.work = self.root / "cache", self.root / "work"
        self.marker = self.root / "PAYLOAD-RAN"
        for folder in (self.home, self.cache, self.work, self.victim / "site-packages"):
            folder.mkdir(parents=True)
        (self.victim / ".ssh").mkdir()
        for rel, text in ((".ssh/id_ed25519", KEY_TEXT), (".ssh/authorized_keys", AUTHORIZED),
                          (".netrc", NETRC_TEXT), (".bashrc", "# the user's bashrc\n")):
            (self.victim / rel).write_text(text)
            os.chmod(self.victim / rel, 0o600)
        self._before: dict[str, tuple] | None = None

    @property
    def uid(self) -> int | None:
        """The user id the child switches to (None: it runs as this process's user)."""
        return NOBODY if self.user == "nobody" else None

    @property
    def privileged(self) -> bool:
        """Root: reads and lists what its owner's mode bits forbid."""
        return self.user == "root"

    def env(self, **extra: str) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items()
                if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "OMP_NUM_THREADS",
                         "MKL_NUM_THREADS", "WANDB_MODE")}
        return {**keep, "HOME": str(self.home), "VIDEOTRAIN_CACHE": str(self.cache),
                "WANDB_DIR": str(self.home / "wandb"), "TORCH_HOME": str(self.home / "torch"),
                "MPLCONFIGDIR": str(self.home / "mpl"), "XDG_CACHE_HOME": str(self.home / ".cache"),
                "XDG_CONFIG_HOME": str(self.home / ".config"), "TMPDIR": str(self.home),
                "VIDEOTRAIN_TEST_TOKEN": SECRET, **extra}  # /proc/self/environ holds it

    def hand_over(self) -> None:
        """Everything here becomes the user's (a download is the user's own files too);
        modes stay as planted (a folder of mode 0333 stays unreadable to its owner)."""
        if self.uid is None:
            return
        for path in _tree(self.root):
            os.lchown(path, self.uid, self.uid)

    def run(self, name: str, args: list[str], cwd: Path | None = None,
            env: dict[str, str] | None = None) -> Outcome:
        """Entry point ``name`` with ``args``, as this workspace's user (``run_call``)."""
        return self.run_call(entry_target(name, [str(a) for a in args]), cwd, env)

    def run_call(self, target: Callable[[], object], cwd: Path | None = None,
                 env: dict[str, str] | None = None, wall_s: float = WALL_S) -> Outcome:
        """``target()`` in a child as this workspace's user: for an entry point whose writer
        is tested without its measurement (the bench's report, the benchmarks' tables)."""
        self.hand_over()
        self._before = snapshot(self.victim)
        ran = run_child(target, self.uid, cwd or self.work, env or self.env(), wall_s)
        return Outcome(ran, self)


@dataclass
class Outcome:
    ran: Ran
    ws: Workspace

    def judge(self, expect: str = "refused", *names: str, time_s: float = TIME_S) -> str:
        """The case's verdict (module docstring); ``expect``: ``refused`` (status 2, one
        ``error:`` line naming ``names``), ``ok`` (status 0, no ``error:`` line) or ``either``.
        Returns the error line ('' when it succeeded)."""
        r, ws = self.ran, self.ws
        tail = r.text[-3000:]
        assert not r.killed, f"still running after {r.wall_s:.0f} s (killed): {tail}"
        assert "Traceback (most recent call last)" not in r.err, tail
        refused = r.code == 2 and len(r.errors) == 1
        succeeded = r.code == 0 and not r.errors
        assert {"refused": refused, "ok": succeeded, "either": refused or succeeded}[expect], (
            f"expected {expect}, got status {r.code} with {len(r.errors)} error lines: {tail}")
        line = r.errors[0] if refused else ""
        for name in names:
            assert name in line, (name, line)
        assert r.cpu_s <= time_s, f"{r.cpu_s:.1f} s of CPU time: {tail}"
        assert r.grew_mb <= GROWTH_MB, f"{r.grew_mb:.0f} MB more memory: {tail}"
        assert SECRET not in r.text, "the secret was shown: " + tail
        assert "\x1b" not in r.text and "\x07" not in r.text, "a terminal escape was printed"
        assert not ws.marker.exists(), "the payload ran"
        after = snapshot(ws.victim)
        changed = sorted(k for k in after.keys() | ws._before.keys()
                         if after.get(k) != ws._before.get(k))
        assert not changed, f"files outside the run changed: {changed[:5]}"
        held = files_holding(ws.root, SECRET.encode(), (ws.victim,))
        assert not held, f"a file holds the secret: {held}"
        return line


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def entry_points() -> dict[str, EntryPoint]:
    """``ENTRY_POINTS``, for the test that holds it to the code and the docs."""
    return dict(ENTRY_POINTS)


@pytest.fixture(scope="session")
def public_root() -> Iterator[Path]:
    """A world-readable folder in ``/tmp`` for this session's workspaces."""
    root = Path(tempfile.mkdtemp(prefix="videotrain-untrusted-"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _readable(folder: Path) -> Path:
    for path in _tree(folder):
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return folder


@pytest.fixture(scope="session")
def public_data(public_root: Path, tiny_root: Path) -> Path:
    """The session's tiny dataset, copied where any user can read it."""
    return _readable(Path(shutil.copytree(tiny_root, public_root / "data")))


@pytest.fixture(scope="session")
def data_args(public_data: Path) -> list[str]:
    """What a user passes for their own copy of the dataset a shared run was trained on."""
    return [f"data.root={public_data}"]


@pytest.fixture(scope="session")
def dataset_args(train_args) -> Callable[[Path], list[str]]:
    """``dataset_args(root)``: the dataset described whole on the command line (the group and
    every ``data.*`` key of the tiny runs), as for evaluating someone else's run."""
    return lambda root: [a for a in train_args() if a.startswith(("data=", "data."))
                         and not a.startswith("data.root=")] + [f"data.root={root}"]


@pytest.fixture(scope="session")
def train_args(run_overrides, public_data: Path) -> Callable[..., list[str]]:
    """``run_overrides`` on the public dataset: a tiny run's whole command line."""
    return lambda **extra: run_overrides(public_data, **extra)


@pytest.fixture(scope="session")
def stranger_run(public_root: Path, train_args) -> Path:
    """A tiny run (one step, its checkpoint) trained by someone else: another user's cache
    (so another seal key, if any), through ``python -m videotrain`` in a child."""
    folder = public_root / "stranger"
    ws = Workspace(folder / "ws", "root")
    ran = run_child(entry_target("train", [*train_args(trainer__max_steps=1),
                                           f"hydra.run.dir={folder / 'run'}"]),
                    None, ws.work, ws.env(), wall_s=300)
    assert ran.code == 0, ran.text[-3000:]
    return _readable(folder / "run")


def _can_switch_user() -> bool:
    return os.geteuid() == 0


@pytest.fixture(params=["root", "nobody"])
def user(request: pytest.FixtureRequest) -> str:
    """Every case runs as root and as an unprivileged user (``nobody``): a check that fails
    open often does so for one of them only (root reads what nobody cannot)."""
    if not _can_switch_user():
        if request.param == "root":
            pytest.skip("not root: this machine cannot run the case as root (the nobody "
                        "variant runs it as this unprivileged user)")
        return "self"
    return request.param


@pytest.fixture
def ws(user: str, public_root: Path) -> Iterator[Workspace]:
    root = Path(tempfile.mkdtemp(prefix="ws-", dir=public_root))
    os.chmod(root, 0o755)
    yield Workspace(root, user)
    shutil.rmtree(root, ignore_errors=True)  # root removes what a mode 0333 folder holds


@pytest.fixture
def shared(ws: Workspace, stranger_run: Path) -> Path:
    """The stranger's run, copied into the workspace as a download (links kept as links)."""
    return Path(shutil.copytree(stranger_run, ws.root / "shared", symlinks=True))


def make_sweep(root: Path, jobs: int = 2, results: dict | None = None) -> Path:
    """A Hydra multirun folder of ``jobs`` jobs as ``python -m videotrain -m`` leaves it."""
    for i in range(jobs):
        job = root / f"{i}_memory=sbp,memory.keep_ratio=0.{i + 1}"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(
            yaml.safe_dump(["memory=sbp", f"memory.keep_ratio=0.{i + 1}", f"seed={i}"]))
        (job / "results.json").write_text(json.dumps(results or {
            "val_top1": 0.5, "val_top5": 1.0, "train_peak_mem_mb": 80.0, "step_time_s": 0.5,
            "memory_strategy": "sbp", "memory": {"keep_ratio": 0.1 * (i + 1)}, "epochs": 1}))
    return root


@pytest.fixture(scope="session")
def sweep_folder() -> Callable[..., Path]:
    """``sweep_folder(root, jobs=2, results=None)``: a fabricated multirun (``make_sweep``)."""
    return make_sweep
