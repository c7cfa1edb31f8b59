"""Preflight at Kinetics size: the check of an unchanged annotation file is cached."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from videotrain.data.loaders import read_index
from videotrain.data.preflight import BadDataError, preflight


def write_split(root: Path, n: int, missing_every: int = 10) -> None:
    """A ``path label`` split of ``n`` generated names; every ``missing_every``-th video is
    missing, the others are links to one file."""
    (root / "videos").mkdir(parents=True)
    target = root / "one.mp4"
    target.write_bytes(b"not empty")
    lines = []
    for i in range(n):
        name = f"vid{i:06d}_000000_000010.mp4"
        lines.append(f"{name} {i % 400}")
        if i % missing_every:
            os.symlink(target, root / "videos" / name)
    (root / "train.csv").write_text("\n".join(lines) + "\n")


def test_second_start_reuses_the_check_of_100k_files(tmp_path: Path, caplog) -> None:
    root, cache = tmp_path / "k", tmp_path / "cache"
    write_split(root, 100_000)
    options = {"train_file": "train.csv", "path_prefix": "videos"}
    index = read_index("kinetics", root, "train", None, options)
    assert len(index) == 100_000
    first = preflight(index, max_bad_fraction=0.2, cache_dir=cache)
    assert len(first) == 10_000 and len(list((cache / "preflight").glob("*.json"))) == 1

    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="videotrain.data.preflight"):
        again = preflight(read_index("kinetics", root, "train", None, options), 0.2, cache_dir=cache)
    seconds = time.perf_counter() - t0
    assert again == first and "reused from" in caplog.text
    assert seconds < 2.0, f"second start-up's preflight (reading the split included): {seconds:.2f} s"

    # an edited annotation file is checked again
    with (root / "train.csv").open("a") as f:
        f.write("extra.mp4 0\n")
    edited = read_index("kinetics", root, "train", None, options)
    assert len(preflight(edited, 0.2, cache_dir=cache)) == 10_001
    assert len(list((cache / "preflight").glob("*.json"))) == 2


def test_too_many_bad_files_still_fail_from_the_cache(tmp_path: Path) -> None:
    root, cache = tmp_path / "k", tmp_path / "cache"
    write_split(root, 40, missing_every=2)
    index = read_index("kinetics", root, "train", None, {"path_prefix": "videos"})
    for _ in range(2):  # computed, then cached: the same verdict
        with pytest.raises(BadDataError, match="20 of 40 videos are unreadable"):
            preflight(index, 0.1, cache_dir=cache)


def test_restored_and_vanished_videos_are_noticed(tmp_path: Path, caplog) -> None:
    """The user reads "20 missing", downloads them, and starts again on the
    unchanged list: they are found (the cached bad files are checked again). A video removed
    since is found too (its folder changed), and the log says how to force a full check."""
    root, cache = tmp_path / "k", tmp_path / "cache"
    write_split(root, 200, missing_every=10)
    videos = root / "videos"
    os.utime(videos, ns=(10**18, 10**18))  # a known folder time, whatever the clock's granularity
    options = {"path_prefix": "videos"}
    index = read_index("kinetics", root, "train", None, options)
    first = preflight(index, max_bad_fraction=0.2, cache_dir=cache)
    assert len(first) == 20

    for path in first:  # the missing videos are downloaded
        Path(path).write_bytes(b"restored")
    os.utime(videos, ns=(10**18, 10**18))  # even where the folder's time did not move
    with caplog.at_level(logging.INFO, logger="videotrain.data.preflight"):
        assert preflight(read_index("kinetics", root, "train", None, options), 0.2, cache_dir=cache) == []
    assert "reused from" in caplog.text and "delete that file to check every video" in caplog.text

    gone = videos / "vid000001_000000_000010.mp4"
    gone.unlink()  # the folder's time moves: its videos are checked again
    assert preflight(read_index("kinetics", root, "train", None, options), 0.2,
                     cache_dir=cache) == [str(gone)]
    assert len(list((cache / "preflight").glob("*.json"))) == 1  # one annotation file, one entry
