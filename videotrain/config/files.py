"""Configs read from files: one check before anything of them is instantiated.

A run folder's ``config.yaml`` or a checkpoint's config may come from a stranger, and Hydra's
``instantiate`` calls every ``_target_`` it meets. :func:`checked_config` is the one door
(eval, predict, export, the estimate's child processes): it refuses a ``_target_`` where the
shipped groups have none or one no shipped option names (the allowlist derived from the
strategy registry and ``configs/``), any interpolation, and whatever the strict schema refuses,
as :class:`RefusedConfig` naming the file and key (one ``error:`` line through
``clean_errors``). A config this user did not seal describes the model only (:func:`model_part`).
See docs/cluster.md."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from videotrain.config import schema
from videotrain.config.build import CONFIG_DIR
from videotrain.data.loaders import READER_OPTIONS
from videotrain.memory.registry import STRATEGIES
from videotrain.untrusted import FILE_DATA_BOUNDS, plain_tree_problem, read_bytes, shown
from videotrain.untrusted.bounds import MAX_CONFIG_BYTES, BadValue
from videotrain.untrusted.formats import check_yaml

TRUSTED_RUN_HINT = (
    "If you trust this run, rebuild the model from this command line's config groups and load "
    "only the checkpoint's weights: add run_config=false and the run's groups and model keys "
    "({groups}data.root=...; the run's .hydra/overrides.yaml lists them), see "
    "docs/cluster.md#configs-read-from-files")


class RefusedConfig(ValueError):
    """A config read from a file that may not be instantiated: a ``_target_`` the shipped
    config groups do not configure there, an interpolation, or a key or value its schema
    refuses."""


@dataclasses.dataclass(frozen=True)
class ShippedOption:
    """One option of a schema-backed config group (``configs/model/head/tconv.yaml``)."""

    group: str                  # "model/head"
    option: str                 # "tconv"
    schema: type | None         # the dataclass its defaults list names (videotrain.config.schema)
    targets: frozenset[str]     # its _target_ as written, and the object's own dotted name
    name: str | None            # its `name:` value (data, optim, sched options have one)


def _aliases(target: str) -> frozenset[str]:
    """``target`` and ``module.qualname`` of the object it names: a shipped target is imported
    (it is videotrain's own code) so that a node written with either spelling is recognised,
    e.g. ``videotrain.memory.sbp.StochasticBackprop`` and ``...sbp.strategy.StochasticBackprop``
    (what ``memory=auto``'s candidates write)."""
    try:
        obj = get_object(target)
    except Exception:  # noqa: BLE001 - a shipped option that does not import is still listed
        return frozenset({target})
    return frozenset({target, f"{obj.__module__}.{obj.__qualname__}"})


def _package(text: str, group: str) -> str:
    """The dotted key a YAML file's content lands at (``# @package`` header, else its group)."""
    match = re.search(r"^#\s*@package\s+(\S+)", text, re.MULTILINE)
    package = match.group(1) if match else "_group_"
    if package == "_global_":
        return ""
    return group.replace("/", ".") if package == "_group_" else package


def _target_nodes(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """``(dotted key, target)`` of every mapping with a ``_target_`` in a plain YAML tree."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield path, str(node["_target_"])
        for key, value in node.items():
            if key != "defaults":
                yield from _target_nodes(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _target_nodes(value, f"{path}[{i}]")


@functools.lru_cache(maxsize=4)
def shipped_targets(config_dir: str = CONFIG_DIR) -> dict[str, frozenset[str]]:
    """Dotted key -> the ``_target_`` values the YAML under ``config_dir`` sets there, over
    every group option and experiment (``hydra/``, Hydra's own launcher settings, aside);
    ``memory`` -> the registered strategies' (whose YAML names the same, tested)."""
    root = Path(config_dir)
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.yaml")):
        group = path.parent.relative_to(root).as_posix()
        if group.split("/")[0] == "hydra":
            continue
        text = path.read_text()
        prefix = _package(text, "" if group == "." else group)
        for key, target in _target_nodes(yaml.safe_load(text) or {}, prefix):
            if key.split(".")[0] == "hydra" or key == "memory":  # Hydra's own callbacks: never
                continue                                         # in a run's config; memory: below
            found.setdefault(key, set()).update(_aliases(target))
    found["memory"] = {alias for s in STRATEGIES.values() for alias in _aliases(s.target)}
    return {key: frozenset(targets) for key, targets in found.items()}


@functools.lru_cache(maxsize=4)
def shipped_options(config_dir: str = CONFIG_DIR) -> tuple[ShippedOption, ...]:
    """The options of every schema-backed group (``videotrain.config.schema.SCHEMAS``) under
    ``config_dir``, with the schema each one's defaults list names."""
    options = []
    for group, schemas in schema.SCHEMAS.items():
        for path in sorted((Path(config_dir) / group).glob("*.yaml")):
            data = yaml.safe_load(path.read_text()) or {}
            named = [d for d in data.get("defaults", []) if isinstance(d, str) and d in schemas]
            target = data.get("_target_")
            options.append(ShippedOption(
                group, path.stem, schemas[named[0]] if named else None,
                _aliases(str(target)) if target else frozenset(),
                str(data["name"]) if "name" in data else None))
    return tuple(options)


# ---------------------------------------------------------------------- the check
def _walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, node)`` for ``node`` and every node below it, interpolations unresolved."""
    yield path, node
    if isinstance(node, DictConfig) and not node._is_interpolation() and not node._is_none() \
            and not node._is_missing():
        for key in node.keys():
            yield from _walk(node._get_node(key), f"{path}.{key}" if path else str(key))
    elif isinstance(node, ListConfig) and not node._is_interpolation() and not node._is_none() \
            and not node._is_missing():
        for i in range(len(node)):
            yield from _walk(node._get_node(i), f"{path}[{i}]")


def _node_at(cfg: DictConfig, dotted: str) -> Any:
    """The node at ``dotted`` without resolving anything on the way (None where there is no
    plain mapping to step into). ``key in cfg`` and ``cfg.get`` resolve interpolations, which
    may run a resolver: nothing here uses them before every interpolation is refused."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or node._is_interpolation() or node._is_none() \
                or node._is_missing() or part not in node.keys():
            return None
        node = node._get_node(part)
    return node


def _raw(node: DictConfig, key: str) -> str | None:
    """``node[key]`` as written (None when absent, null or an interpolation), unresolved."""
    child = _node_at(node, key)
    if child is None or child._is_interpolation() or child._value() is None:
        return None
    return str(child._value())


def _suggestion(cfg: DictConfig, config_dir: str) -> str:
    """``model/backbone=A|B model/head=C data=D `` for the groups whose node names a shipped
    option (by its allowed target or its name), so that the hint says what to pass."""
    parts = []
    for group in ("model/backbone", "model/head", "data"):
        node = _node_at(cfg, group.replace("/", "."))
        if not isinstance(node, DictConfig) or node._is_interpolation():
            continue
        target, name = _raw(node, "_target_"), _raw(node, "name")
        matches = [o.option for o in shipped_options(config_dir) if o.group == group
                   and (target in o.targets if target is not None else name is not None and o.name == name)]
        if matches:
            parts.append(f"{group}={'|'.join(matches)} ")
    return "".join(parts) or "model/backbone=... model/head=... data=... "


def _refuse(cfg: DictConfig, source: str, what: str, config_dir: str) -> RefusedConfig:
    hint = TRUSTED_RUN_HINT.format(groups=_suggestion(cfg, config_dir))
    return RefusedConfig(f"{source}: {what}; nothing of this config was instantiated. {hint}")


def _check_targets(cfg: DictConfig, source: str, config_dir: str) -> None:
    allowed = shipped_targets(config_dir)
    for path, node in _walk(cfg):  # first: nothing below may resolve one
        if path and node._is_interpolation():
            raise _refuse(cfg, source, f"{shown(path)} is an interpolation ({shown(node._value())}); videotrain "
                          "writes its configs resolved, and resolving one may run code", config_dir)
    for path, node in _walk(cfg):
        if not isinstance(node, DictConfig) or node._is_interpolation() or node._is_none() \
                or node._is_missing() or "_target_" not in node.keys():
            continue
        target = node._get_node("_target_")._value()
        key = f"{path}._target_" if path else "_target_"
        if path not in allowed:
            raise _refuse(cfg, source, f"{shown(key)}={shown(target)} is refused: a _target_ where the schema has "
                          f"none (only {', '.join(sorted(allowed))} take one)", config_dir)
        if str(target) not in allowed[path]:
            raise _refuse(cfg, source, f"{shown(key)}={shown(target)} is refused: no shipped config of {shown(path)} "
                          f"builds it (they build {', '.join(sorted(allowed[path]))})", config_dir)


def _candidates(group: str, node: DictConfig, config_dir: str) -> list[type]:
    """The schemas ``node`` may be checked against, best match first: the options whose
    ``_target_`` it has (groups with targets: only those), else whose ``name`` it has, then
    the rest of the group's."""
    options = [o for o in shipped_options(config_dir) if o.group == group and o.schema is not None]
    if any(o.targets for o in options):
        options = [o for o in options if _raw(node, "_target_") in o.targets]
    else:
        options.sort(key=lambda o: o.name is None or o.name != _raw(node, "name"))
    schemas: list[type] = []
    for o in options:
        if o.schema not in schemas:
            schemas.append(o.schema)
    return schemas


def _typed(schema_cls: type) -> DictConfig:
    """An instance of a schema that accepts extra keys while merging, so that ``check_keys``
    can name them (as it does for ``+key=value`` on a composed config)."""
    node = OmegaConf.structured(schema_cls)
    OmegaConf.set_struct(node, False)
    return node


def _fits(typed: DictConfig, node: DictConfig, prefix: str) -> bool:
    try:
        schema.check_keys(OmegaConf.merge(typed, node), prefix)
    except (OmegaConfBaseException, ValueError):
        return False
    return True


def _check_schema(cfg: DictConfig, source: str, config_dir: str) -> None:
    template = _typed(schema.RootSchema)
    OmegaConf.set_struct(template.model, False)
    for group in schema.SCHEMAS:
        key = group.replace("/", ".")
        node = _node_at(cfg, key)
        if node is None or node._is_none():
            continue  # a group an older run did not have: the command line supplies it
        if not isinstance(node, DictConfig):
            raise _refuse(cfg, source, f"{key} must be a mapping (the {group} config group), got "
                          f"a {type(node._value()).__name__}", config_dir)
        schemas = _candidates(group, node, config_dir)
        if not schemas:
            raise _refuse(cfg, source, f"{key} has no _target_ a shipped {group} option has",
                          config_dir)
        chosen = next((s for s in schemas if _fits(_typed(s), node, f"{key}.")), schemas[0])
        OmegaConf.update(template, key, _typed(chosen), merge=False)  # its error is reported below
    try:
        schema.check_keys(OmegaConf.merge(template, cfg))
    except OmegaConfBaseException as err:
        # OmegaConf's message quotes the value: the file's text never reaches an error, so say
        # the key, the kind of value and what refused it instead
        where = shown(err.full_key, 200) if getattr(err, "full_key", None) else "a value"
        kind = type(getattr(err, "value", None)).__name__
        raise _refuse(cfg, source, f"does not fit videotrain's config schema: {where}: a {kind} "
                      f"that the schema does not accept there ({type(err).__name__})",
                      config_dir) from None
    except schema.UnknownConfigKey as err:
        raise _refuse(cfg, source, f"does not fit videotrain's config schema: {shown(str(err), 300)}",
                      config_dir) from None


def checked_config(data: Mapping[str, Any] | DictConfig, source: str,
                   config_dir: str = CONFIG_DIR) -> DictConfig:
    """``data`` (a config read from ``source``: a file, a checkpoint) as a ``DictConfig``,
    after the checks of the module docstring; raises :class:`RefusedConfig` naming the key.
    Nothing in ``data`` is resolved or instantiated here."""
    if isinstance(data, DictConfig):
        cfg = data
    elif isinstance(data, Mapping):
        problem = plain_tree_problem(data)  # bounded, before OmegaConf expands anything
        if problem:
            raise RefusedConfig(f"{source}: not a config of plain values: {problem}; nothing of "
                                "it was read further")
        try:
            cfg = OmegaConf.create(dict(data))
        except OmegaConfBaseException as err:
            raise RefusedConfig(f"{source}: not a config of plain values: "
                                f"{shown(str(err).splitlines()[0], 200)}") from None
    else:
        raise RefusedConfig(f"{source}: not a config (a {type(data).__name__}, not a mapping)")
    _check_targets(cfg, source, config_dir)
    _check_schema(cfg, source, config_dir)
    return cfg


def load_yaml(text: str, source: str) -> Any:
    """``text`` parsed as plain YAML data (YAML's safe loader: no Python tags), refusing
    anchors and aliases, more values than a config has and deep nesting before anything is
    composed (``untrusted.formats.check_yaml``: a 2 KB alias bomb expands to gigabytes, and
    nesting ends in a ``RecursionError``; videotrain writes neither). An error names the file,
    the line and the problem, never the text."""
    try:
        check_yaml(text, source)
        # OmegaConf's loader (YAML's safe one, with YAML 1.2 floats), as OmegaConf.load reads
        data = OmegaConf.to_container(OmegaConf.create(text), resolve=False) if text.strip() else {}
    except BadValue as err:
        raise RefusedConfig(str(err)) from None
    except AssertionError:  # OmegaConf.create of a document that is one scalar
        raise RefusedConfig(f"{source}: not a config (a YAML scalar, not a mapping)") from None
    except OmegaConfBaseException as err:
        raise RefusedConfig(f"{source}: not a config of plain values "
                            f"({shown(str(err).splitlines()[0])})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise RefusedConfig(f"{source}{where}: cannot be read as a YAML config "
                            f"({shown(problem)})") from None
    return data


def read_config_file(path: str | Path, config_dir: str = CONFIG_DIR) -> DictConfig:
    """A YAML config file (a run folder's ``config.yaml``): a regular file of at most
    ``MAX_CONFIG_BYTES`` (no link, FIFO or device: ``untrusted.read_bytes``) passed to
    :func:`parse_config_bytes`."""
    p = Path(path)
    return parse_config_bytes(read_bytes(p, MAX_CONFIG_BYTES, "config file"), shown(p), config_dir)


def parse_config_bytes(data: bytes, source: str, config_dir: str = CONFIG_DIR) -> DictConfig:
    """``data`` (a config file's bytes, read once: what its seal covers) as UTF-8 text, parsed
    as plain data without anchors or aliases (:func:`load_yaml`), bounded
    (``untrusted.plain_tree_problem``) and passed through :func:`checked_config`."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RefusedConfig(f"{source}: byte {err.start} is not UTF-8") from None
    tree = load_yaml(text, source)
    if not isinstance(tree, dict):
        raise RefusedConfig(f"{source}: not a config (a YAML {type(tree).__name__}, not a mapping)")
    return checked_config(tree, source, config_dir)


# ---------------------------------------------------------------------- configs not sealed by this user
# What a config read from a file that this user did not seal (videotrain.untrusted.own: someone
# else's run, or one from before seals) may set: what defines the trained model. Everything
# else (paths and file names, workers, batch sizes, generated data, devices, output places) is
# this command line's (docs/cluster.md#configs-read-from-files).
MODEL_DATA_KEYS = (*FILE_DATA_BOUNDS, "sampler")  # the clip: length, crop, its span in time
MODEL_KEYS = ("model.backbone", "model.head", *(f"data.{k}" for k in MODEL_DATA_KEYS),
              "trainer.precision")
FILE_KWARGS = ("checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")  # timm's
# the data keys that choose which videos and labels are scored (data.root too, but for
# generated data, whose contents its settings fix): evaluating on the command line's instead
# would change the figures silently, so a difference there is refused, not ignored
DATASET_KEYS = ("name", "layout", "num_classes", "synthetic", "drop_classes",
                *sorted({o for opts in READER_OPTIONS.values() for o in opts}))
NEVER_FROM_FILES = ("eval", "predict", "export", "hydra", "checkpoint", "run_config", "video")


def override_keys(overrides: list[str]) -> set[str]:
    """The dotted keys command-line ``overrides`` set (``model/head=mean`` -> ``model.head``)."""
    return {o.split("=", 1)[0].lstrip("+~").replace("/", ".") for o in overrides}


def _given(key: str, given: set[str]) -> bool:
    """``key`` or a node above it is set on the command line."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in given for i in range(1, len(parts) + 1))


FREE_FORM = ("data.hflip_label_map", "model.backbone.kwargs")  # keys of the file's choosing


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of a plain config tree (lists, and the mappings whose
    keys are the file's own text, :data:`FREE_FORM`, are values: their keys are never named)."""
    if isinstance(node, dict) and prefix not in FREE_FORM:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def _model_value(key: str, value: Any, source: str) -> Any:
    """``value`` of a model key from an unsealed config, within its bound (refused naming the
    key and the bound) and without timm arguments that name files."""
    name = key.removeprefix("data.")
    if name in FILE_DATA_BOUNDS and value is not None:
        bound = FILE_DATA_BOUNDS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= bound:
            raise RefusedConfig(
                f"{source}: {key} is {shown(value)}; a config this user did not seal may set it "
                f"from above 0 up to {bound}. Pass {key}=... on the command line if you mean it "
                "(docs/cluster.md#configs-read-from-files)")
    if key == "model.backbone" and isinstance(value, dict) and isinstance(value.get("kwargs"), dict):
        value["kwargs"] = {k: v for k, v in value["kwargs"].items() if k not in FILE_KWARGS}
    return value


def model_part(base: DictConfig, composed: DictConfig, overrides: list[str], source: str,
               scores_data: bool = False) -> tuple[DictConfig, list[str]]:
    """``composed`` (this command line's config) with what defines the model (:data:`MODEL_KEYS`)
    taken from ``base``, a checked config read from ``source`` that this user did not seal;
    keys the command line sets themselves (``data.crop_size=...``, ``model/head=mean``) stay
    its own. Returns it and the keys of ``base`` not used (set
    there to another value). ``scores_data`` (eval): a dataset key (:data:`DATASET_KEYS`)
    whose value differs and that the command line does not set is refused, naming the keys."""
    given = override_keys(overrides)
    out = OmegaConf.create(OmegaConf.to_container(composed, resolve=True))
    plain = OmegaConf.to_container(base, resolve=False)  # checked: nothing to resolve
    for key in MODEL_KEYS:
        node: Any = plain
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None or key in given:  # (a group chosen, data=kinetics, keeps the clip)
            continue  # an older run without it, or the command line's own value
        OmegaConf.update(out, key, _model_value(key, node, source), merge=False, force_add=True)
    mine = _leaves(OmegaConf.to_container(out, resolve=True))
    theirs = _leaves(plain)
    unused = sorted(k for k, v in theirs.items() if k.split(".")[0] not in NEVER_FROM_FILES
                    and not _given(k, given) and (k not in mine or mine[k] != v))
    if scores_data:
        generated = theirs.get("data.name") == "synthetic" == mine.get("data.name")
        keys = {f"data.{k}" for k in DATASET_KEYS} | (set() if generated else {"data.root"})
        differ = [k for k in unused if k in keys or k.rsplit(".", 1)[0] in keys]
        if differ:
            raise RefusedConfig(
                f"{source}: this user did not seal it (someone else's run, or one from before "
                "runs were sealed), so it chooses no dataset, and this command line's dataset "
                f"differs from the run's in {listed_keys(differ)}: pass the dataset to "
                "evaluate on the command line (data=... data.root=... and those keys; the run's "
                ".hydra/overrides.yaml lists what it trained with), see "
                "docs/cluster.md#configs-read-from-files")
    return out, unused


def listed_keys(keys: list[str], limit: int = 10) -> str:
    """The first ``limit`` of ``keys`` (config keys, escaped), and how many more."""
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(shown(k) for k in keys[:limit]) + more
