"""Which classes a checkpoint's head scores, in which order, and the check that resume,
``videotrain.eval`` and ``model.init_from`` make before they use it.

A head's row ``k`` scores whatever class was label ``k`` when it trained. Training checkpoints
record the run's class names (``class_names``), so a run, an evaluation or a fine-tuning start
whose dataset numbers the same classes differently is refused, instead of scoring every video
against the wrong rows.

Checkpoints written before they recorded class names are checked where their numbering is
known: HMDB51 (the checkpoint's recorded config says ``data.layout: hmdb51``) was numbered by
split-file name (``hmdb51_legacy_order``), which swaps climb/climb_stairs, kick/kick_ball and
sword/sword_exercise against today's sorted class names; such a checkpoint is refused when the
dataset at hand has classes whose number changed. Any other checkpoint without class names is
used as before (its numbering came from rules that have not changed).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from videotrain.data.split_files import hmdb51_legacy_order
from videotrain.engine.checkpoints.format import CheckpointError
from videotrain.untrusted import shown

log = logging.getLogger(__name__)

_SHOW = 4  # classes listed in a message


class ClassOrderMismatch(CheckpointError):
    """The checkpoint's head numbers the classes differently from the dataset at hand."""


def recorded_layout(blob: dict[str, Any]) -> str | None:
    """``data.layout`` of the config recorded in a training checkpoint, if any."""
    config = blob.get("config")
    data = config.get("data") if isinstance(config, dict) else None
    return str(data["layout"]) if isinstance(data, dict) and data.get("layout") else None


def saved_class_names(blob: dict[str, Any], current: list[str],
                      layout: str | None) -> tuple[list[str] | None, bool]:
    """The classes of the checkpoint's head rows, and whether they were inferred (an HMDB51
    checkpoint from before class names were recorded, read against the ``current`` HMDB51
    classes); ``(None, False)`` when they are unknown."""
    names = blob.get("class_names")
    if isinstance(names, (list, tuple)):
        return [n if isinstance(n, str) else shown(n) for n in names], False  # bounded
    if layout == "hmdb51" and recorded_layout(blob) == "hmdb51":
        return hmdb51_legacy_order(list(current)), True
    return None, False


def _moves(saved: list[str], current: list[str]) -> str:
    """Which labels moved, by number: the class names come from a checkpoint and a dataset's
    files, and an error never echoes them."""
    where = {name: i for i, name in reversed(list(enumerate(saved)))}  # first index of each
    moved = [f"label {k} here is label {where[name]} in the checkpoint"
             for k, name in enumerate(current) if name in where and where[name] != k]
    more = f"; {len(moved) - _SHOW} more" if len(moved) > _SHOW else ""
    return "; ".join(moved[:_SHOW]) + more


def _listed(labels: list[int]) -> str:
    """The first few of ``labels`` (by number, as :func:`_moves`)."""
    more = f", ... ({len(labels)} in all)" if len(labels) > _SHOW else ""
    return "labels " + ", ".join(map(str, labels[:_SHOW])) + more if labels else "none"


def class_order_problem(blob: dict[str, Any], path: str | Path, current: list[str],
                        layout: str | None, use: str, other_classes_ok: bool = False) -> str | None:
    """Why the checkpoint ``blob`` (read from ``path``) must not be used (``use``: "resume
    from it", ...) with a dataset whose classes are ``current`` (``layout``), or None. With
    ``other_classes_ok`` (fine-tuning) only the same classes in another order are refused."""
    current = [str(n) for n in current]
    saved, legacy = saved_class_names(blob, current, layout)
    if saved is None or saved == current:
        return None
    if legacy:
        return (f"cannot {use} {path}: it was trained on HMDB51 by a videotrain version that "
                "numbered HMDB51's classes in the order of their split-file names, and it records "
                "no class names; videotrain now numbers them by sorted class name (as torchvision "
                f"and MMAction2 do), which moves classes of this dataset ({_moves(saved, current)}), "
                "so its scores would go to the wrong classes. Retrain with this version (its "
                "checkpoints record their class names), or use the videotrain version that wrote "
                "the checkpoint")
    same_set = sorted(saved) == sorted(current)
    if other_classes_ok and not same_set:
        return None
    if same_set:
        what = f"the same {len(current)} classes in another order ({_moves(saved, current)})"
    else:
        here, there = set(current), set(saved)
        extra = [k for k, name in enumerate(saved) if name not in here]
        lacking = [k for k, name in enumerate(current) if name not in there]
        what = (f"other classes ({len(saved)} in the checkpoint, {len(current)} here; "
                f"only in the checkpoint: {_listed(extra)}, only here: {_listed(lacking)})")
    return (f"cannot {use} {path}: its classes and this dataset's differ: {what}, so its scores "
            "would go to the wrong classes. Use the dataset (and data.* settings) it was trained "
            "with")


def check_class_order(blob: dict[str, Any], path: str | Path, current: list[str],
                      layout: str | None, use: str, other_classes_ok: bool = False) -> None:
    """``class_order_problem`` as a ``ClassOrderMismatch``."""
    why = class_order_problem(blob, path, current, layout, use, other_classes_ok)
    if why:
        raise ClassOrderMismatch(why)
    if "class_names" not in blob and layout == "hmdb51" and recorded_layout(blob) is None:
        log.warning("%s records neither class names nor its config: whether its classes are "
                    "numbered as this HMDB51 dataset's (sorted by class name) cannot be checked",
                    path)
