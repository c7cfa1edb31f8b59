"""The official Kinetics release CSVs -> the project's Kinetics layout (``data=kinetics``).

Input: ``label,youtube_id,time_start,time_end,split`` rows (Kinetics-400/600/700, BOM or not)
and the downloaded videos as the standard downloaders name them, anywhere under one folder
(CVDF ``replacement/`` files win; empty files count as missing). Output in ``OUT``:
``train.csv`` / ``val.csv`` / ``test.csv`` (``path label``; unlabelled splits get
``<split>_videos.txt``), ``classes.txt`` (sorted, reused by later conversions) and
``missing_<split>.csv`` in the release's format, for a downloader. Details:
docs/design/internals.md#preparing-kinetics."""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from videotrain.data.annotations import (
    VIDEO_EXTENSIONS,
    AnnotationError,
    annotation_lines,
    nonblank_lines,
)
from videotrain.prepare.reencode import EncodeResult, EncodeSettings, encode_all
from videotrain.untrusted import shown
from videotrain.untrusted.files import make_dirs, remove, write_text

SPLIT_NAMES = {"train": "train", "training": "train", "val": "val", "valid": "val",
               "validate": "val", "validation": "val", "test": "test", "testing": "test"}
REQUIRED = ("youtube_id", "time_start", "time_end")
# preferred when one video is there in several containers
EXTENSION_ORDER = (".mp4", ".mkv", ".webm", ".avi", ".mov")
# a folder whose name starts so holds re-downloads of corrupted originals (the CVDF release's
# replacement/replacement_for_corrupted_k400/): its file wins wherever it sorts
REPLACEMENT = "replacement"
FOUND_WARNING = 0.9  # a split with fewer of its videos found gets a warning


class KineticsCsvError(ValueError):
    """A release CSV this converter cannot read; the message names the file, the line and what
    was expected, never the line's text (a CSV may be a link to any file of the user's)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One video of a release CSV."""

    youtube_id: str
    time_start: int
    time_end: int
    split: str  # train | val | test
    label: str | None  # None: the split has no labels
    # the CSV row as read: its values, and its file's header (one tuple shared by all its rows:
    # a dict per row made 545,000 rows cost twice the memory)
    values: tuple[str, ...] = field(compare=False, hash=False)
    fields: tuple[str, ...] = field(compare=False, hash=False)

    @property
    def raw(self) -> dict[str, str]:
        """The CSV row as read, by column name."""
        return dict(zip(self.fields, self.values, strict=True))

    @property
    def stem(self) -> str:
        """The file name the standard downloaders give the clip, without extension."""
        return f"{self.youtube_id}_{self.time_start:06d}_{self.time_end:06d}"


def _seconds(value: str, where: str, column: str) -> int:
    try:
        return int(float(value))
    except (ValueError, OverflowError):  # by column: the value itself is never shown
        raise KineticsCsvError(f"{where}: {column} is not a number of seconds") from None


def split_of(value: str | None, csv_path: Path, where: str) -> str:
    """The split a row belongs to: its split column, else the CSV's file name
    (``validate.csv`` -> ``val``)."""
    name = (value or "").strip().lower() or csv_path.stem.lower()
    if name not in SPLIT_NAMES:
        raise KineticsCsvError(f"{where}: the split ({'its split column' if value else 'the file name'})"
                               f" is not one of {', '.join(sorted(set(SPLIT_NAMES)))}")
    return SPLIT_NAMES[name]


def read_release_csv(path: str | Path) -> list[Row]:
    """Rows of an official release CSV (quoted labels with commas and spaces are fine; a row
    with more or fewer fields than the header, as an unquoted comma in a label makes, is an
    error naming its line). A train or val row must have a label. Read a line at a time within
    the annotation bounds (``annotations.annotation_lines``: size, lines, line length)."""
    path = Path(path)
    lines = annotation_lines(path)  # the BOM of a CSV re-saved by Excel is not part of 'label'
    reader = csv.reader(f"{line}\n" for _, line in lines)  # a quoted label keeps its newline
    try:
        fields = tuple(c.strip() for c in next(reader, []))
        missing = [c for c in REQUIRED if c not in fields]
        if missing:  # by the columns expected: the header's own text is never shown
            raise KineticsCsvError(
                f"{shown(path)}:{reader.line_num}: the header (of {len(fields)} columns) lacks "
                f"{', '.join(missing)} (expected label,youtube_id,time_start,time_end,split)")
        at = {name: fields.index(name) for name in (*REQUIRED, "label", "split") if name in fields}
        rows, name = [], shown(path)
        for values in reader:
            where = f"{name}:{reader.line_num}"
            row = tuple(map(str.strip, values))
            if not any(row):
                continue
            if len(row) != len(fields):
                raise KineticsCsvError(
                    f"{where}: {len(row)} fields, expected {len(fields)} as in the header; a "
                    "label with a comma must be quoted (\"riding, mountain bike\")")
            if not row[at["youtube_id"]]:
                raise KineticsCsvError(f"{where}: empty youtube_id")
            split = split_of(row[at["split"]] if "split" in at else None, path, where)
            label = (row[at["label"]] if "label" in at else "") or None
            if label is None and split != "test":
                raise KineticsCsvError(
                    f"{where}: a {split} row without a label" if "label" in at else
                    f"{shown(path)}: the {split} split has no label column; only a test split "
                    "may come without labels")
            rows.append(Row(row[at["youtube_id"]],
                            _seconds(row[at["time_start"]], where, "time_start"),
                            _seconds(row[at["time_end"]], where, "time_end"), split, label,
                            row, fields))
    except AnnotationError as err:  # a bound, a BOM, bytes that are not UTF-8
        raise KineticsCsvError(str(err)) from None
    except csv.Error as err:  # e.g. a NUL byte; by line, without the text
        raise KineticsCsvError(f"{shown(path)}:{reader.line_num}: not a CSV line "
                               f"({type(err).__name__})") from None
    if not rows:
        raise KineticsCsvError(f"{shown(path)}: no rows")
    return rows


@dataclass
class VideoFiles:
    """The video files under a folder, by name without extension (``index_videos``)."""

    by_stem: dict[str, str]
    empty: list[str]  # 0-byte files (an interrupted download): never used

    def __len__(self) -> int:
        return len(self.by_stem)


def _is_replacement(dirpath: str, top: str) -> bool:
    rel = os.path.relpath(dirpath, top)
    return any(part.lower().startswith(REPLACEMENT) for part in Path(rel).parts)


def index_videos(video_dir: str | Path) -> VideoFiles:
    """Every non-empty video file under ``video_dir`` (any depth) by its name without
    extension. When a name is there more than once: a file under a ``replacement*`` folder (the
    CVDF release's re-downloads of corrupted originals) first, then the first container of
    ``EXTENSION_ORDER``, then path order. Paths stay strings (650k of them for K700)."""
    found: dict[str, tuple[tuple[int, int], str]] = {}
    empty: list[str] = []
    rank = {ext: i for i, ext in enumerate(EXTENSION_ORDER)}
    for dirpath, dirnames, filenames in os.walk(video_dir):
        dirnames.sort()
        replaced = 0 if _is_replacement(dirpath, str(video_dir)) else 1
        for name in sorted(filenames):
            stem, ext = os.path.splitext(name)
            ext = ext.lower()
            if ext not in VIDEO_EXTENSIONS or name.startswith("."):  # .x.part-*: partial files
                continue
            key = (replaced, rank.get(ext, 99))
            have = found.get(stem)
            if have is not None and have[0] <= key:
                continue  # a preferred file of this name is there already
            path = os.path.join(dirpath, name)
            if os.stat(path).st_size == 0:
                empty.append(path)
                continue
            found[stem] = (key, path)
    return VideoFiles({stem: path for stem, (_, path) in found.items()}, empty)


def single_row_ids(rows: Iterable[Row]) -> set[str]:
    """The YouTube ids with one row only: for them alone a bare ``{id}.mp4`` is unambiguous
    (53 ids of K700's validate.csv have two segments with different labels)."""
    count: dict[str, int] = {}
    for r in rows:
        count[r.youtube_id] = count.get(r.youtube_id, 0) + 1
    return {vid for vid, n in count.items() if n == 1}


def find_video(row: Row, videos: VideoFiles, single: set[str]) -> tuple[Path | None, bool]:
    """The downloaded file of ``row``: ``{id}_{start:06d}_{end:06d}.*``, else ``{id}.*`` when
    the id has one row (``single``); and whether it was the bare id."""
    path = videos.by_stem.get(row.stem)
    if path is None and row.youtube_id in single:
        bare = videos.by_stem.get(row.youtube_id)
        return (Path(bare), True) if bare is not None else (None, False)
    return (Path(path) if path is not None else None), False


def class_names(rows: Iterable[Row], out: Path) -> list[str]:
    """Sorted labels of ``rows``; an existing ``out/classes.txt`` is kept when it names them
    all (a later CSV must not renumber the classes of lists already written)."""
    labels = sorted({r.label for r in rows if r.label is not None})
    existing = out / "classes.txt"
    if existing.is_file():
        try:
            names = [ln for _, ln in nonblank_lines(existing)]
        except AnnotationError as err:
            raise KineticsCsvError(str(err)) from None
        unknown = set(labels) - set(names)
        if unknown:  # counted, not named: a label is a CSV's text
            raise KineticsCsvError(
                f"{shown(existing)} does not list {len(unknown)} label(s) of these CSVs: convert "
                "every split in one call (--csv train.csv --csv validate.csv ...) or remove it")
        return names
    return labels


def list_path(path: Path, out: Path) -> str:
    """How a list line names ``path``: relative to ``out`` if inside it, else absolute."""
    path = path.absolute()
    try:
        return path.relative_to(out.absolute()).as_posix()
    except ValueError:
        return str(path)


def list_line(rel: str, label: int) -> str:
    """``path label``; ``path,label`` when the path has a comma (the reader splits at the
    last comma when the line has one, else at the last space)."""
    return f"{rel},{label}\n" if "," in rel else f"{rel} {label}\n"


@dataclass
class SplitSummary:
    split: str
    listed: int
    found: int
    missing: int
    failed: int = 0
    written: list[str] = field(default_factory=list)

    @property
    def low(self) -> bool:
        """Fewer than ``FOUND_WARNING`` of the split's videos are in its list."""
        return self.found < FOUND_WARNING * self.listed

    def warning(self, video_dir: str | Path, out: Path) -> str:
        """What a user who found only part of a split must not miss."""
        text = (f"{self.split}: only {self.found} of the {self.listed} listed videos "
                f"({self.found / max(self.listed, 1):.1%}) were found")
        if self.missing + self.failed:
            text += (f"; the other {self.missing + self.failed} are in "
                     f"{out / f'missing_{self.split}.csv'}")
        return text + f" (is --videos {video_dir} the folder the downloader wrote to, and is it complete?)"

    def line(self) -> str:
        text = (f"{self.split}: {self.listed} listed, {self.found} in the lists "
                f"({self.found / max(self.listed, 1):.1%}), {self.missing} missing")
        if self.failed:
            text += f", {self.failed} failed to re-encode"
        return text + (f" -> {', '.join(self.written)}" if self.written else "")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def prepare_kinetics(csvs: list[str | Path], video_dir: str | Path, out: str | Path,
                     resize: int | None = None, workers: int = 1,
                     settings: EncodeSettings | None = None,
                     log: Callable[[str], None] = print,
                     warn: Callable[[str], None] = _warn) -> list[SplitSummary]:
    """Write the lists (and with ``resize``, the re-encoded videos under
    ``out/videos_<resize>/<split>/``) for the rows of ``csvs``; returns one summary per split.
    ``warn`` (default: a ``warning:`` line on stderr) gets each split with fewer than
    ``FOUND_WARNING`` of its videos found."""
    out = Path(out)
    # --out is the user's own folder (followed as given, created where missing); below it every
    # file goes through the one writer, and no link is followed (videos_<N>/ included)
    own = out.resolve()
    make_dirs(own, root=own)
    if not Path(video_dir).is_dir():
        raise FileNotFoundError(f"--videos: folder not found: {video_dir}")
    rows = [r for c in csvs for r in read_release_csv(c)]
    names = class_names(rows, out)
    index = {n: i for i, n in enumerate(names)}
    videos = index_videos(video_dir)
    log(f"{len(rows)} rows in {len(csvs)} CSV(s), {len(names)} classes, {len(videos)} video "
        f"files under {video_dir}")
    if videos.empty:
        log(f"{len(videos.empty)} empty (0-byte) video file(s) ignored, their rows count as "
            f"missing: {', '.join(videos.empty[:3])}"
            f"{' ...' if len(videos.empty) > 3 else ''}")
    single = single_row_ids(rows)
    matched = {r: find_video(r, videos, single) for r in rows}
    found = {r: path for r, (path, _) in matched.items()}
    bare = sum(by_id for _, by_id in matched.values())
    if bare:
        log(f"{bare} row(s) matched a file named by the bare YouTube id ({{youtube_id}}.mp4, "
            "no segment in the name; used only for ids with one row)")
    failed: dict[Row, str] = {}
    if resize:
        settings = settings or EncodeSettings(short_side=resize)
        todo = [r for r in rows if found[r] is not None]
        dsts = {r: out / f"videos_{resize}" / r.split / f"{r.stem}.mp4" for r in todo}

        def progress(res: EncodeResult, done: int, total: int) -> None:
            if res.status == "failed":
                log(f"  failed to re-encode {res.src}: {res.error}")
            if done % 500 == 0 or done == total:
                log(f"  re-encoded {done}/{total}")

        for split in dict.fromkeys(r.split for r in todo):  # a link: refused before any encode
            make_dirs(own / f"videos_{resize}" / split, root=own)
        results = encode_all([(str(found[r]), str(own / dsts[r].relative_to(out))) for r in todo],
                             settings, workers, progress, root=own)
        skipped = sum(res.status == "skipped" for res in results)
        log(f"re-encoding to a {resize} px short side: {len(results) - skipped} done now, "
            f"{skipped} already there (resumed), "
            f"{sum(res.status == 'failed' for res in results)} failed")
        for r, res in zip(todo, results, strict=True):
            if res.status == "failed":
                failed[r] = res.error or "failed"
                found[r] = None
            else:
                found[r] = dsts[r]
    summaries = []
    for split in dict.fromkeys(r.split for r in rows):
        summaries.append(write_split(split, [r for r in rows if r.split == split], found, index,
                                     set(failed), out, own))
        log(summaries[-1].line())
    for summary in summaries:
        if summary.low:
            warn(summary.warning(video_dir, out))
    if names and not (out / "classes.txt").is_file():
        write_text(own / "classes.txt", "".join(f"{n}\n" for n in names), root=own)
    return summaries


def write_split(split: str, rows: list[Row], found: dict[Row, Path | None], index: dict[str, int],
                failed: set[Row], out: Path, own: Path | None = None) -> SplitSummary:
    """``<split>.csv`` (or ``<split>_videos.txt`` without labels) and ``missing_<split>.csv``,
    written by the one writer into ``own`` (``out`` resolved; the lists' paths are relative to
    ``out`` as given)."""
    own = own or out.resolve()
    labeled = all(r.label is not None for r in rows)
    lines, gone = [], []
    for r in rows:
        path = found[r]
        if path is None:
            gone.append(r)
        elif labeled:
            lines.append(list_line(list_path(path, out), index[r.label]))  # type: ignore[index]
        else:
            lines.append(list_path(path, out) + "\n")
    summary = SplitSummary(split, len(rows), len(lines), len(gone) - len(failed & set(gone)),
                           len(failed & set(gone)))
    target = out / (f"{split}.csv" if labeled else f"{split}_videos.txt")
    write_text(own / target.name, "".join(lines), root=own)
    summary.written.append(target.name)
    missing = own / f"missing_{split}.csv"
    if gone:
        f = io.StringIO(newline="")  # built in memory, then written by the one writer
        w = csv.DictWriter(f, fieldnames=list(gone[0].fields), extrasaction="ignore")
        w.writeheader()
        w.writerows(r.raw for r in gone)
        write_text(missing, f.getvalue(), root=own)
        summary.written.append(missing.name)
    else:
        remove(missing, own)  # from an earlier run that had missing videos
    return summary

