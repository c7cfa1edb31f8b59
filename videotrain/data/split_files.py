"""UCF101 and HMDB51 from their official split files, selected by ``data.fold`` (1, 2 or 3).

UCF101 ships ``ucfTrainTestlist/`` with ``classInd.txt`` (``1 ApplyEyeMakeup``),
``trainlist0N.txt`` (``ApplyEyeMakeup/v_ApplyEyeMakeup_g08_c01.avi 1``, 1-based labels) and
``testlist0N.txt`` (paths only: the class is the folder), next to the videos in ``UCF-101/``.
pytorchvideo's ``Ucf101`` reads a ``path label`` CSV with 0-based labels, which is neither
file, so the lists are parsed here.

HMDB51 ships ``testTrainMulti_7030_splits/<class>_test_splitN.txt``, one per class and fold,
with ``<video>.avi <id>`` lines (1 = train, 2 = test, 0 = unused), next to the videos in
``hmdb51_org/<class>/``. pytorchvideo's ``Hmdb51LabeledVideoPaths`` reads the same files, but
a malformed line surfaces as a bare ``IndexError``/``ValueError`` naming no file, and its labels
are class-name strings; the tests check that both readers select the same videos.

Both splits take their class list from the dataset (``classInd.txt``, the split-file names),
so train and test share the label numbering even when a class is missing from one of them.
"""

from __future__ import annotations

import re
from pathlib import Path

from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

from videotrain.data.annotations import (
    AnnotationError,
    VideoIndex,
    check_class_count,
    check_split,
    nonblank_lines,
    parent_name,
    require_file,
    under,
    video_folder,
)
from videotrain.untrusted import shown

FOLDS = (1, 2, 3)
HMDB_IDS = {"train": 1, "val": 2}  # 0 marks videos used in neither split of a fold


def check_fold(fold: int) -> int:
    if fold not in FOLDS:
        raise ValueError(f"data.fold must be one of {FOLDS}, got {shown(fold)}")
    return int(fold)


def ucf101_class_index(path: Path) -> list[str]:
    """``classInd.txt``: ``<1-based index> <ClassName>`` lines, indices 1..K in order."""
    names: list[str] = []
    for lineno, line in nonblank_lines(require_file(path, "data.split_dir")):
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit():
            raise AnnotationError(f"{shown(path)}:{lineno}: expected 'index ClassName' (a "
                                  "1-based index and a name without spaces)")
        if int(parts[0]) != len(names) + 1:
            raise AnnotationError(f"{shown(path)}:{lineno}: index {shown(parts[0])} out of order "
                                  f"(expected {len(names) + 1})")
        if parts[1] in names:
            raise AnnotationError(f"{shown(path)}:{lineno}: duplicate class (line "
                                  f"{lineno} repeats class {names.index(parts[1]) + 1})")
        names.append(parts[1])
    if not names:
        raise AnnotationError(f"{shown(path)}: no classes")
    return names


def ucf101_index(
    root: str | Path,
    split: str,
    num_classes: int | None = None,
    *,
    fold: int = 1,
    split_dir: str = "ucfTrainTestlist",
    video_dir: str = "UCF-101",
) -> VideoIndex:
    """``trainlist0{fold}.txt`` or ``testlist0{fold}.txt`` (for ``split="val"``)."""
    check_split(split)
    fold, root = check_fold(fold), Path(root)
    lists = under(root, split_dir)
    names = ucf101_class_index(lists / "classInd.txt")
    by_name = {n: i for i, n in enumerate(names)}
    path = require_file(lists / f"{'trainlist' if split == 'train' else 'testlist'}0{fold}.txt",
                        "data.split_dir")
    items: list[tuple[str, int]] = []
    for lineno, line in nonblank_lines(path):
        parts = line.split()
        if len(parts) not in (1, 2):
            raise AnnotationError(f"{shown(path)}:{lineno}: expected 'Class/video.avi [label]'")
        rel = parts[0]
        folder = parent_name(rel)
        if folder not in by_name:
            raise AnnotationError(f"{shown(path)}:{lineno}: expected 'Class/video.avi [label]' "
                                  f"with a Class of {shown(lists / 'classInd.txt')}: its class "
                                  "folder is not there")
        label = by_name[folder]
        if len(parts) == 2:  # trainlists carry the 1-based label; it must agree with the folder
            if not parts[1].isdigit():
                raise AnnotationError(f"{shown(path)}:{lineno}: expected 'Class/video.avi "
                                      "label': the label is not an integer")
            value = int(parts[1])
            if value - 1 != label:  # by number: the line's text and the class names never echoed
                which = "" if 1 <= value <= len(names) else ", not in classInd.txt"
                raise AnnotationError(f"{shown(path)}:{lineno}: label {value}{which} disagrees "
                                      f"with the video's class folder, class {label + 1} of "
                                      "classInd.txt (expected its label)")
        items.append((rel, label))
    if not items:
        raise AnnotationError(f"{shown(path)}: no videos")
    check_class_count(names, num_classes, str(lists / "classInd.txt"))
    prefix = video_folder(root, video_dir, "data.video_dir")
    return VideoIndex(LabeledVideoPaths(items, path_prefix=str(prefix)), names, str(path))


def hmdb51_legacy_order(names: list[str]) -> list[str]:
    """The order videotrain gave HMDB51's classes before it sorted them by name: by split-file
    name, where ``_`` sorts before letters, so ``climb_stairs`` came before ``climb`` (and
    ``kick_ball``, ``sword_exercise`` before ``kick``, ``sword``). Checkpoints of that time
    carry no class names; this is how their labels are known (``engine.class_order``)."""
    return sorted(names, key=lambda name: f"{name}_test_split")


_HMDB_FILE = re.compile(r"^(?P<name>.+)_test_split(?P<fold>\d+)\.txt$")


def hmdb51_index(
    root: str | Path,
    split: str,
    num_classes: int | None = None,
    *,
    fold: int = 1,
    split_dir: str = "testTrainMulti_7030_splits",
    video_dir: str = "hmdb51_org",
) -> VideoIndex:
    """The ``*_test_split{fold}.txt`` files; classes are the class names in the file names,
    sorted (as torchvision and MMAction2 number them). An empty file is an error."""
    check_split(split)
    fold, root = check_fold(fold), Path(root)
    lists = under(root, split_dir)
    if not lists.is_dir():
        raise FileNotFoundError(f"data.split_dir: split folder not found: {shown(lists)}")
    by_name = {m["name"]: p for p in lists.iterdir()
               if (m := _HMDB_FILE.match(p.name)) and int(m["fold"]) == fold}
    if not by_name:
        raise AnnotationError(f"{shown(lists)}: no *_test_split{fold}.txt files")
    names = sorted(by_name)  # by class name, not file name (see hmdb51_legacy_order)
    wanted = HMDB_IDS[split]
    items: list[tuple[str, int]] = []
    for label, name in enumerate(names):
        path, lines = by_name[name], 0
        for lineno, line in nonblank_lines(path):
            lines += 1
            parts = line.rsplit(None, 1)
            if len(parts) != 2 or parts[1] not in ("0", "1", "2"):
                raise AnnotationError(f"{shown(path)}:{lineno}: expected 'video.avi 0|1|2'")
            if int(parts[1]) == wanted:
                items.append((f"{name}/{parts[0]}", label))
        if not lines:
            raise AnnotationError(f"{shown(path)}: empty split file: its class would have no "
                                  "videos (an interrupted extraction? extract "
                                  "test_train_splits.rar again)")
    if not items:
        raise AnnotationError(f"{shown(lists)}: no videos marked {wanted} ({split}) in the "
                              f"*_test_split{fold}.txt files")
    check_class_count(names, num_classes, f"{shown(lists)}: split files", verb="name")
    source = str(lists / f"*_test_split{fold}.txt")
    prefix = video_folder(root, video_dir, "data.video_dir")
    return VideoIndex(LabeledVideoPaths(items, path_prefix=str(prefix)), names, source)
