"""Which classes a run can train and score: videos listed and readable per class, the errors
for a class left without any, and ``data.drop_classes``.

Why: a partial download or a repack that renames files (UCF101's ``v_HandstandPushups_*``
against the lists' ``v_HandStandPushups_*``) can leave a whole class without a readable video.
Training would never see it, and evaluation would average the other classes' accuracy while
reporting the full class count. So a class with no readable training videos, or none in a
split being evaluated, stops the run with the class and the list file named, unless the user
drops it explicitly (``data.drop_classes``): its videos then leave both splits, it is left out
of the metrics, and ``results.json`` / ``eval.json`` say so.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Sequence
from pathlib import Path

from pytorchvideo.data.labeled_video_paths import LabeledVideoPaths

from videotrain.data.annotations import AnnotationError, VideoIndex
from videotrain.data.preflight import missing_list
from videotrain.untrusted import quoted, shown


def dropped_labels(drop_classes: Sequence[str] | None, names: list[str], source: str) -> set[int]:
    """The labels of ``data.drop_classes``: each a class name, or a label number (``[3, 7]``,
    what the errors suggest, since they never echo a name read from a file); anything else is
    an error naming the entry (the user's own) and the number of classes, never their names."""
    by_name = {n: i for i, n in enumerate(names)}
    labels = set()
    for entry in drop_classes or ():
        if entry in by_name:
            labels.add(by_name[entry])
        elif re.fullmatch(r"[0-9]{1,9}", str(entry)) and int(entry) < len(names):
            labels.add(int(entry))
        else:
            raise ValueError(f"data.drop_classes: {quoted(entry)} is neither a class of "
                             f"{shown(source)} nor a label number of its {len(names)} classes "
                             f"(0 to {len(names) - 1})")
    return labels


def drop_override(labels: list[int], names: list[str]) -> str:
    """The command-line override that drops ``labels``: ``data.drop_classes=[3,7]``, by label
    number (a class name is read from a file: never echoed). Where a number is also the name of
    another class (it would drop that one), the override says which labels to name instead."""
    if any(str(k) in names and names.index(str(k)) != k for k in labels):
        return (f"data.drop_classes=[...] naming the classes of label{'s' * (len(labels) > 1)} "
                f"{', '.join(map(str, labels))}")
    return f"data.drop_classes=[{','.join(map(str, labels))}]"


def counts(index: VideoIndex, bad: Collection[str] = ()) -> tuple[list[int], list[int]]:
    """(listed, readable) videos per class; ``bad``: the paths found missing or empty."""
    listed = [0] * len(index.class_names)
    readable = [0] * len(index.class_names)
    for path, info in index.paths:
        label = int(info["label"])
        if label < len(listed):
            listed[label] += 1
            readable[label] += path not in bad
    return listed, readable


def _names(labels: list[int], detail: dict[int, str]) -> str:
    """The classes as an error names them: by label, never by a name read from a file."""
    listed = [f"label {k} ({detail[k]})" for k in labels[:5]]
    return ", ".join(listed) + (f" and {len(labels) - 5} more" if len(labels) > 5 else "")


def _listing(report_dir: str | Path | None, split: str) -> str:
    return "the warnings above" if report_dir is None else str(missing_list(report_dir, split))


def check_classes(train: VideoIndex, val: VideoIndex, bad: Collection[str], drop: set[int],
                  train_checked: bool = True, report_dir: str | Path | None = None) -> None:
    """Raise an ``AnnotationError`` naming the classes (and the list file) whose listed
    training videos are all missing or empty, or that are listed in val with none readable
    there; the message gives the ``data.drop_classes`` override that goes on without them.
    ``train_checked=False`` (evaluation: training files are not stat-ed) judges the training
    split by its lists alone. A class listed in val only was refused before, from the lists
    (``loaders.check_val_classes``)."""
    names = train.class_names
    train_listed, train_ok = counts(train, bad if train_checked else ())
    val_listed, val_ok = counts(val, bad)
    no_train = [k for k in range(len(names)) if k not in drop and train_listed[k] and train_ok[k] == 0]
    if no_train:
        detail = {k: f"{train_listed[k]} listed, all missing or empty" for k in no_train}
        raise AnnotationError(
            f"{shown(Path(train.source))}: {len(no_train)} class(es) have no readable training videos: "
            f"{_names(no_train, detail)}; the model would never learn them and their val "
            f"videos would count as errors. Restore the videos (missing ones: "
            f"{_listing(report_dir, 'train')}), or leave them out of training and the metrics "
            f"with {drop_override(no_train, names)} (recorded in results.json)")
    no_val = [k for k in range(len(names)) if k not in drop and val_listed[k] and val_ok[k] == 0]
    if no_val:
        detail = {k: f"{val_listed[k]} listed, all missing or empty" for k in no_val}
        raise AnnotationError(
            f"{shown(Path(val.source))}: {len(no_val)} class(es) have no readable videos in this evaluated "
            f"split: {_names(no_val, detail)}; their accuracy cannot be measured, and mean "
            f"class accuracy would average the other classes only. Restore the videos (missing "
            f"ones: {_listing(report_dir, 'val')}), or leave them out of training and the metrics "
            f"with {drop_override(no_val, names)} (recorded in results.json)")


def without(index: VideoIndex, bad: Collection[str] = (), drop: Collection[int] = ()) -> VideoIndex:
    """``index`` without the videos in ``bad`` (full paths) and those of the ``drop`` labels;
    the class list (and so the label numbering) stays as it is."""
    if not bad and not drop:
        return index
    prefix = index.paths._path_prefix
    kept = [(rel, label) for rel, label in index.paths._paths_and_labels
            if label not in drop and (not bad or os.path.join(prefix, rel) not in bad)]
    return VideoIndex(LabeledVideoPaths(kept, path_prefix=prefix), index.class_names, index.source)
