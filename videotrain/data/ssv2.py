"""Something-Something v2 from its native JSON trio, over WebM (as shipped) or MP4 videos.

``labels.json`` maps each template with the brackets removed to its index
(``{"Putting something on a surface": "87", ...}``); ``train.json`` and ``validation.json``
are lists of ``{"id": "78687", "template": "Putting [something] on a surface", ...}``; the
videos are ``20bn-something-something-v2/<id>.webm``. The label rule (strip ``[`` and ``]``
from the template, look it up) is pytorchvideo's (``pytorchvideo.data.ssv2``), whose reader
itself expects frames extracted to JPEG plus a frame-list CSV, so it cannot read the videos.

Older releases name the files ``something-something-v2-{labels,train,validation}.json``; a
missing file's error names them (and the ``data.*_file`` settings, when they are there).

A bad entry is reported with its file *and line* (the official files hold one entry per
line), which ``json.load`` cannot give: the file is parsed by ``json.loads`` and walked entry
by entry only to find the line of an error (``json_array_entries``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

from videotrain.data.annotations import (
    TOO_DEEP,
    AnnotationError,
    VideoIndex,
    check_class_count,
    check_split,
    json_error,
    names_by_index,
    read_json_text,
    under,
    video_folder,
)
from videotrain.untrusted import shown

VIDEO_EXTS = ("webm", "mp4")
# the data keys of the three files, and their names in older releases
FILE_KEYS = {"labels": "data.labels_file", "train": "data.train_file", "validation": "data.val_file"}
OLD_NAMES = {part: f"something-something-v2-{part}.json" for part in FILE_KEYS}


_WHITESPACE = re.compile(r"[ \t\r\n]*")


def json_array_lines(path: Path) -> list[tuple[int, Any]]:
    """The entries of a top-level JSON array, each with the line it starts on.

    Linear in the file's size: line numbers are counted from the previous entry, not from the
    start of the file (which made the official 168,913-entry ``train.json`` take minutes)."""
    text = read_json_text(path)
    decoder = json.JSONDecoder()
    line, counted = 1, 0  # the line number at text offset `counted`

    def skip(i: int) -> int:
        return _WHITESPACE.match(text, i).end()

    def line_at(i: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, i)
        counted = i
        return line

    i = skip(0)
    if i >= len(text) or text[i] != "[":
        raise AnnotationError(f"{shown(path)}:1: expected a JSON array of videos")
    out: list[tuple[int, Any]] = []
    i = skip(i + 1)
    if i < len(text) and text[i] == "]":
        return out
    while True:
        try:
            entry, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as err:
            raise json_error(path, err, err.doc) from None
        except ValueError:  # an integer of more than 4300 digits
            raise AnnotationError(f"{shown(path)}:{line_at(i)}: a number too long to read "
                                  "(expected an object with 'id' and 'template')") from None
        except RecursionError:
            raise AnnotationError(f"{shown(path)}:{line_at(i)}: {TOO_DEEP}") from None
        out.append((line_at(i), entry))
        i = skip(end)
        if i < len(text) and text[i] == ",":
            i = skip(i + 1)
            continue
        if i < len(text) and text[i] == "]":
            if skip(i + 1) != len(text):
                raise AnnotationError(f"{shown(path)}:{line_at(i)}: data after the array")
            return out
        line = line_at(i)
        if i >= len(text):  # cut right after an entry: the ']' never came
            raise AnnotationError(f"{shown(path)}:{line}: the JSON ends early, after the entry on line "
                                  f"{out[-1][0]}: the file is truncated (an interrupted download "
                                  "or copy?); fetch it again")
        raise AnnotationError(f"{shown(path)}:{line}: expected ',' or ']' after the entry on line {out[-1][0]}")


def json_array_entries(path: Path) -> tuple[list[Any], Callable[[int], int]]:
    """The entries of a top-level JSON array and ``line_of(k)``, the line entry ``k`` starts on.

    ``json.loads`` reads the file (C speed: the official ``train.json`` of 168,913 entries in
    about a second); the line numbers, which only an error message needs, are found by walking
    the file with :func:`json_array_lines` when first asked for. A file ``json.loads`` rejects
    is walked at once, so its error names the line as before."""
    try:
        entries = json.loads(read_json_text(path))
    except (ValueError, RecursionError) as err:  # walked for the line of the error
        if isinstance(err, AnnotationError):
            raise
        entries = None
    if not isinstance(entries, list):
        numbered = json_array_lines(path)  # raises the error, with its line
        return [e for _, e in numbered], lambda k: numbered[k][0]
    lines: list[int] = []

    def line_of(k: int) -> int:
        if not lines:
            lines.extend(n for n, _ in json_array_lines(path))
        return lines[k]

    return entries, line_of


def require_json(root: Path, rel: str, key: str) -> Path:
    """``root/rel``, or a ``FileNotFoundError`` naming ``key`` and the older release's file
    names (``something-something-v2-labels.json``, ...), with the settings that read them
    when they are there."""
    path = under(root, rel)
    if path.is_file():
        return path
    found: dict[str, Path] = {}
    for part, name in OLD_NAMES.items():
        for candidate in (path.parent / name, root / name, root / "labels" / name):
            if candidate.is_file():
                found.setdefault(part, candidate)
    old = "something-something-v2-{labels,train,validation}.json"
    if found:
        settings = " ".join(f"{FILE_KEYS[part]}={_rel(p, root)}" for part, p in found.items())
        raise FileNotFoundError(f"{key}: annotation file not found: {shown(path)}; the older SSv2 release "
                                f"names its files {old}, and they are there: set {settings}")
    raise FileNotFoundError(f"{key}: annotation file not found: {shown(path)} (older SSv2 releases name "
                            f"the files {old}: point data.labels_file, data.train_file and "
                            "data.val_file at them)")


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def template_key(template: str) -> str:
    """pytorchvideo's rule: the template with its placeholder brackets removed."""
    return template.replace("[", "").replace("]", "")


def ssv2_index(
    root: str | Path,
    split: str,
    num_classes: int | None = None,
    *,
    labels_file: str = "labels/labels.json",
    train_file: str = "labels/train.json",
    val_file: str = "labels/validation.json",
    video_dir: str = "20bn-something-something-v2",
    video_ext: str = "auto",
) -> VideoIndex:
    """One split of SSv2. ``video_ext``: ``webm``, ``mp4``, or ``auto`` (per video, ``.webm``
    when it exists, else ``.mp4``)."""
    check_split(split)
    if video_ext not in (*VIDEO_EXTS, "auto"):
        raise ValueError(f"data.video_ext must be one of webm, mp4, auto; got {shown(video_ext)}")
    root = Path(root)
    # labels.json: template (brackets removed) -> index
    names = names_by_index(require_json(root, labels_file, "data.labels_file"), "template")
    index = {n: i for i, n in enumerate(names)}
    key = "data.train_file" if split == "train" else "data.val_file"
    path = require_json(root, train_file if split == "train" else val_file, key)
    videos = video_folder(root, video_dir, "data.video_dir")
    # one listing of the folder, not a stat per video (220,847 files in the full release)
    present = set(os.listdir(videos)) if video_ext == "auto" else set()
    items: list[tuple[str, int]] = []
    entries, line_of = json_array_entries(path)
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict) or "id" not in entry or "template" not in entry:
            raise AnnotationError(f"{shown(path)}:{line_of(k)}: expected an object with 'id' and "
                                  f"'template' (entry {k + 1} of the array)")
        label = index.get(template_key(str(entry["template"])))
        if label is None:
            raise AnnotationError(f"{shown(path)}:{line_of(k)}: expected a template listed in "
                                  f"{shown(under(root, labels_file))} (entry {k + 1}'s is not)")
        ext = video_ext
        if ext == "auto":
            ext = next((e for e in VIDEO_EXTS if f"{entry['id']}.{e}" in present), "webm")
        items.append((f"{entry['id']}.{ext}", label))
    if not items:
        raise AnnotationError(f"{shown(path)}: no videos")
    check_class_count(names, num_classes, str(under(root, labels_file)))
    return VideoIndex(LabeledVideoPaths(items, path_prefix=str(videos)), names, str(path))
