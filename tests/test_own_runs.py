"""The user's own runs (``videotrain.untrusted.own``): a keyed digest (a seal) with a per-user key
in the user's cache, which a stranger cannot forge, decides what a run's config may set.

The key: 32 random bytes, mode 0600, made without following links; a key file that is a link,
not of this user, not 0600 or not 32 bytes is not used. A seal verifies only for the exact bytes
it was made of, under the key it was made with: a copied run stays the user's own, an edited one
or a seal made under another key (another user's, a stranger's) does not.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from videotrain.data.layouts import default_cache_root
from videotrain.untrusted import own


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache (so a fresh key) for this test."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("VIDEOTRAIN_CACHE", str(folder))
    return folder


def test_the_key_lives_in_the_cache_the_data_uses(cache: Path) -> None:
    assert own.cache_dir() == default_cache_root() == cache


def test_a_seal_is_made_with_a_new_0600_key_and_verifies_its_bytes_only(cache: Path) -> None:
    seal = own.seal(b"model: {}\n")
    key = own.key_path()
    assert seal is not None and len(seal) == own.SEAL_CHARS and int(seal, 16) >= 0
    st_ = os.lstat(key)
    assert stat.S_ISREG(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o600
    assert st_.st_size == own.KEY_BYTES and st_.st_uid == os.getuid()
    assert own.seal(b"model: {}\n") == seal  # the same key, not a new one each time
    assert own.is_sealed(b"model: {}\n", seal)
    assert not own.is_sealed(b"model: {}\n ", seal)  # one byte more
    assert not own.is_sealed(b"model: {}\n", seal.upper())
    assert [p.name for p in key.parent.iterdir()] == [own.KEY_NAME]  # no temporary left
    assert key.parent.parent == cache


def test_a_seal_made_under_another_key_does_not_verify(cache: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger's seal (their own key) of the same bytes: not this user's."""
    theirs = own.seal(b"data: {root: /x}\n")
    monkeypatch.setenv("VIDEOTRAIN_CACHE", str(tmp_path / "mine"))
    assert own.seal(b"data: {root: /x}\n") != theirs
    assert not own.is_sealed(b"data: {root: /x}\n", theirs)


@pytest.mark.parametrize("given_seal", [None, 7, "", "0" * 64, "g" * 64, "\u00e9" * 64,
                                        ["0" * 64], "0" * 65])
def test_a_forged_seal_is_false_whatever_its_type(cache: Path, given_seal: object) -> None:
    own.seal(b"x")  # a key exists
    assert own.is_sealed(b"x", given_seal) is False


def test_no_key_means_nothing_is_sealed_and_none_is_made_by_reading(cache: Path) -> None:
    assert not own.is_sealed(b"x", "0" * 64)
    assert not cache.exists()  # checking a seal makes no key


@pytest.mark.parametrize("problem", ["mode 0644", "a link to a good key", "31 bytes", "a folder"])
def test_a_key_file_that_is_not_private_is_not_used(problem: str, cache: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Whoever could write or read the key could forge seals: such a key is not used (one log
    line), seals made with it no longer verify, and none is made over it."""
    seal = own.seal(b"x")
    key = own.key_path()
    if problem == "mode 0644":
        key.chmod(0o644)
    elif problem == "a link to a good key":
        good = tmp_path / "elsewhere.key"
        key.rename(good)
        key.symlink_to(good)
    elif problem == "31 bytes":
        key.write_bytes(key.read_bytes()[:31])
    else:
        key.unlink()
        key.mkdir()  # (and a claimed folder with no key in it is taken over only when stale)
    with caplog.at_level(logging.WARNING, logger=own.__name__):
        assert not own.is_sealed(b"x", seal)
        assert own.seal(b"x") is None  # nothing sealed: the run reads as someone else's
    assert "not used" in caplog.text or "unreadable" in caplog.text
    assert os.path.lexists(key)  # left for the user to look at, not replaced


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_key_of_another_user_is_not_used(cache: Path) -> None:
    seal = own.seal(b"x")
    os.chown(own.key_path(), 65534, 65534)
    assert not own.is_sealed(b"x", seal) and own.seal(b"x") is None


def test_processes_making_the_key_at_once_end_with_one(cache: Path) -> None:
    """One claims the key's folder and writes the key, the others wait for it: one key."""
    code = ("import sys; from videotrain.untrusted import own; sys.stdout.write(own.seal(b'x'))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    seals = {p.communicate(timeout=60)[0] for p in procs}
    assert len(seals) == 1 and own.is_sealed(b"x", seals.pop())
    assert [p.name for p in own.key_path().parent.iterdir()] == [own.KEY_NAME]


def test_a_config_file_seal_beside_it(cache: Path, tmp_path: Path) -> None:
    """``config.seal`` beside ``config.yaml``: a copy elsewhere is still the user's own; an
    edited config, a seal that is a link or is missing is not."""
    run = tmp_path / "run"
    run.mkdir()
    text = b"seed: 0\n"
    (run / "config.yaml").write_bytes(text)
    assert own.write_seal(run / "config.yaml", text) == run / "config.seal"
    assert own.is_sealed_file(run / "config.yaml", text)
    assert not own.is_sealed_file(run / "config.yaml", b"seed: 1\n")
    (run / "config.seal").rename(run / "real.seal")
    (run / "config.seal").symlink_to("real.seal")
    assert not own.is_sealed_file(run / "config.yaml", text)
    (run / "config.seal").unlink()
    assert not own.is_sealed_file(run / "config.yaml", text)


def test_a_config_seal_covers_its_values_in_any_key_order(cache: Path) -> None:
    seal = own.seal_config({"data": {"root": "/x", "crop_size": 64}, "seed": 0})
    assert own.is_sealed_config({"seed": 0, "data": {"crop_size": 64, "root": "/x"}}, seal)
    assert not own.is_sealed_config({"seed": 0, "data": {"crop_size": 64, "root": "/y"}}, seal)
    assert not own.is_sealed_config({1: "a", "b": 2}, seal)  # JSON cannot order it: not sealed
    assert own.seal_config({1: "a", "b": 2}) is None


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=64), forged=st.one_of(st.text(max_size=80), st.binary(max_size=80),
                                                     st.integers(), st.none()))
def test_no_random_value_passes_for_a_seal(data: bytes, forged: object) -> None:
    """Whatever a stranger writes as the seal (any text, bytes, number): False, never an error."""
    # the session's cache (conftest's isolated_env) holds this process's key
    assert own.is_sealed(data, forged) is (forged == own.seal(data))


def test_a_claim_whose_maker_died_is_taken_over_when_stale(cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The key's folder claimed, no key written (its maker was killed): a fresh claim waits
    for the key; a stale one is taken over, so the user is not left without seals."""
    own.key_path().parent.mkdir(parents=True)
    monkeypatch.setattr(own, "KEY_WAIT_S", 0.2)
    assert own.seal(b"x") is None  # waited, no key came
    old = own.key_path().parent.stat().st_mtime - own.STALE_S - 1
    os.utime(own.key_path().parent, (old, old))
    assert own.is_sealed(b"x", own.seal(b"x"))
