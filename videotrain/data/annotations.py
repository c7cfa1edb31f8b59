"""Annotation readers: turn a dataset's on-disk layout into ``LabeledVideoPaths``.

pytorchvideo's own ``LabeledVideoPaths.from_csv`` fails with a bare ``ValueError`` on a bad
line; users with 240k-line Kinetics CSVs need the file and line number instead, so the
readers here parse lines themselves and hand pytorchvideo the validated list. This module has
the shared pieces and the Kinetics-style CSV and folder-per-class readers;
``split_files.py`` reads UCF101 and HMDB51, ``ssv2.py`` Something-Something v2.
"""

from __future__ import annotations

import codecs
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

from videotrain.untrusted import open_regular, read_bytes, shown
from videotrain.untrusted.bounds import (
    MAX_ANNOTATION_BYTES,
    MAX_ANNOTATION_JSON_BYTES,
    MAX_ANNOTATION_JSON_VALUES,
    MAX_ANNOTATION_LINE_CHARS,
    MAX_ANNOTATION_LINES,
)
from videotrain.untrusted.formats import json_problem

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".webm", ".mov")
SPLITS = ("train", "val")


class AnnotationError(ValueError):
    """A malformed annotation file; the message names the file and line."""


@dataclass
class VideoIndex:
    """One split: videos with integer labels, plus the class names of the dataset."""

    paths: LabeledVideoPaths
    class_names: list[str]
    source: str  # the annotation file or folder, for messages

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def labels(self) -> list[int]:
        return [int(label) for _, label in self.paths._paths_and_labels]


# byte-order marks of the encodings a re-saved annotation file may come in besides UTF-8
# (UTF-32 LE before UTF-16 LE: its mark starts with UTF-16 LE's)
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
              (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))
BOM = "\ufeff"


def _wide_bom(path: str | Path, head: bytes) -> None:
    """Refuse a file that starts with a UTF-16/32 byte-order mark (Excel's "Unicode Text")."""
    for mark, encoding in _WIDE_BOMS:
        if head.startswith(mark):
            raise AnnotationError(
                f"{shown(path)}: starts with a {encoding} byte-order mark (BOM): the file is {encoding} "
                "text (as Excel's 'Unicode Text' saves it); save it as UTF-8 (Excel: 'CSV UTF-8')")


def _not_utf8(path: str | Path, line: int, byte: int) -> AnnotationError:
    return AnnotationError(f"{shown(path)}:{line}: byte 0x{byte:02x} is not UTF-8 (saved as Latin-1 or "
                           "Windows-1252?); save the file as UTF-8")


def _inner_bom(path: str | Path, line: int) -> AnnotationError:
    return AnnotationError(
        f"{shown(path)}:{line}: a byte-order mark (BOM, U+FEFF) inside the file, not at its start "
        "(were files re-saved by Excel concatenated?); delete it")


def read_text(path: str | Path, limit: int = MAX_ANNOTATION_BYTES) -> str:
    """The text of an annotation file, as every reader gets it: UTF-8, with or without the
    byte-order mark (BOM) that Excel puts in front of a CSV it re-saves, so that the first
    column's name or the first path is never read as ``\\ufefflabel``. A UTF-16/32 file (a BOM
    of those, as Excel's "Unicode Text" writes), bytes that are not UTF-8, and a BOM inside the
    file (files with BOMs concatenated) are errors naming the file and line, and the BOM as a
    BOM."""
    # a regular file (behind links, as datasets often are), never a FIFO or device, bounded
    data = read_bytes(path, limit, "annotation file", follow=True)
    _wide_bom(path, data)
    try:
        text = data.decode("utf-8-sig")  # drops one leading UTF-8 BOM
    except UnicodeDecodeError as err:
        raise _not_utf8(path, data.count(b"\n", 0, err.start) + 1, data[err.start]) from None
    if BOM in text:
        raise _inner_bom(path, text.count("\n", 0, text.index(BOM)) + 1)
    return text


def _count_lines(f: IO[bytes], path: str | Path) -> None:
    """Refuse a file of more than ``MAX_ANNOTATION_LINES`` lines (LF, CRLF or CR alone), counted
    in chunks before any line is parsed: a file of short lines costs a count, not a list."""
    lf = cr = 0
    while chunk := f.read(1 << 20):
        lf, cr = lf + chunk.count(b"\n"), cr + chunk.count(b"\r")
        if max(lf, cr) > MAX_ANNOTATION_LINES:
            raise AnnotationError(f"{shown(path)}: more than {MAX_ANNOTATION_LINES} lines (the "
                                  "bound of one annotation list); not read further")
    f.seek(0)


def _bad_byte_line(f: IO[bytes]) -> tuple[int, int]:
    """(line, byte) of the first byte of ``f`` that is not UTF-8, read again in chunks (only for
    the error: the text reader decodes ahead of the line it returns)."""
    f.seek(0)
    decoder, lines = codecs.getincrementaldecoder("utf-8")(), 0
    while chunk := f.read(1 << 20):
        pending = decoder.getstate()[0]
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as err:
            data = pending + chunk
            return lines + data.count(b"\n", 0, err.start) + 1, data[err.start]
        lines += chunk.count(b"\n")
    return lines + 1, 0


def annotation_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, text without its line end)`` of each line of an annotation file, read
    as :func:`read_text` reads it (UTF-8, one leading BOM dropped, the same errors), but one
    line at a time: memory follows the rows a reader keeps, not the file. Before any line is
    parsed the file's size and its lines are bounded (``MAX_ANNOTATION_BYTES``,
    ``MAX_ANNOTATION_LINES``); a line of more than ``MAX_ANNOTATION_LINE_CHARS`` is refused
    unread. Errors name the file, the line and the bound, never the text."""
    with open_regular(path, MAX_ANNOTATION_BYTES, "annotation file", follow=True) as f:
        _count_lines(f, path)
        _wide_bom(path, f.read(4))
        f.seek(0)
        # universal newlines: LF, CRLF and a CR alone (old Mac Excel) each end a line
        text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="strict", newline=None)
        lineno = 0
        try:
            while line := text.readline(MAX_ANNOTATION_LINE_CHARS + 1):
                lineno += 1
                body = line[:-1] if line.endswith("\n") else line
                if len(body) > MAX_ANNOTATION_LINE_CHARS:
                    raise AnnotationError(f"{shown(path)}:{lineno}: a line longer than "
                                          f"{MAX_ANNOTATION_LINE_CHARS} characters (the bound of "
                                          "one annotation line); not read further")
                if BOM in body:
                    raise _inner_bom(path, lineno)
                yield lineno, body
        except UnicodeDecodeError:
            text.detach()
            raise _not_utf8(path, *_bad_byte_line(f)) from None


def nonblank_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, stripped text) of the non-blank lines of :func:`annotation_lines`."""
    for lineno, raw in annotation_lines(path):
        if raw.strip():
            yield lineno, raw.strip()


def parent_name(rel: str) -> str:
    """``PurePosixPath(rel).parent.name`` by string operations (a path object per line made the
    9,537-line trainlist take 10x as long as reading it)."""
    head, sep, name = rel.rpartition("/")
    if sep and head and "/" not in head and head != "." and name not in ("", "."):  # "Class/v_x.avi"
        return head
    parts = [p for p in rel.split("/") if p and p != "."]
    return parts[-2] if len(parts) > 1 else ""


TOO_DEEP = "nested too deep (expected a flat list or mapping of entries)"


def read_json_text(path: str | Path) -> str:
    """The text of an annotation JSON (SSv2's lists, a class map), as :func:`read_text` reads
    it, within ``MAX_ANNOTATION_JSON_BYTES``, its values counted before ``json`` parses it (a
    few MB of ``{},`` would otherwise be gigabytes of objects). Its nesting is not walked here
    (that doubled the cost of SSv2's train.json): ``json`` meets deep nesting as a
    ``RecursionError``, which the readers turn into :data:`TOO_DEEP`."""
    text = read_text(path, MAX_ANNOTATION_JSON_BYTES)
    problem = json_problem(text, MAX_ANNOTATION_JSON_VALUES, max_depth=len(text))
    if problem:
        raise AnnotationError(f"{shown(path)}: {problem} (the bound of an annotation JSON); "
                              "not read further")
    return text


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {shown(split)}")


def under(root: Path, rel: str | None) -> Path:
    """``rel`` resolved against ``root`` (absolute paths and ``~`` stay); None or "" is root."""
    if rel is None or rel == "":
        return root
    path = Path(rel).expanduser()
    return path if path.is_absolute() else root / path


def video_folder(root: Path, rel: str | None, key: str) -> Path:
    """The folder of the videos, ``rel`` under ``root`` (``key``: the setting that names it)."""
    path = under(root, rel)
    if not path.is_dir():
        raise FileNotFoundError(f"{key}: video folder not found: {shown(path)}")
    return path


def check_class_count(names: list[str], num_classes: int | None, source: str,
                      verb: str = "lists") -> None:
    """A set ``data.num_classes`` must agree with the classes the dataset's own files name."""
    if num_classes and num_classes != len(names):
        raise AnnotationError(f"{shown(source)} {verb} {len(names)} classes, but "
                              f"data.num_classes={num_classes}")


def require_file(path: Path, key: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{key}: annotation file not found: {shown(path)}")
    return path


def read_class_names(path: Path) -> list[str]:
    """One name per line (blank lines skip), or a JSON object ``{name: index}``."""
    if path.suffix == ".json":
        names = names_by_index(path, "class name")
    else:
        names = [line for _, line in nonblank_lines(path)]
    if len(set(names)) != len(names):  # which, by position: the file's text is never echoed
        first: dict[str, int] = {}
        for k, name in enumerate(names, 1):
            if name in first:
                raise AnnotationError(f"{shown(path)}: duplicate class names (names {first[name]} "
                                      f"and {k} are the same; one name per line, each once)")
            first[name] = k
    if not names:
        raise AnnotationError(f"{shown(path)}: no class names")
    return names


def names_by_index(path: Path, key: str) -> list[str]:
    """A JSON object ``{name: index}`` (a class list, SSv2's ``labels.json``) -> the names in
    index order; every index an integer, each of ``0..n-1`` once. Errors name the file and the
    entry's position, never its text."""
    expected = f"expected a JSON object {{{key}: index}}"
    text = read_json_text(path)
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as err:
        raise json_error(path, err, text) from None
    except ValueError:  # an integer of more than 4300 digits
        raise AnnotationError(f"{shown(path)}: a number too long to read ({expected})") from None
    except RecursionError:
        raise AnnotationError(f"{shown(path)}: {TOO_DEEP}") from None
    if not isinstance(mapping, dict) or not mapping:
        raise AnnotationError(f"{shown(path)}: {expected}")
    names: dict[int, str] = {}
    for name, idx in mapping.items():
        try:
            value = int(idx)
        except (TypeError, ValueError):
            raise AnnotationError(f"{shown(path)}: the index of entry {len(names) + 1} is not an "
                                  f"integer ({expected})") from None
        if value in names:
            raise AnnotationError(f"{shown(path)}: index {value} is used twice (expected each "
                                  "index once)")
        names[value] = name
    if sorted(names) != list(range(len(names))):
        raise AnnotationError(f"{shown(path)}: indices must be 0..{len(names) - 1}, each once")
    return [names[i] for i in range(len(names))]


def json_error(path: Path, err: json.JSONDecodeError, text: str) -> AnnotationError:
    """``file:line:col: invalid JSON (...)``; a file that ends inside a value is called
    truncated (an interrupted download), since that is what to fix."""
    if err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string"):
        return AnnotationError(f"{shown(path)}:{err.lineno}:{err.colno}: the JSON ends early: the file "
                               f"is truncated ({len(text.encode())} bytes; an interrupted download "
                               "or copy?); fetch it again")
    return AnnotationError(f"{shown(path)}:{err.lineno}:{err.colno}: invalid JSON ({err.msg})")


RELEASE_COLUMNS = ("youtube_id", "time_start", "time_end")


def release_csv_hint(path: Path, lineno: int, line: str) -> None:
    """An official Kinetics release CSV (``label,youtube_id,time_start,...``) given where a
    ``path label`` list is read: say how to convert it, not that ``is_cc`` is no integer."""
    fields = [f.strip().strip('"').lower() for f in line.split(",")]
    if all(c in fields for c in RELEASE_COLUMNS):
        raise AnnotationError(
            f"{shown(path)}:{lineno}: this is an official Kinetics release CSV (its header names "
            "youtube_id, time_start, time_end); data=kinetics reads 'path label' lists: convert "
            "it first with python -m "
            f"videotrain.prepare kinetics --csv {shown(path)} --videos VIDEO_DIR --out DIR, then "
            "data.root=DIR")


def parse_label_csv(path: Path) -> list[tuple[str, int]]:
    """Parse ``relative/path.mp4 label`` (or ``path,label``) lines; blank and ``#`` lines skip."""
    items = []
    for lineno, line in nonblank_lines(path):
        if line.startswith("#"):
            continue
        if not items:
            release_csv_hint(path, lineno, line)
        parts = line.rsplit(",", 1) if "," in line else line.rsplit(None, 1)
        if len(parts) != 2:
            raise AnnotationError(f"{shown(path)}:{lineno}: expected 'path label' (a video path "
                                  "and an integer label, split by a comma or spaces)")
        rel, label = parts[0].strip(), parts[1].strip()
        try:
            value = int(label)
        except ValueError:
            raise AnnotationError(f"{shown(path)}:{lineno}: expected 'path label': the label "
                                  "(the last field) is not an integer") from None
        if value < 0 or not rel:
            raise AnnotationError(f"{shown(path)}:{lineno}: expected 'path label': an empty path "
                                  "or a negative label")
        items.append((rel, value))
    if not items:
        raise AnnotationError(f"{shown(path)}: no annotation lines")
    return items


def folder_class_names(items: list[tuple[str, int]], n: int) -> list[str] | None:
    """Class names from the folder each label's videos sit in (``abseiling/x.mp4 0``), when
    every label has exactly one folder and no two labels share one; else None."""
    folders: dict[int, set[str]] = {}
    for rel, label in items:
        parent = parent_name(rel.replace("\\", "/"))
        if not parent:
            return None
        folders.setdefault(label, set()).add(parent)
    if any(len(f) != 1 for f in folders.values()):
        return None
    names = {label: next(iter(f)) for label, f in folders.items()}
    if len(set(names.values())) != len(names):
        return None
    return [names.get(i, str(i)) for i in range(n)]


def kinetics_index(
    root: str | Path,
    split: str,
    num_classes: int | None = None,
    *,
    train_file: str = "train.csv",
    val_file: str = "val.csv",
    path_prefix: str | None = None,
    classes_file: str | None = None,
) -> VideoIndex:
    """``ROOT/{train_file|val_file}`` with ``path label`` lines. Paths are relative to
    ``path_prefix`` (itself relative to ROOT; default ROOT). Class names come from
    ``classes_file`` (default ``ROOT/classes.txt`` when it exists), else from the folder each
    label's videos are in, else they are the label numbers."""
    check_split(split)
    root = Path(root)
    key = "data.train_file" if split == "train" else "data.val_file"
    csv = require_file(under(root, train_file if split == "train" else val_file), key)
    items = parse_label_csv(csv)
    names_file = under(root, classes_file) if classes_file is not None else root / "classes.txt"
    if classes_file is not None:
        require_file(names_file, "data.classes_file")
    names = read_class_names(names_file) if names_file.is_file() else None
    inferred = max(label for _, label in items) + 1
    n = num_classes or (len(names) if names else inferred)
    for k, (_, label) in enumerate(items, 1):
        if label >= n:
            counted = (f"; {shown(names_file)} lists {len(names)} class names" if names
                       and not num_classes else "")
            raise AnnotationError(f"{shown(csv)}: label {label} of annotation {k} is outside "
                                  f"num_classes={n}{counted}")
    names = names or folder_class_names(items, n) or [str(i) for i in range(n)]
    if len(names) != n:
        raise AnnotationError(f"{shown(names_file)}: lists {len(names)} classes, expected {n}")
    prefix = video_folder(root, path_prefix, "data.path_prefix")
    return VideoIndex(LabeledVideoPaths(items, path_prefix=str(prefix)), names, str(csv))


def folder_index(root: str | Path, split: str) -> VideoIndex:
    """``ROOT/{split}/<class>/*.mp4``; classes are the sorted folder names."""
    check_split(split)
    base = Path(root) / split
    if not base.is_dir():
        raise FileNotFoundError(f"data.root: split folder not found: {shown(base)}")
    names = sorted(d.name for d in base.iterdir() if d.is_dir())
    if not names:
        raise AnnotationError(f"{shown(base)}: no class folders")
    items = [
        (str(p), label)
        for label, name in enumerate(names)
        for p in sorted((base / name).iterdir())
        if p.suffix.lower() in VIDEO_EXTENSIONS
    ]
    if not items:
        raise AnnotationError(f"{shown(base)}: no video files ({', '.join(VIDEO_EXTENSIONS)})")
    return VideoIndex(LabeledVideoPaths(items), names, str(base))
