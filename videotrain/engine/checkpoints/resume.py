"""Guarded resume: a checkpoint continues only the training it was written by.

The stored resolved config is compared with the current one key by key; keys marked
``NEUTRAL`` where they are declared (``MATH_NEUTRAL``) may change, any other difference or a
new DDP world size refuses unless ``trainer.resume=force``. A checkpoint whose class order
differs from the dataset's is refused even then. ``trainer.resume``: ``auto`` | ``force`` |
``false`` (``RESUME_MODES``). Nothing of a checkpoint is used before it is checked: its fields
(``safe_load.CHECKPOINT``), the fields resume needs (``refusal``), its weights' and optimizer
state's keys and shapes against the model (``fit_problem``). Details:
docs/design/internals.md#the-resume-guard."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import torch

from videotrain import NEUTRAL_MARK
from videotrain.data.loaders import build_data
from videotrain.engine.checkpoints.class_order import class_order_problem
from videotrain.engine.evaluate import EvalSettings
from videotrain.engine.settings import RunSettings, TrainerSettings
from videotrain.metrics.logger import LoggerSettings
from videotrain.untrusted import plain_tree_problem, shown

log = logging.getLogger(__name__)


def marked_neutral(cls: type, prefix: str) -> tuple[str, ...]:
    """``prefix`` + the name of every field of the dataclass ``cls`` marked ``NEUTRAL`` (with a
    trailing ``.`` for a marked dataclass-typed field: its whole node), and the marked fields of
    its unmarked dataclass-typed fields."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        nested = dataclasses.is_dataclass(hints[f.name])
        if f.metadata.get(NEUTRAL_MARK):
            out.append(f"{prefix}{f.name}{'.' if nested else ''}")
        elif nested:
            out += marked_neutral(hints[f.name], f"{prefix}{f.name}.")
    return tuple(out)


def annotated_neutral(fn: Callable[..., Any], prefix: str) -> tuple[str, ...]:
    """``prefix`` + every argument of ``fn`` annotated ``Annotated[type, "math_neutral"]``."""
    hints = typing.get_type_hints(fn, include_extras=True)
    return tuple(f"{prefix}{name}" for name, hint in hints.items()
                 if typing.get_origin(hint) is Annotated and NEUTRAL_MARK in hint.__metadata__)


# Dotted keys (or prefixes, ending in ".") that may differ between a checkpoint and the run
# resuming it, each marked where it is declared. trainer.max_epochs / max_steps move where
# training stops, and with it the end of the cosine schedule (the trainer logs the change); the
# rest changes no computed value.
MATH_NEUTRAL: tuple[str, ...] = (
    *marked_neutral(TrainerSettings, "trainer."), *annotated_neutral(build_data, "data."),
    *marked_neutral(LoggerSettings, "logger."), *marked_neutral(EvalSettings, "eval."),
    *marked_neutral(RunSettings, ""),
)


ABSENT = object()



def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists are values (compared whole)."""
    if not isinstance(cfg, dict) or (prefix and not cfg):
        return {prefix: cfg}
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return {k.rstrip("."): v for k, v in out.items()}


def is_neutral(key: str) -> bool:
    return any(key == n or (n.endswith(".") and key.startswith(n)) for n in MATH_NEUTRAL)


def config_diff(saved: dict | None, current: dict | None) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for every key that differs and is not neutral;
    empty when either config is unknown. A key present on one side only has ``ABSENT`` there."""
    if saved is None or current is None:
        return []
    old, new = flatten(saved), flatten(current)
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, ABSENT), new.get(key, ABSENT)
        if not is_neutral(key) and not _equal(a, b):
            diffs.append((key, a, b))
    return diffs


def one_sided(diffs: list[tuple[str, Any, Any]]) -> tuple[list, list]:
    """``diffs`` split into (keys set on both sides, keys set on one side only). A key on one
    side only comes from a videotrain version that added or removed it (a group switch also
    changes ``_target_`` or ``name``, which are compared), so it does not block a resume."""
    both = [d for d in diffs if d[1] is not ABSENT and d[2] is not ABSENT]
    return both, [d for d in diffs if d[1] is ABSENT or d[2] is ABSENT]


def _equal(a: Any, b: Any) -> bool:
    if a is ABSENT or b is ABSENT:
        return a is b
    if type(a) in (int, float) and type(b) in (int, float):  # 1 == 1.0, but not True == 1
        return float(a) == float(b)
    return type(a) is type(b) and a == b


def show(value: Any) -> str:
    """A config value as the resume messages show it: escaped and cut (``untrusted.shown``),
    since a checkpoint's stored config may come from someone else and is logged."""
    if value is ABSENT:
        return "(not set)"
    if value is None:
        return "null"
    return shown(value)


def describe_diffs(diffs: list[tuple[str, Any, Any]], limit: int = 50) -> str:
    """One line per differing key (at most ``limit``, then a count), every key and value
    escaped and cut."""
    lines = [f"  {shown(key)}: {show(a)} -> {show(b)}" for key, a, b in diffs[:limit]]
    if len(diffs) > limit:
        lines.append(f"  ... and {len(diffs) - limit} more keys")
    return "\n".join(lines)


def world_size_problem(saved: int, current: int, consumed: int, path: str) -> str | None:
    """Why a checkpoint written by ``saved`` processes cannot be resumed by ``current`` at
    all, or None. Mid-epoch (``consumed`` > 0) the samples each rank has trained on this epoch
    follow from the old sharding; under another world size the rest of the epoch would skip or
    repeat samples, so not even ``trainer.resume=force`` resumes it."""
    if saved == current or not consumed:
        return None
    return (f"cannot resume from {path}: it was written mid-epoch by {saved} process(es), and "
            f"this run has {current}; the samples each rank has already trained on this epoch "
            f"cannot be re-derived for another number of processes (the rest of the epoch would "
            f"skip or repeat samples). Resume with {saved} process(es), or from a checkpoint "
            "written at an epoch end (with trainer.resume=force, since the world size changes "
            "the global batch)")


def refusal(blob: dict[str, Any], path: str | Path, config: dict | None, world_size: int,
            mode: str, class_names: list[str] | None = None,
            required: tuple[str, ...] = ()) -> str | None:
    """Why the checkpoint ``blob`` (read from ``path``) may not be resumed by a run with
    ``config`` on ``world_size`` processes and the dataset's ``class_names`` under
    ``trainer.resume=mode``; None if it may. ``required``: the fields resume reads (a
    checkpoint without one is not a training checkpoint of this layout). Under ``force`` the
    config differences are logged as a warning instead; a class-order mismatch is refused
    always."""
    missing = [name for name in required if name not in blob]
    if missing:
        return (f"cannot resume from {path}: it has no {', '.join(shown(k) for k in missing[:10])} "
                "(not a training checkpoint of this videotrain's layout); trainer.resume=false "
                "starts over in this folder")
    if class_names is not None:
        layout = ((config or {}).get("data") or {}).get("layout")
        why = class_order_problem(blob, path, class_names, layout, "resume from")
        if why:
            return (f"{why}; or start over in this folder with trainer.resume=false "
                    "(trainer.resume=force does not apply to this)")
    stored = blob.get("config")
    problem = None if stored is None else (
        plain_tree_problem(stored) or (None if isinstance(stored, dict) else "not a mapping"))
    if problem:  # compared key by key below: a shared-reference bomb would expand there
        return (f"cannot resume from {path}: the config stored in it is not a config of plain "
                f"values ({problem}); trainer.resume=false starts over in this folder")
    saved_world = blob.get("world_size", 1)
    if not isinstance(saved_world, int) or not isinstance(blob.get("consumed"), int):
        return f"cannot resume from {path}: its world_size or consumed is not an integer"
    hard = world_size_problem(saved_world, world_size, blob["consumed"], str(path))
    if hard:
        return hard
    if blob.get("config") is None or config is None:
        log.info("%s or this run records no config: resuming without comparing them", path)
    diffs, added = one_sided(config_diff(blob.get("config"), config))
    if added:
        log.warning("not compared with %s: keys set in only one of the two configs (added or "
                    "removed by a videotrain update, or with +key=...):\n%s", path,
                    describe_diffs(added))
    if saved_world != world_size:
        diffs.append(("world_size (DDP processes)", saved_world, world_size))
    if not diffs:
        return None
    if mode == "force":
        log.warning("trainer.resume=force: resuming from %s although these settings that change "
                    "training differ from the checkpoint's:\n%s", path, describe_diffs(diffs))
        return None
    keys = shown(", ".join(str(k) for k, _, _ in diffs), 300)
    return (f"cannot resume from {path}: the config differs from the one it was written with "
            f"in what changes training: {keys}\n{describe_diffs(diffs)}\n"
            "Resume with the checkpoint's values, pass trainer.resume=force to continue with the "
            "new ones, or trainer.resume=false to start over in this folder (another "
            "hydra.run.dir starts a separate run).")


# ---------------------------------------------------------------------- the weights, against the model
_SHOW = 5  # keys named per kind of mismatch


def _listing(kind: str, keys: list[str]) -> str:
    """The first keys of a kind, each escaped and cut (a checkpoint's keys may be anyone's)."""
    listed = ", ".join(shown(k) for k in keys[:_SHOW])
    return f"{len(keys)} {kind}: {listed}" + (f", ... ({len(keys) - _SHOW} more)"
                                              if len(keys) > _SHOW else "")


def weights_problem(own: Mapping[str, torch.Tensor], saved: Any) -> list[str]:
    """What keeps the state dict ``saved`` from loading strictly into a module whose state dict
    is ``own``: missing and unexpected keys, values that are not tensors and shape mismatches,
    each described with its first keys escaped (as ``models.weights.key_mismatches`` does for
    eval); empty when it fits."""
    if not isinstance(saved, Mapping):
        return [f"not a state dict (a {type(saved).__name__})"]
    missing = sorted(k for k in own if k not in saved)
    unexpected = sorted(str(k) for k in saved if k not in own)
    tensors = {k: v for k, v in saved.items() if k in own}
    untyped = sorted(k for k, v in tensors.items() if not isinstance(v, torch.Tensor))
    shapes = sorted(f"{shown(k)} {tuple(v.shape)} vs {tuple(own[k].shape)}"
                    for k, v in tensors.items() if isinstance(v, torch.Tensor) and v.shape != own[k].shape)
    out = [_listing(kind, keys) for kind, keys in (
        ("missing keys", missing), ("unexpected keys", unexpected), ("values not tensors", untyped))
        if keys]
    if shapes:  # already escaped
        more = f", ... ({len(shapes) - _SHOW} more)" if len(shapes) > _SHOW else ""
        out.append(f"{len(shapes)} shape mismatches (file vs model): {', '.join(shapes[:_SHOW])}{more}")
    return out


def optimizer_problem(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> list[str]:
    """What keeps the optimizer state ``saved`` (checked for its layout when read) from fitting
    ``optimizer``: other numbers of parameter groups or parameters, or a per-parameter state
    tensor (Adam's moments, SGD's momentum) of another shape than its parameter."""
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    if len(groups) != len(saved_groups) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups, strict=True)):
        return ["another number of parameter groups or parameters than the optimizer has"]
    params = dict(zip(itertools.chain.from_iterable(s["params"] for s in saved_groups),
                      itertools.chain.from_iterable(g["params"] for g in groups), strict=True))
    bad = []
    for index, state in saved["state"].items():
        param = params.get(index)
        if param is None:
            bad.append(f"state of parameter {index}, which no group has")
            continue
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                bad.append(f"{shown(name)} of parameter {index} {tuple(value.shape)} vs "
                           f"{tuple(param.shape)}")
    return bad[:_SHOW] + ([f"... ({len(bad) - _SHOW} more)"] if len(bad) > _SHOW else [])


def fit_problem(blob: Mapping[str, Any], path: str | Path, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, ema: torch.nn.Module | None = None) -> str | None:
    """Why the checkpoint ``blob``'s weights (its EMA's, where ``ema`` is the run's averaged
    model) and optimizer state do not fit the run's ``model`` and ``optimizer``, or None;
    checked before anything is loaded into them, so a crafted checkpoint ends in this one
    message (its keys escaped), not in a traceback that prints them raw."""
    parts = [f"model weights: {p}" for p in weights_problem(model.state_dict(), blob["model"])]
    if ema is not None and "ema_model" in blob:
        parts += [f"EMA weights: {p}" for p in weights_problem(ema.state_dict(), blob["ema_model"])]
        if "ema_updates" not in blob:
            parts.append("EMA weights without their number of updates (ema_updates)")
    parts += [f"optimizer state: {p}" for p in optimizer_problem(optimizer, blob["optimizer"])]
    if not parts:
        return None
    return (f"cannot resume from {path}: it does not fit the model being trained "
            f"({'; '.join(parts)}); model/backbone, model/head and the number of classes must "
            "match the run's, or trainer.resume=false starts over in this folder")
