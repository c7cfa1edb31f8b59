"""Bounded readers of the text formats someone else's files come in: JSON, JSON lines, YAML.

Each is counted before it is parsed, so that no parser meets what it handles badly: a JSON
document's values and nesting (``json`` would build a 40 MB list of empty objects as gigabytes,
and meet deep nesting as a ``RecursionError``), a JSON-lines file's bytes and lines (a file of
newlines is counted in chunks, never split), a YAML text's anchors, aliases, tags, values and
nesting from the parser's events (a 660-byte alias bomb, or ``[`` repeated, which PyYAML's
scanner takes quadratic time over, never reaches the composer). What is read is then checked
against its declared schema (``untrusted.bounds.checked``); every error is one ``BadValue``
naming the file (and line) and never the text. The bounds are ``untrusted.bounds``'.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from videotrain.untrusted.bounds import (
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_NODES,
    MAX_JSON_VALUES,
    MAX_METRICS_BYTES,
    MAX_METRICS_LINE_BYTES,
    MAX_METRICS_LINES,
    MAX_RESULTS_BYTES,
    BadValue,
    Spec,
    checked,
)
from videotrain.untrusted.files import open_regular, read_text
from videotrain.untrusted.text import shown

# a JSON string (escapes included; an unterminated one runs to the end: linear, no retries)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


def json_problem(text: str, max_values: int = MAX_JSON_VALUES,
                 max_depth: int = MAX_CONFIG_DEPTH) -> str | None:
    """Why ``text`` may not be handed to ``json``, or None: more than ``max_values`` values or
    nested deeper than ``max_depth`` (which ``json`` would meet as a ``RecursionError``),
    counted on the text before anything is built. Values are over-counted (every separator,
    bracket and pair of quotes, in strings too); the nesting is followed outside strings, and
    only where the text has more brackets than ``max_depth`` at all."""
    opened = text.count("[") + text.count("{")
    if opened + text.count(",") + text.count(":") + text.count('"') // 2 >= max_values:
        return f"more than {max_values} values"
    if opened > max_depth:
        depth = 0
        for found in _BRACKETS.finditer(_JSON_STRING.sub("", text)):
            depth += 1 if found.group() in "[{" else -1
            if depth > max_depth:
                return f"nested more than {max_depth} levels deep"
    return None


def parse_json(text: str, where: str, max_values: int = MAX_JSON_VALUES,
               max_depth: int = MAX_CONFIG_DEPTH) -> Any:
    """``text`` parsed as JSON after :func:`json_problem`; :class:`BadValue` names ``where``
    and the line, never the text."""
    problem = json_problem(text, max_values, max_depth)
    if problem:
        raise BadValue(f"{where}: {problem}; not read further")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise BadValue(f"{where}:{err.lineno}: not JSON ({err.msg})") from None
    except (ValueError, RecursionError) as err:  # e.g. an integer of more than 4300 digits
        raise BadValue(f"{where}: not JSON ({type(err).__name__})") from None


def read_json(path: str | Path, spec: Spec, limit: int = MAX_RESULTS_BYTES,
              what: str = "JSON file") -> Any:
    """The JSON file ``path`` as ``spec`` declares it: a regular file of at most ``limit``
    bytes (``files.read_text``: no link, FIFO or device), :func:`parse_json`, :func:`checked`."""
    where = shown(Path(path))  # JSON has no shared references; parse_json counted the rest
    return checked(parse_json(read_text(path, limit, what), where), spec, where, max_nodes=None)


def read_jsonl(path: str | Path, spec: Spec, limit: int = MAX_METRICS_BYTES,
               max_lines: int = MAX_METRICS_LINES, max_line_bytes: int = MAX_METRICS_LINE_BYTES,
               what: str = "JSON-lines file") -> Iterator[tuple[int, bytes, Any]]:
    """``(line number, the line's bytes without its newline, its value)`` for each non-blank
    line of ``path``, each value :func:`checked` against ``spec``. Before any line is parsed
    the file's size (at most ``limit``) and its lines (at most ``max_lines``, counted in
    chunks) are bounded, so a file of newlines costs a count; a line over ``max_line_bytes``
    is refused unread."""
    where = shown(Path(path))
    with open_regular(path, limit, what) as f:
        lines = 0
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
            if lines > max_lines:
                raise BadValue(f"{where}: more than {max_lines} lines; not read further")
        f.seek(0)
        lineno = 0
        while line := f.readline(max_line_bytes + 2):
            lineno += 1
            body = line.rstrip(b"\r\n")
            if len(body) > max_line_bytes:
                raise BadValue(f"{where}:{lineno}: a line longer than {max_line_bytes} bytes")
            if not body.strip():
                continue
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as err:
                raise BadValue(f"{where}:{lineno}: byte {err.start} is not UTF-8") from None
            value = parse_json(text, f"{where}:{lineno}")
            yield lineno, body, checked(value, spec, f"{where}:{lineno}", max_nodes=None)


_PLAIN_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null",
                                                              "seq", "map"))


def check_yaml(text: str, where: str, max_nodes: int = MAX_CONFIG_NODES,
               max_depth: int = MAX_CONFIG_DEPTH) -> None:
    """Refuse (:class:`BadValue`, naming ``where`` and the line) YAML text that is not plain
    data of at most ``max_nodes`` values, ``max_depth`` deep, without anchors or aliases (a
    660-byte alias bomb expands to gigabytes; videotrain writes none), read from the parser's
    events (YAML's safe loader), so nothing is composed before the check has passed. A tag
    other than YAML's plain types (``!!python/...``) is refused too."""
    import yaml

    # per open collection: is it a mapping, and is its next node a key (keys are not values)
    open_: list[list[bool]] = []
    values = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            line = event.start_mark.line + 1 if event.start_mark else "?"
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise BadValue(f"{where}:{line}: a YAML anchor or alias (&name / *name); configs "
                               "read from files may not use them (videotrain writes none), "
                               "nothing of it was composed")
            tag = getattr(event, "tag", None)
            if tag is not None and tag not in _PLAIN_TAGS:
                raise BadValue(f"{where}:{line}: cannot be read as a YAML config (a YAML tag, "
                               f"{shown(tag, 60)}: a config read from a file is plain data); "
                               "nothing of it was composed")
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                open_.pop()
                continue
            if not isinstance(event, yaml.NodeEvent):  # stream and document events
                continue
            top = open_[-1] if open_ else None
            if top is not None and top[0]:
                is_key, top[1] = top[1], not top[1]
            else:
                is_key = False
            if not is_key:
                values += 1
                if values > max_nodes:
                    raise BadValue(f"{where}:{line}: more than {max_nodes} values; a config has "
                                   "a few hundred")
            if isinstance(event, yaml.CollectionStartEvent):
                open_.append([isinstance(event, yaml.MappingStartEvent), True])
                if len(open_) > max_depth:
                    raise BadValue(f"{where}:{line}: nested more than {max_depth} levels deep; "
                                   "nothing of it was composed")
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise BadValue(f"{where}{at}: cannot be read as a YAML config ({shown(problem)})") from None


def load_yaml_data(text: str, where: str, max_nodes: int = MAX_CONFIG_NODES,
                   max_depth: int = MAX_CONFIG_DEPTH) -> Any:
    """``text`` as plain YAML data (the safe loader) once :func:`check_yaml` has passed it."""
    import yaml

    check_yaml(text, where, max_nodes, max_depth)
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, OverflowError) as err:  # a date out of range
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise BadValue(f"{where}{at}: cannot be read as YAML data "
                       f"({shown(getattr(err, 'problem', None) or type(err).__name__)})") from None
