"""The memory group's deprecated spellings: one meaning per name (issue 47).

"checkpoint" means a checkpoint file only; activation recomputation is "recompute" everywhere.
The old spellings keep working until ``REMOVED_IN``, each use logging one warning per process
that names the new spelling, and behave exactly like the new ones:

- ``memory=checkpoint`` is ``memory=recompute`` (``configs/memory/checkpoint.yaml`` composes
  ``recompute.yaml``; the commands warn from Hydra's group choice, see ``warn_renamed_choices``);
- SBP's ``memory.checkpoint`` / ``memory.checkpoint_budget_frac`` are ``memory.recompute`` /
  ``memory.recompute_budget_frac``; ``memory=auto``'s ``memory.sbp_checkpoint`` /
  ``memory.checkpoint_fracs`` are ``memory.sbp_recompute`` / ``memory.recompute_fracs``. The
  strategies take both spellings as keyword arguments (so the schemas derived from them accept
  both) and warn through :func:`renamed_argument`.

:func:`normalise_memory` rewrites a ``memory:`` node to the new keys, so that the resume guard
(``engine/resume.py``) sees a run started under the old spelling as the same training.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

log = logging.getLogger(__name__)

REMOVED_IN = "0.3.0"  # the release that drops the old spellings

# memory=OLD -> memory=NEW (config group options)
RENAMED_OPTIONS: dict[str, str] = {"checkpoint": "recompute"}
# memory.OLD -> memory.NEW (keys of the memory node; SBP's and memory=auto's)
RENAMED_KEYS: dict[str, str] = {
    "checkpoint": "recompute",
    "checkpoint_budget_frac": "recompute_budget_frac",
    "sbp_checkpoint": "sbp_recompute",
    "checkpoint_fracs": "recompute_fracs",
}

_warned: set[str] = set()  # old spellings already warned about in this process


def warn_renamed(old: str, new: str) -> None:
    """One ``FutureWarning`` (and one logged warning) per process for the old spelling ``old``."""
    if old in _warned:
        return
    _warned.add(old)
    text = (f"{old} is a deprecated spelling of {new} (recomputation is 'recompute'; 'checkpoint' "
            f"means a checkpoint file): it behaves the same, and is removed in {REMOVED_IN}")
    log.warning(text)
    warnings.warn(text, FutureWarning, stacklevel=3)


def renamed_argument(old: str, old_value: Any, new: str, new_value: Any, new_default: Any) -> Any:
    """The value of the renamed argument ``new`` given the old spelling's ``old_value`` (None:
    not given). Both given with different values is an error; the old one alone warns once."""
    if old_value is None:
        return new_value
    if new_value != new_default and new_value != old_value:
        raise ValueError(f"memory.{old} is the old spelling of memory.{new}: set only memory.{new} "
                         f"(got {old}={old_value!r} and {new}={new_value!r})")
    warn_renamed(f"memory.{old}", f"memory.{new}")
    return old_value


def warn_renamed_choices(choices: dict[str, Any]) -> None:
    """Warn for a config group chosen by its old name (``memory=checkpoint``); ``choices`` is
    Hydra's ``hydra.runtime.choices``."""
    old = choices.get("memory")
    if old in RENAMED_OPTIONS:
        warn_renamed(f"memory={old}", f"memory={RENAMED_OPTIONS[old]}")


def normalise_memory(node: Any) -> Any:
    """A copy of the ``memory:`` node (a plain dict) under the new key names: an old key's value
    moves to its new key when it was set (a config written before the rename has only the old
    key, so its value, even null, is the setting), then the old key is dropped."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for old, new in RENAMED_KEYS.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new not in out or value is not None:
            out[new] = value
    return out
