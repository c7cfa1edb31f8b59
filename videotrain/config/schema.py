"""Strict configs: a structured-config schema for every config group, in Hydra's ConfigStore.

Every YAML file of a group starts its defaults list with the group's schema (for example
``configs/trainer/default.yaml``: ``defaults: [trainer_schema, _self_]``), so Hydra composes
each group onto a dataclass: a value of the wrong type (``trainer.max_epochs=abc``) fails while
composing, naming the key and the type it expects. Hydra's ``+key=value`` adds keys even to a
structured node, so :func:`check_keys` walks the composed config and rejects any key its
schema does not have, naming the nearest valid one. The apps call it on every config they run.

Where a group's keys are the arguments of what it instantiates (``_target_``: backbones, heads,
memory strategies), of a function the config feeds (``build_data``, ``warmup_cosine``) or the
fields of a settings dataclass (``TrainerSettings``, ``AdamWSettings``, ``EvalSettings``, ...),
the schema is made from that signature, so a default is declared once, in the code, and the
YAML holds the same value (tests/config/test_schema.py checks every group): the logger group's
``LoggerSettings`` and the root's own keys' ``RunSettings`` too. Only ``model``'s own keys (beside
its backbone and head groups) are written out below.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional, Union  # noqa: UP035 (OmegaConf reads typing's generics)

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from videotrain.data.loaders import READER_OPTIONS, build_data
from videotrain.engine.evaluate import EvalSettings
from videotrain.engine.inference import ExportSettings, PredictSettings
from videotrain.engine.optim import AdamWSettings, SGDSettings, warmup_cosine
from videotrain.engine.recipe import RecipeSettings
from videotrain.engine.settings import RunSettings
from videotrain.engine.trainer import TrainerSettings
from videotrain.memory.registry import STRATEGIES
from videotrain.metrics.logger import LoggerSettings
from videotrain.models import heads
from videotrain.models.backbones import resnet, vit
from videotrain.models.timm_backbone import timm_backbone

_PRIMITIVES = (int, float, bool, str)
_SEQUENCES = (list, tuple, collections.abc.Sequence)


def _field_type(hint: Any) -> Any:
    """The OmegaConf field type for a Python annotation: primitives, optional primitives and
    lists of primitives are checked; anything else (unions of several types, mappings) is Any."""
    if hint in _PRIMITIVES:
        return hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = _field_type(rest[0]) if len(rest) == 1 else Any
        return Optional[inner] if inner is not Any and len(rest) < len(args) else Any  # noqa: UP045
    if origin in _SEQUENCES and args and args[0] in _PRIMITIVES and (len(args) == 1 or args[1] is Ellipsis):
        return List[args[0]]  # noqa: UP006
    return Any


def _field(default: Any) -> Any:
    if default is inspect.Parameter.empty or default is dataclasses.MISSING:
        return field(default=MISSING)
    if isinstance(default, (list, tuple, dict)):
        value = dict(default) if isinstance(default, dict) else list(default)
        return field(default_factory=lambda: value)
    return field(default=default)


def schema_of(fn: Any, exclude: tuple[str, ...] = (), target: bool = True) -> type:
    """A dataclass with a field per argument of ``fn`` (a function or a class), typed from its
    annotations, defaulting to its defaults (required arguments: ``???``), plus ``_target_``."""
    init = fn.__init__ if inspect.isclass(fn) else fn
    hints = typing.get_type_hints(init)
    fields: list[tuple[str, Any, Any]] = []
    if target:
        fields.append(("_target_", str, field(default=f"{fn.__module__}.{fn.__qualname__}")))
    for name, p in inspect.signature(init).parameters.items():
        if name in ("self", *exclude) or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        typ = _field_type(hints.get(name, Any))
        if p.default is None and typ is not Any and typing.get_origin(typ) is not Union:
            typ = Optional[typ]  # noqa: UP045
        fields.append((name, typ, _field(p.default)))
    return dataclasses.make_dataclass(f"{fn.__name__}Schema", fields)


def schema_of_dataclass(cls: type, exclude: tuple[str, ...] = (), name: str | None = None) -> type:
    """``cls``'s fields (but ``exclude``) with OmegaConf-supported types (a plain dataclass may
    use any), defaulting to its defaults."""
    hints = typing.get_type_hints(cls)
    fields: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        if dataclasses.is_dataclass(hints[f.name]):  # a node of its own (logger.wandb)
            nested = schema_of_dataclass(hints[f.name])
            fields.append((f.name, nested, field(default_factory=nested)))
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        fields.append((f.name, _field_type(hints[f.name]), _field(default)))
    return dataclasses.make_dataclass(name or f"{cls.__name__}Schema", fields)


def named(schema: type, name: str, cls_name: str) -> type:
    """``schema`` plus a ``name`` key defaulting to ``name`` (the option's name)."""
    return dataclasses.make_dataclass(cls_name, [("name", str, field(default=name))], bases=(schema,))


# ------------------------------------------- written out: no class or function of their own to derive from
@dataclass
class ModelSchema:
    backbone: Any = None
    head: Any = None
    pretrained: Any = None  # torchvision: null | DEFAULT | an enum name; timm: true | a tag
    pretrained_path: Optional[str] = None  # noqa: UP045 (local backbone weights, offline)
    init_from: Optional[str] = None  # noqa: UP045 (a trained video model to fine-tune)
    freeze_backbone: bool = False


@dataclass
class RootSchema(RunSettings):
    """The top level: the run's own keys (``RunSettings``) and the groups (each with its own
    schema)."""

    data: Any = None
    model: ModelSchema = field(default_factory=ModelSchema)
    memory: Any = None
    optim: Any = None
    sched: Any = None
    trainer: Any = None
    logger: Any = None
    eval: Any = None
    predict: Any = None
    export: Any = None
    recipe: Any = None


# data.max_bad_fraction is the data group's key (the trainer reads it from there)
TrainerSchema = schema_of_dataclass(TrainerSettings, ("max_bad_fraction",), name="TrainerSchema")


def _data_schema(reader_options: tuple[str, ...]) -> type:
    """``build_data``'s arguments with the options of one layout's reader (the others' left out)."""
    others = {o for opts in READER_OPTIONS.values() for o in opts} - set(reader_options)
    internal = ("seed", "rank", "world_size", "pin_memory", "device_type", "preflight_train", "shared",
                "report_dir",
                "randaugment", "random_erasing")  # the last two: the recipe group's
    return schema_of(build_data, (*internal, *sorted(others)), target=False)


# group -> {schema name: schema}; each YAML of the group names its schema in its defaults list
SCHEMAS: dict[str, dict[str, type]] = {
    "trainer": {"trainer_schema": TrainerSchema},
    "optim": {"adamw_schema": schema_of_dataclass(AdamWSettings, name="AdamWSchema"),
              "sgd_schema": schema_of_dataclass(SGDSettings, name="SGDSchema")},
    "sched": {"cosine_schema": named(schema_of(warmup_cosine, ("optimizer", "total_steps"), target=False),
                                     "cosine", "CosineSchema")},
    "logger": {"logger_schema": schema_of_dataclass(LoggerSettings)},
    "eval": {"eval_schema": schema_of_dataclass(EvalSettings)},
    "predict": {"predict_schema": schema_of_dataclass(PredictSettings)},
    "export": {"export_schema": schema_of_dataclass(ExportSettings)},
    "recipe": {"recipe_schema": schema_of_dataclass(RecipeSettings)},
    "data": {f"{name}_data_schema": _data_schema(options) for name, options in
             {**READER_OPTIONS, "synthetic": ()}.items()},
    "model/backbone": {"resnet_schema": schema_of(resnet, ("pretrained",)),
                       "vit_schema": schema_of(vit, ("pretrained",)),
                       "timm_schema": schema_of(timm_backbone, ("pretrained",))},
    "model/head": {f"{cls.__name__.lower()}_schema": schema_of(cls, ("in_dim", "num_classes"))
                   for cls in (heads.MeanHead, heads.TConvHead, heads.TransformerHead, heads.LSTMHead)},
    # one per registered strategy, without the arguments set in code only (videotrain.memory.registry)
    "memory": {f"{s.name}_schema": schema_of(s.cls, s.code_only) for s in STRATEGIES.values()},
}


def register() -> None:
    """Put every schema in Hydra's ConfigStore (idempotent; importing ``videotrain.config.build`` does it)."""
    cs = ConfigStore.instance()
    cs.store(name="videotrain_schema", node=RootSchema)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=group, name=name, node=node)


class UnknownConfigKey(ValueError):
    """A key no schema has (added with ``+key=value``, or in an experiment file)."""


def check_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Reject every key of ``cfg`` that its node's schema does not have, naming the nearest
    valid key. Nodes without a schema (free-form ``Any`` values) are not walked."""
    cls = OmegaConf.get_type(cfg)
    if dataclasses.is_dataclass(cls):
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in cfg.keys():
            if key not in allowed:
                full = f"{prefix}{key}"
                near = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.5)
                hint = f"; did you mean {prefix}{near[0]}?" if near else ""
                keys = [k for k in allowed if not k.startswith("_")]
                where = prefix.rstrip(".") or "the root config"
                known = f"the keys of {where} are: {', '.join(keys)}" if keys else f"{where} takes no keys"
                raise UnknownConfigKey(f"unknown config key {full}{hint} ({known})")
    for key in cfg.keys():
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            check_keys(node, f"{prefix}{key}.")
