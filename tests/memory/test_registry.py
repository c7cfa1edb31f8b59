"""The strategy registry is the one list of ``memory=`` options: the config files, the schema,
the allowlist of configs read from files and docs/memory.md's table all agree with it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import yaml

from videotrain.config import schema
from videotrain.config.files import _aliases, shipped_targets
from videotrain.memory.registry import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "memory"
DOC = ROOT / "docs" / "memory.md"


def strategies_table(text: str) -> dict[str, str]:
    """``memory=`` name -> description, from the table under ``## The strategies``."""
    section = text.split("\n## The strategies\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"^\| `([a-z_0-9]+)` \| (.+?) \|$", section, re.MULTILINE)}


def test_every_config_file_is_a_registered_strategy_with_its_target() -> None:
    files = {p.stem: yaml.safe_load(p.read_text()) for p in CONFIGS.glob("*.yaml")}
    assert set(files) == set(STRATEGIES)
    for name, data in files.items():
        assert data["_target_"] == STRATEGIES[name].target, name
        assert STRATEGIES[name].cls.name == name  # results.json's "strategy" is the option's name


def test_code_only_arguments_have_defaults_and_are_not_config_keys() -> None:
    for s in STRATEGIES.values():
        params = inspect.signature(s.cls.__init__).parameters
        data = yaml.safe_load((CONFIGS / f"{s.name}.yaml").read_text())
        fields = set(schema.SCHEMAS["memory"][f"{s.name}_schema"].__dataclass_fields__)
        for arg in s.code_only:
            assert params[arg].default is not inspect.Parameter.empty, (s.name, arg)
            assert arg not in data and arg not in fields, (s.name, arg)


def test_schema_and_allowlist_read_the_registry() -> None:
    assert set(schema.SCHEMAS["memory"]) == {f"{name}_schema" for name in STRATEGIES}
    allowed = {a for s in STRATEGIES.values() for a in _aliases(s.target)}
    assert shipped_targets()["memory"] == allowed
    # both spellings of a class: the YAML's and the one memory=auto's candidates write
    assert "videotrain.memory.sbp.strategy.StochasticBackprop" in allowed


def test_docs_table_lists_exactly_the_registry() -> None:
    assert strategies_table(DOC.read_text()) == {s.name: s.summary for s in STRATEGIES.values()}


def test_strategies_table_reads_rows_and_only_that_section() -> None:
    text = ("# x\n\n## The strategies\n\n| `memory=` | what it does |\n|---|---|\n"
            "| `e2e` | the reference |\n| `sbp` | fewer backward frames |\n\n## Other\n\n| `frame_dropout` | no |\n")
    assert strategies_table(text) == {"e2e": "the reference", "sbp": "fewer backward frames"}

