"""The user's own runs, told from anyone else's by a keyed digest that a stranger cannot forge.

A run folder or a checkpoint may be downloaded (it then belongs to the user too) and any flag
inside it can be written by whoever made it, so neither the owner nor a flag says "mine". The
trainer seals what it writes instead: ``config.seal`` beside a run's ``config.yaml`` holds the
HMAC-SHA256 of its exact bytes, and every checkpoint stores the HMAC of its stored config's
canonical JSON (:func:`canonical_json`). The key is 32 random bytes in the user's own cache
(``$VIDEOTRAIN_CACHE/seal/key``, else ``~/.cache/videotrain/seal/key``: beside the synthetic
data), created with mode 0600 through the one writer, never following a link. A key file that is not a regular file of this
user with mode 0600 and 32 bytes is not used (one log line): whoever could write it could forge
seals. Without a usable key nothing is sealed, and every run reads as someone else's.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any

from videotrain.untrusted.files import atomic_writer, make_new_dir, read_text, write_text
from videotrain.untrusted.text import shown

log = logging.getLogger(__name__)

KEY_DIR, KEY_NAME = "seal", "key"  # the folder is claimed (mkdir) by the process that makes it
KEY_BYTES = 32
KEY_WAIT_S = 10.0  # how long another process's key may take to appear
STALE_S = 60.0  # a claimed folder still without a key after this: its maker died
SEAL_CHARS = 64  # HMAC-SHA256 as hex
SEAL_SUFFIX = ".seal"  # config.yaml -> config.seal


def cache_dir() -> Path:
    """``$VIDEOTRAIN_CACHE`` or ``~/.cache/videotrain``: the rule of
    ``videotrain.data.layouts.default_cache_root`` (this layer imports no other module)."""
    return Path(os.environ.get("VIDEOTRAIN_CACHE", Path.home() / ".cache" / "videotrain"))


def key_path() -> Path:
    return cache_dir() / KEY_DIR / KEY_NAME


def _read_key(path: Path) -> bytes | None:
    """The key at ``path``, or None: absent (silently), or not a regular file of this user
    with mode 0600 and :data:`KEY_BYTES` bytes (one log line; never followed if a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as err:
        why = "a symbolic link" if err.errno == errno.ELOOP else f"unreadable ({err.strerror})"
        log.warning("the seal key %s is %s: not used, so no run reads as your own", shown(path), why)
        return None
    try:
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "not a regular file"
        elif st.st_uid != os.getuid():
            problem = "owned by another user"
        elif stat.S_IMODE(st.st_mode) != 0o600:
            problem = f"of mode {stat.S_IMODE(st.st_mode):o}, not 600"
        elif st.st_size != KEY_BYTES:
            problem = f"{st.st_size} bytes, not {KEY_BYTES}"
        if problem:
            log.warning("the seal key %s is %s: not used, so no run reads as your own (remove it "
                        "to have a new one made)", shown(path), problem)
            return None
        data = os.read(fd, KEY_BYTES + 1)
        return data if len(data) == KEY_BYTES else None
    finally:
        os.close(fd)


def _stale(folder: Path) -> bool:
    try:
        return time.time() - os.lstat(folder).st_mtime > STALE_S
    except OSError:
        return False


def _create_key(path: Path) -> None:
    """A new key at ``path``, whole or not at all. Its folder is claimed first (``mkdir`` is
    atomic): of processes starting at once (DDP ranks, a sweep's jobs) one writes the key
    (``files.atomic_writer``, mode 0600) and the others wait for it, so all seal with the same
    key; a claim whose maker died before writing is taken over after :data:`STALE_S`."""
    if make_new_dir(path.parent) or (not os.path.lexists(path) and _stale(path.parent)):
        with atomic_writer(path, mode=0o600, durable=True) as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        return
    deadline = time.monotonic() + KEY_WAIT_S
    while not os.path.lexists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def user_key(create: bool = False) -> bytes | None:
    """This user's seal key, made first when ``create`` (the trainer) and there is none;
    None where there is no usable one (:func:`_read_key`)."""
    path = key_path()
    key = _read_key(path)
    if key is None and create and not os.path.lexists(path):
        try:
            _create_key(path)
        except OSError as err:
            log.warning("cannot make the seal key %s (%s): this run is not sealed, and eval, "
                        "predict and export will read it as someone else's", shown(path),
                        err.strerror)
            return None
        key = _read_key(path)
        if key is None and not os.path.lexists(path):
            log.warning("no seal key appeared in %s (another process claimed the folder and wrote "
                        "none yet): this run is not sealed", shown(path.parent))
    return key


def canonical_json(obj: Any) -> bytes:
    """``obj`` (a config as plain values) as one byte string that the same values always give:
    sorted keys, no spaces, ASCII. What a checkpoint's ``config_seal`` is the seal of."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal(data: bytes) -> str | None:
    """HMAC-SHA256 (hex) of ``data`` under this user's key (made if there is none), or None
    when no key can be had (logged by :func:`user_key`)."""
    key = user_key(create=True)
    return hmac.new(key, data, hashlib.sha256).hexdigest() if key is not None else None


def is_sealed(data: bytes, given: Any) -> bool:
    """Whether ``given`` (read from a file: any value) is this user's seal of ``data``; a
    constant-time comparison. False without a key (none is made here)."""
    if not isinstance(given, str) or len(given) != SEAL_CHARS:
        return False
    key = user_key(create=False)
    if key is None:
        return False
    want = hmac.new(key, data, hashlib.sha256).hexdigest()
    return hmac.compare_digest(want.encode(), given.encode("ascii", "replace"))


def seal_config(config: Any) -> str | None:
    """The seal of a config as plain values (:func:`canonical_json`), what a checkpoint stores
    as ``config_seal``; None without a key or for values JSON does not hold."""
    try:
        data = canonical_json(config)
    except (TypeError, ValueError):
        return None
    return seal(data)


def is_sealed_config(config: Any, given: Any) -> bool:
    """Whether ``given`` (a checkpoint's ``config_seal``) is this user's seal of ``config``
    (its stored config, already checked to be plain values of bounded size)."""
    try:
        data = canonical_json(config)
    except (TypeError, ValueError):  # a key JSON cannot sort (mixed str and int), ...
        return False
    return is_sealed(data, given)


def seal_path(path: str | Path) -> Path:
    """Where the seal of ``path`` lies: ``config.yaml`` -> ``config.seal`` beside it."""
    return Path(path).with_suffix(SEAL_SUFFIX)


def write_seal(path: str | Path, data: bytes, root: str | Path | None = None) -> Path | None:
    """Write the seal of ``data`` (the exact bytes just written to ``path``) beside it
    (:func:`seal_path`, through the one writer ``files.write_text``, under the run folder
    ``root``); None, and nothing written, without a key."""
    value = seal(data)
    if value is None:
        return None
    return write_text(seal_path(path), value + "\n", root)


def is_sealed_file(path: str | Path, data: bytes) -> bool:
    """Whether ``data`` (the bytes read from ``path``) carries this user's seal beside it; a
    seal that is missing, a link, too large or not this user's is False."""
    try:
        given = read_text(seal_path(path), SEAL_CHARS + 2, "seal file")
    except (OSError, ValueError):
        return False
    return is_sealed(data, given.strip())
