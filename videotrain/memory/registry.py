"""The memory strategies, named once: ``memory=NAME`` -> the class it builds and one line on it.

Read by the config schema, the allowlist of configs read from files, the table of
``docs/memory.md`` and ``memory=auto``; a strategy is added here and in
``configs/memory/NAME.yaml`` (whose ``_target_`` is this entry's, tested) and nowhere else.
``target`` is resolved when asked (:attr:`Strategy.cls`), as Hydra resolves a ``_target_``, so
that ``memory=auto``, itself listed here, can read the list too.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    """One ``memory=`` option."""

    name: str                      # memory=NAME, configs/memory/NAME.yaml
    target: str                    # the class, as the YAML's _target_ names it
    summary: str                   # one line: what it does (the docs table's)
    code_only: tuple[str, ...] = ()  # constructor arguments the config does not expose

    @property
    def cls(self) -> type:
        """The strategy class ``target`` names."""
        module, _, name = self.target.rpartition(".")
        return getattr(importlib.import_module(module), name)


_RANK = ("rank",)  # the DDP rank: from the RANK environment variable, never a config key

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("e2e", "videotrain.memory.e2e.EndToEnd",
             "plain backpropagation through every frame: the reference"),
    Strategy("frame_dropout", "videotrain.memory.frame_dropout.FrameDropout",
             "train on a random subset of frames; the others are never computed", _RANK),
    Strategy("sbp", "videotrain.memory.sbp.StochasticBackprop",
             "forward over every frame, backward through a random subset of them", _RANK),
    Strategy("recompute", "videotrain.memory.recompute.Recompute",
             "e2e's gradients, with some activations recomputed in backward instead of stored",
             ("lower_set_cap", "cost_model", "device_profile", "segment_cost_us")),
    Strategy("auto", "videotrain.memory.auto.AutoStrategy",
             "give it a memory budget: it picks the fastest plan of the others that fits", _RANK),
)}

