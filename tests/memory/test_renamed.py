"""The deprecated spellings of recomputation (``videotrain/memory/renamed.py``): ``memory=checkpoint``
and the old SBP / ``memory=auto`` keys compose, build the same strategy as the new spelling and
warn once, naming it; the new spelling does not warn; a run started under the old spelling
resumes under the new one, and a checkpoint's stored config with the old keys still loads."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from videotrain import config_files
from videotrain.build import compose_cfg
from videotrain.engine.resume import refusal
from videotrain.memory import renamed
from videotrain.memory.auto.strategy import AutoStrategy
from videotrain.memory.recompute import Recompute
from videotrain.memory.sbp.strategy import StochasticBackprop


@pytest.fixture(autouse=True)
def fresh_warnings() -> Iterator[None]:
    """Each test starts as a fresh process would: no old spelling warned about yet."""
    renamed._warned.clear()
    yield
    renamed._warned.clear()


def _compose(overrides: list[str]) -> tuple[Any, list[str]]:
    """The composed config and the FutureWarnings its composing and building raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = compose_cfg(overrides)
        strategy = instantiate(cfg.memory)
    return (cfg, strategy), [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_memory_checkpoint_is_memory_recompute_and_warns_once() -> None:
    (old_cfg, old), old_warnings = _compose(["memory=checkpoint", "memory.policy=sqrt"])
    (new_cfg, new), new_warnings = _compose(["memory=recompute", "memory.policy=sqrt"])
    assert OmegaConf.to_container(old_cfg.memory) == OmegaConf.to_container(new_cfg.memory)
    assert type(old) is type(new) is Recompute and old.describe() == new.describe()
    assert len(old_warnings) == 1 and "memory=recompute" in old_warnings[0], old_warnings
    assert new_warnings == []
    _, again = _compose(["memory=checkpoint"])  # the same process (run): not again
    assert again == []


def test_old_sbp_keys_build_the_same_strategy_and_warn_once_each() -> None:
    (_, old), old_warnings = _compose(["memory=sbp", "memory.checkpoint=optimal",
                                       "memory.checkpoint_budget_frac=0.5"])
    (_, new), new_warnings = _compose(["memory=sbp", "memory.recompute=optimal",
                                       "memory.recompute_budget_frac=0.5"])
    assert isinstance(old, StochasticBackprop) and old.describe() == new.describe()
    assert old.recompute is not None and new.recompute is not None
    assert (old.recompute.policy, old.recompute.budget_frac) == (new.recompute.policy, 0.5)
    assert all("memory.recompute" in w for w in old_warnings)  # each names its new key
    assert len(old_warnings) == 2 and new_warnings == []
    # built twice (check_values, then the model): still one warning per key
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        StochasticBackprop(0.5, checkpoint="optimal", checkpoint_budget_frac=0.5)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]


def test_old_auto_keys_build_the_same_strategy() -> None:
    (_, old), old_warnings = _compose(["memory=auto", "memory.budget_mb=100",
                                       "memory.sbp_checkpoint=sqrt", "memory.checkpoint_fracs=[0.5]"])
    (_, new), new_warnings = _compose(["memory=auto", "memory.budget_mb=100",
                                       "memory.sbp_recompute=sqrt", "memory.recompute_fracs=[0.5]"])
    assert isinstance(old, AutoStrategy)
    assert (old.options, old.recompute_fracs) == (new.options, new.recompute_fracs)
    assert (old.options.sbp_recompute, old.recompute_fracs) == ("sqrt", [0.5])
    assert len(old_warnings) == 2 and new_warnings == []
    assert any("memory.sbp_recompute" in w for w in old_warnings)


def test_both_spellings_with_different_values_are_refused() -> None:
    with pytest.raises(ValueError, match="memory.checkpoint is the old spelling of memory.recompute"):
        StochasticBackprop(0.5, checkpoint="sqrt", recompute="blocks")
    with pytest.raises(ValueError, match="set only memory.recompute_fracs"):
        AutoStrategy(checkpoint_fracs=[0.5], recompute_fracs=[0.4])


def _plain(overrides: list[str]) -> dict:
    cfg = compose_cfg(overrides)
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    return plain


def _blob(config: dict) -> dict:
    return {"config": config, "world_size": 1, "consumed": 0}


def test_a_run_started_under_the_old_spelling_resumes_under_the_new() -> None:
    new = _plain(["memory=sbp", "memory.recompute=sqrt"])
    # as written before the rename: SBP's node had only the old key
    before = {**new, "memory": {k: v for k, v in new["memory"].items()
                                if k not in ("recompute", "recompute_budget_frac", "checkpoint",
                                             "checkpoint_budget_frac")}}
    before["memory"].update(checkpoint="sqrt", checkpoint_budget_frac=None)
    assert refusal(_blob(before), "old.ckpt", new, 1, "auto") is None
    # and under the old spelling on today's schema (both keys stored)
    old_today = _plain(["memory=sbp", "memory.checkpoint=sqrt"])
    assert refusal(_blob(old_today), "old.ckpt", new, 1, "auto") is None
    assert refusal(_blob(new), "new.ckpt", old_today, 1, "auto") is None
    # memory=checkpoint stores what memory=recompute does
    assert _plain(["memory=checkpoint"]) == _plain(["memory=recompute"])
    # a real difference is still one: the old run recomputed nothing
    before["memory"]["checkpoint"] = None
    why = refusal(_blob(before), "old.ckpt", new, 1, "auto")
    assert why is not None and "memory.recompute" in why


def test_a_stored_config_with_the_old_keys_still_loads() -> None:
    stored = _plain(["memory=sbp"])
    for key in ("recompute", "recompute_budget_frac", "checkpoint", "checkpoint_budget_frac"):
        stored["memory"].pop(key)
    stored["memory"].update(checkpoint="blocks", checkpoint_budget_frac=None)
    cfg = config_files.checked_config(stored, "old.ckpt")
    with pytest.warns(FutureWarning, match="memory.recompute"):
        strategy = instantiate(cfg.memory)
    assert strategy.recompute is not None and strategy.recompute.policy == "blocks"


def test_normalise_memory() -> None:
    assert renamed.normalise_memory({"checkpoint": None}) == {"recompute": None}  # written before
    assert renamed.normalise_memory({"recompute": "sqrt", "checkpoint": None}) == {"recompute": "sqrt"}
    assert renamed.normalise_memory({"recompute": None, "checkpoint": "sqrt"}) == {"recompute": "sqrt"}
    assert renamed.normalise_memory({"sbp_checkpoint": None, "checkpoint_fracs": [0.5]}) == {
        "sbp_recompute": None, "recompute_fracs": [0.5]}


def test_memory_auto_resumes_a_plan_saved_under_the_old_kind() -> None:
    """A memory=auto checkpoint written before the rename names its plan ``sbp_checkpoint`` with
    ``checkpoint=`` in its parameters: it resumes as the same plan, without a warning."""
    params = {"keep_ratio": 0.5, "bn_policy": "full_batch", "sampler": "uniform", "seed": 0,
              "nograd_chunk": 8}
    inner = StochasticBackprop(**params, recompute="blocks", rank=0).state_dict()
    auto = AutoStrategy(budget_mb=100, rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto.load_state_dict({"active": "sbp+checkpoint r=0.500", "kind": "sbp_checkpoint",
                              "params": {**params, "checkpoint": "blocks"}, "inner": inner})
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    assert auto.active is not None and auto.active.kind == "sbp_recompute"
    assert isinstance(auto.inner, StochasticBackprop) and auto.inner.describe()["recompute"] == "blocks"
