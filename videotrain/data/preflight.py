"""The preflight: every listed video is stat-ed before training, so that missing and empty
files are reported at the start, once per split (a count, the first few, and the full list in
the run folder), and not one by one mid-epoch; the result is cached per annotation file and
re-checked where the videos may have changed (restored or removed since)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from videotrain.data import annotations
from videotrain.untrusted.files import write_text

log = logging.getLogger(__name__)


class BadDataError(RuntimeError):
    """Too many unreadable videos in a split (more than ``data.max_bad_fraction``)."""


def preflight(index: annotations.VideoIndex, max_bad_fraction: float,
              cache_dir: Path | None = None, split: str = "train",
              report_dir: Path | None = None) -> list[str]:
    """Stat every file: missing and zero-byte videos are reported now, not mid-epoch.

    The result is cached per annotation file (``cache_dir/preflight/``, keyed by the file's
    path, mtime and size and the paths it lists), with the modification times of the folders
    the videos are in. A run that starts again on an unchanged split re-checks only the files
    found bad last time and the videos of folders that changed since (a video added, restored
    or removed changes its folder's time), not hundreds of thousands of files. A video that
    goes bad in place later is still caught when it is decoded.

    Bad videos are logged as one warning (a count and the first few) and listed in full in
    ``report_dir/missing_videos_<split>.txt`` (the run folder)."""
    paths = [p for p, _ in index.paths]
    cache = _preflight_cache(index, cache_dir)
    folders = sorted({os.path.dirname(p) for p in paths})
    times = _mtimes(folders)  # before the files: a change while they are stat-ed is seen next time
    saved = _read_cache(cache)
    if saved is None:
        bad = _missing_or_empty(paths)
        how = "every file checked"
        changed: set[str] = set()
    else:
        changed = {d for d in folders if saved["folders"].get(d) != times[d]}
        before = set(saved["bad"])
        bad = _missing_or_empty([p for p in paths if p in before or os.path.dirname(p) in changed])
        how = (f"reused from {cache} (the annotation file is unchanged): checked again the "
               f"{len(before)} file(s) bad last time and the videos of the {len(changed)} of "
               f"{len(folders)} folder(s) changed since; delete that file to check every video")
    if cache is not None and (saved is None or changed or bad != saved["bad"]):
        assert cache_dir is not None  # a cache file is only named under a cache folder
        # the user's own cache folder is followed as given; below it (preflight/) no link is,
        # and the file is renamed into place: a concurrent reader sees all of it or nothing
        own = Path(cache_dir).resolve()
        write_text(own / cache.relative_to(cache_dir),
                   json.dumps({"source": index.source, "videos": len(index), "bad": bad,
                               "folders": times}), root=own)
    log.info("preflight of %s: %d files, %d missing or empty; %s", index.source, len(index),
             len(bad), how)
    listing = report_bad(bad, len(index), index.source, split, report_dir)
    detail = f"they are listed in {listing}" if listing else None
    if saved is not None:
        detail = f"{detail or 'see the warning above'}; preflight {how}"
    check_bad_fraction(len(bad), len(index), index.source, max_bad_fraction, detail)
    return bad


def _missing_or_empty(paths: list[str]) -> list[str]:
    bad = []
    for path in paths:
        try:
            if os.stat(path).st_size == 0:
                bad.append(path)
        except OSError:
            bad.append(path)
    return bad


def _mtimes(folders: list[str]) -> dict[str, int | None]:
    """Each folder's modification time (ns; None where it does not exist)."""
    times: dict[str, int | None] = {}
    for folder in folders:
        try:
            times[folder] = os.stat(folder or ".").st_mtime_ns
        except OSError:
            times[folder] = None
    return times


def _read_cache(cache: Path | None) -> dict[str, Any] | None:
    """A cached preflight (None: none, unreadable, or from a version without folder times)."""
    if cache is None or not cache.exists():
        return None
    try:
        saved = json.loads(cache.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return saved if isinstance(saved, dict) and "folders" in saved and "bad" in saved else None


def missing_list(report_dir: str | Path, split: str) -> Path:
    """Where a split's missing or empty videos are listed in full (the run folder)."""
    return Path(report_dir) / f"missing_videos_{split}.txt"


SHOWN_BAD = 5  # bad videos named in the log; all of them go to the run folder's list


def report_bad(bad: list[str], listed: int, source: str, split: str,
               report_dir: Path | None) -> Path | None:
    """One warning for a split's missing or empty videos (a count and the first few, not a line
    per file: a partial Kinetics download has hundreds of thousands), and the full list in
    ``report_dir/missing_videos_<split>.txt``; returns that file (None: nothing written)."""
    if not bad:
        return None
    listing = None
    if report_dir is not None:
        listing = missing_list(report_dir, split)
        # the run folder: no link at it or in it is followed (the one writer refuses it)
        write_text(listing, "".join(f"{p}\n" for p in bad), root=report_dir)
    shown = ", ".join(bad[:SHOWN_BAD]) + (", ..." if len(bad) > SHOWN_BAD else "")
    log.warning("%s: %d of %d listed videos are missing or empty (%s); %s", source, len(bad),
                listed, shown, f"all {len(bad)} are listed in {listing}" if listing
                else "skipping them")
    return listing


def _preflight_cache(index: annotations.VideoIndex, cache_dir: Path | None) -> Path | None:
    """Where the preflight of ``index`` is cached; None where its source is not one file."""
    source = Path(index.source)
    if cache_dir is None or not source.is_file() or not len(index):
        return None
    st = source.stat()
    first, last = index.paths[0][0], index.paths[len(index) - 1][0]
    key = f"{source.resolve()}|{st.st_mtime_ns}|{st.st_size}|{len(index)}|{first}|{last}"
    return cache_dir / "preflight" / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.json"


def check_bad_fraction(num_bad: int, total: int, source: str, max_bad_fraction: float,
                       detail: str | None = None) -> None:
    if total and num_bad / total > max_bad_fraction:
        raise BadDataError(
            f"{source}: {num_bad} of {total} videos are unreadable "
            f"({num_bad / total:.0%} > data.max_bad_fraction={max_bad_fraction}); "
            f"{detail or 'see the warnings above for the files'}"
        )


