"""Annotation readers: turn a dataset's on-disk layout into ``LabeledVideoPaths``.

pytorchvideo's own ``LabeledVideoPaths.from_csv`` fails with a bare ``ValueError`` on a bad
line; users with 240k-line Kinetics CSVs need the file and line number instead, so the
Kinetics reader parses lines itself and hands pytorchvideo the validated list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".webm", ".mov")


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


def _read_class_names(root: Path) -> list[str] | None:
    f = root / "classes.txt"
    if not f.exists():
        return None
    names = [line.strip() for line in f.read_text().splitlines() if line.strip()]
    if len(set(names)) != len(names):
        raise AnnotationError(f"{f}: duplicate class names")
    return names


def parse_label_csv(path: Path) -> list[tuple[str, int]]:
    """Parse ``relative/path.mp4 label`` (or ``path,label``) lines; blank and ``#`` lines skip."""
    if not path.exists():
        raise FileNotFoundError(f"annotation file not found: {path}")
    items = []
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(",", 1) if "," in line else line.rsplit(None, 1)
        if len(parts) != 2:
            raise AnnotationError(f"{path}:{lineno}: expected 'path label', got {raw!r}")
        rel, label = parts[0].strip(), parts[1].strip()
        try:
            value = int(label)
        except ValueError:
            raise AnnotationError(
                f"{path}:{lineno}: label {label!r} is not an integer in line {raw!r}"
            ) from None
        if value < 0 or not rel:
            raise AnnotationError(f"{path}:{lineno}: bad path or negative label in line {raw!r}")
        items.append((rel, value))
    if not items:
        raise AnnotationError(f"{path}: no annotation lines")
    return items


def kinetics_index(root: str | Path, split: str, num_classes: int | None = None) -> VideoIndex:
    """``ROOT/{split}.csv`` with paths relative to ROOT; class names from ``classes.txt``."""
    root = Path(root)
    csv = root / f"{split}.csv"
    items = parse_label_csv(csv)
    names = _read_class_names(root)
    inferred = max(label for _, label in items) + 1
    n = num_classes or (len(names) if names else inferred)
    for rel, label in items:
        if label >= n:
            raise AnnotationError(f"{csv}: label {label} of {rel!r} is outside num_classes={n}")
    names = names or [str(i) for i in range(n)]
    if len(names) != n:
        raise AnnotationError(f"{root / 'classes.txt'}: lists {len(names)} classes, expected {n}")
    return VideoIndex(LabeledVideoPaths(items, path_prefix=str(root)), names, str(csv))


def folder_index(root: str | Path, split: str) -> VideoIndex:
    """``ROOT/{split}/<class>/*.mp4``; classes are the sorted folder names."""
    base = Path(root) / split
    if not base.is_dir():
        raise FileNotFoundError(f"data.root: split folder not found: {base}")
    names = sorted(d.name for d in base.iterdir() if d.is_dir())
    if not names:
        raise AnnotationError(f"{base}: no class folders")
    items = [
        (str(p), label)
        for label, name in enumerate(names)
        for p in sorted((base / name).iterdir())
        if p.suffix.lower() in VIDEO_EXTENSIONS
    ]
    if not items:
        raise AnnotationError(f"{base}: no video files ({', '.join(VIDEO_EXTENSIONS)})")
    return VideoIndex(LabeledVideoPaths(items), names, str(base))
