"""Values read from files, as they may be shown: escaped and cut (never raw in a sink).

A sink is the terminal, a log, an error message or a file the project writes. :func:`shown`
keeps a short printable value as it is and ``repr``-escapes anything else (newlines, terminal
escapes, bidirectional controls visible), cut to :data:`SHOWN_CHARS` characters; :func:`quoted`
always quotes. Neither expands more than its limit of a large value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHOWN_CHARS = 100  # a value read from a file is cut to this many characters when shown
PATH_CHARS = 1000  # a path (a Path object) is cut at this many
NAME_CHARS = SHOWN_CHARS  # a class name as shown, escapes and cut included (SSv2's run to 80)


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` as it may be logged or printed: a short printable string as it is, anything
    else ``repr``-style (control characters, newlines and terminal escapes visible), cut to
    ``limit`` characters with the length said. Never expands more than ``limit`` characters of
    a large value (a long string, a deep list)."""
    if isinstance(value, Path):  # a path is shown whole up to PATH_CHARS: it says where
        value, limit = str(value), max(limit, PATH_CHARS)
    if isinstance(value, str):
        if len(value) <= limit and value.isprintable():
            return value
        cut = value[:limit]
        text = cut if cut.isprintable() else repr(cut)
        return text if len(value) <= limit else f"{text}...({len(value)} chars)"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    import reprlib  # bounded: a few items per level, a few levels deep

    r = reprlib.Repr()
    r.maxstring = r.maxother = limit
    r.maxlevel = 4
    text = r.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...(cut)"


def quoted(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` (a string: a class name, a key) always ``repr``-quoted, escaped and cut to
    ``limit`` characters; other values as :func:`shown` gives them."""
    if not isinstance(value, str):
        return shown(value, limit)
    text = repr(value[:limit])
    return text if len(value) <= limit else f"{text}...({len(value)} chars)"


def shown_name(name: Any) -> str:
    """A class name read from a file (a checkpoint, ``results.json``, a dataset's class list),
    as predict prints it and export records it: :func:`shown`, but at most :data:`NAME_CHARS`
    characters in all, escapes and the cut's note included, so that showing it again (a
    table's cell, a log line) leaves it as it is."""
    text = name if isinstance(name, str) else str(name)[:4 * NAME_CHARS]
    whole = shown(text, NAME_CHARS)
    if len(whole) <= NAME_CHARS:
        return whole
    note = f"...({len(text)} chars)"
    keep = NAME_CHARS - len(note)
    while keep > 1 and len(shown(text[:keep], keep)) + len(note) > NAME_CHARS:
        keep -= 1  # escapes take up to 10 characters each: fewer of the name's fit
    return shown(text[:keep], keep) + note
