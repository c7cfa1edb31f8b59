"""The one reader's bounds: what a value read from someone else's file may be.

Every value read from a checkpoint, ``results.json``, ``metrics.jsonl``, a sweep folder or a
config is checked here before use. This module owns the bounds (sizes, counts, depths).
"""

from __future__ import annotations

from typing import Any

from videotrain.untrusted.text import shown

MAX_CONFIG_NODES = 20_000  # a run's resolved config has a few hundred
MAX_CONFIG_DEPTH = 32

# What one video may cost (predict, eval, training: videotrain.data.media_budget checks them,
# from the header before decoding and on every decoded frame before it becomes RGB). A few KB
# of H.264 can declare 8192x8192 frames or fifty million of them; docs/data.md states these.
MAX_FRAME_PIXELS = 4096 * 4096  # width x height of one frame (16.8 MP: 4K DCI fits)
MAX_VIDEO_FRAMES = 36_000  # frames in one video: 20 minutes at 30 fps, 10 at 60
MAX_DECODED_PIXELS = 2**35  # decoded in one read of a video: 16,000 frames at 1920x1080
MAX_DECODED_BYTES = 320 * 2**20  # held at once by one read: frames waiting + the RGB returned
MAX_FFMPEG_ALLOC = 64 * 2**20  # any one allocation FFmpeg makes (its index of a file's frames)

# what a config read from a file that this user did not seal may set of the clip the model sees
# (videotrain.config_files.model_part); larger values are refused naming the key. A frame of
# 512 px short side and 128 frames is past every shipped model; the command line may go further.
FILE_DATA_BOUNDS = {"num_frames": 128, "crop_size": 448, "short_side": 512,
                    "sampling_rate": 64, "fps": 240}


def plain_tree_problem(obj: Any, max_nodes: int = MAX_CONFIG_NODES,
                       max_depth: int = MAX_CONFIG_DEPTH) -> str | None:
    """Why ``obj`` (a config read from a file or a checkpoint, as plain Python values) may not
    be expanded, or None: more than ``max_nodes`` values, deeper than ``max_depth``, a container
    met twice (a pickle's or YAML's shared reference: 3 KB that expand to gigabytes), or a
    value that is not ``dict``/``list``/``str``/``int``/``float``/``bool``/None. Stops at the
    first problem, after at most ``max_nodes`` visits."""
    seen: set[int] = set()
    stack: list[tuple[Any, int, str]] = [(obj, 0, "")]
    count = 0
    while stack:
        node, depth, where = stack.pop()
        count += 1
        if count > max_nodes:
            return f"more than {max_nodes} values"
        if depth > max_depth:
            return f"nested more than {max_depth} levels deep (at {shown(where)})"
        if isinstance(node, (dict, list, tuple)):
            if id(node) in seen:
                return f"a shared reference at {shown(where)} (an alias: one node used twice)"
            seen.add(id(node))
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in items:
                if isinstance(node, dict) and not isinstance(key, (str, int)):
                    return f"a key of type {type(key).__name__} at {shown(where)}"
                stack.append((value, depth + 1, f"{where}.{key}" if where else str(key)))
        elif node is not None and not isinstance(node, (str, int, float, bool)):
            return f"a {type(node).__name__} at {shown(where)}"
    return None
