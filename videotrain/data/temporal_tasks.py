"""Synthetic temporal tasks for the accuracy sweep (``benchmarks/conf/sweep/accuracy.yaml``).

Each task has four classes built from two reversible events (the default task's trick): every
class shares one distribution of frame sets, so an order-blind model is at chance (0.25) and
only a model comparing frames in time order solves it. Tasks: ``direction`` (motion over a busy
texture with a decoy), ``rotation`` (of a bar, then zoom of a disc), ``order`` (of three
colours), ``speed`` (once or twice across per clip). Renderers take the spec and a numpy
``Generator`` and return uint8 ``(T, H, W, 3)`` frames, deterministic for the generator state.
Details: docs/design/internals.md#the-accuracy-sweeps-temporal-tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np


class SyntheticSpec(Protocol):
    """What a renderer reads of the generator's spec (``synthetic.SyntheticSpec``, which
    imports this module)."""

    num_frames: int
    size: int
    object_size: int
    travel: float

RED = np.array([230, 40, 40], dtype=np.float32)
GREEN = np.array([40, 200, 60], dtype=np.float32)
BLUE = np.array([40, 80, 235], dtype=np.float32)


def texture(rng: np.random.Generator, size: int, noise: float = 12.0) -> np.ndarray:
    """A smooth random colour texture, (H, W, 3) float32 in [0, 255]."""
    coarse = rng.uniform(60, 190, size=(size // 8 + 2, size // 8 + 2, 3)).astype(np.float32)
    tex = np.kron(coarse, np.ones((8, 8, 1), dtype=np.float32))[:size, :size]
    for axis in (0, 1):  # blur the blocks a little so the texture has no hard grid edges
        tex = (tex + np.roll(tex, 3, axis=axis) + np.roll(tex, -3, axis=axis)) / 3.0
    tex += rng.normal(0, noise, size=tex.shape).astype(np.float32)
    return np.clip(tex, 0, 255)


def _square(size: int, x: float, y: float, side: int, wrap: bool = False) -> np.ndarray:
    """Boolean (H, W) mask of a ``side`` square with top-left corner (x, y); ``wrap``: x is
    taken modulo the width, so the square leaves on one side and enters on the other."""
    x0 = int(round(x))
    xs = (np.arange(x0, x0 + side) % size) if wrap else np.arange(max(x0, 0), min(x0 + side, size))
    y0 = int(round(y))
    mask = np.zeros((size, size), dtype=bool)
    rows = np.arange(max(y0, 0), min(y0 + side, size))
    mask[np.ix_(rows, xs)] = True
    return mask


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    return xx, yy


def render_direction(spec: SyntheticSpec, label: int, rng: np.random.Generator) -> np.ndarray:
    """Two strokes as in the default task (red: right/left, then blue: down/up; the same class
    order), with a smaller object, a flickering texture and a red decoy that jitters in place
    (with a blue decoy too, the default model stayed at chance within 4 epochs)."""
    horiz = 1 if label in (0, 1) else -1
    vert = 1 if label in (0, 2) else -1
    size, obj, T = spec.size, max(5 * spec.object_size // 6, 3), spec.num_frames
    travel = spec.travel * size
    half = T // 2
    background = texture(rng, size, noise=0.0)
    dx, dy = rng.uniform(0, size - obj, 2)  # the red decoy
    lo_r = rng.uniform(0, size - obj - travel)
    lo_b = rng.uniform(0, size - obj - travel)
    across_r, across_b = rng.uniform(0, size - obj, 2)
    frames = np.empty((T, size, size, 3), dtype=np.uint8)
    for t in range(T):
        frame = background + rng.normal(0, 8, size=background.shape).astype(np.float32)
        jx, jy = rng.uniform(-2, 2, 2)  # the decoy jitters in place: no direction
        frame[_square(size, dx + jx, dy + jy, obj)] = RED
        if t < half:
            s = t / max(half - 1, 1)
            x = lo_r + (s if horiz > 0 else 1 - s) * travel
            frame[_square(size, x, across_r, obj)] = RED
        else:
            s = (t - half) / max(T - half - 1, 1)
            y = lo_b + (s if vert > 0 else 1 - s) * travel
            frame[_square(size, across_b, y, obj)] = BLUE
        frames[t] = np.clip(frame, 0, 255).astype(np.uint8)
    return frames


def render_rotation(spec: SyntheticSpec, label: int, rng: np.random.Generator) -> np.ndarray:
    """First half: a red bar turns clockwise (labels 0, 1) or counter-clockwise by 90 degrees
    from a random angle; second half: a blue disc zooms in (labels 0, 2) or out."""
    clockwise = label in (0, 1)
    zoom_in = label in (0, 2)
    size, T = spec.size, spec.num_frames
    half = T // 2
    xx, yy = _grid(size)
    background = texture(rng, size)
    length, width = 0.32 * size, max(size / 16, 2.0)
    cx, cy = rng.uniform(0.35 * size, 0.65 * size, 2)
    a0 = rng.uniform(0, np.pi)
    dx, dy = rng.uniform(0.3 * size, 0.7 * size, 2)
    r_small, r_big = 0.08 * size, 0.22 * size
    frames = np.empty((T, size, size, 3), dtype=np.uint8)
    for t in range(T):
        frame = background.copy()
        if t < half:
            s = t / max(half - 1, 1)
            angle = a0 + (s if clockwise else -s) * np.pi / 2  # y grows downwards: + is clockwise
            u, v = np.cos(angle), np.sin(angle)
            along = (xx - cx) * u + (yy - cy) * v
            across = -(xx - cx) * v + (yy - cy) * u
            frame[(np.abs(along) <= length) & (np.abs(across) <= width / 2)] = RED
        else:
            s = (t - half) / max(T - half - 1, 1)
            r = r_small + (s if zoom_in else 1 - s) * (r_big - r_small)
            frame[(xx - dx) ** 2 + (yy - dy) ** 2 <= r * r] = BLUE
        frames[t] = frame.astype(np.uint8)
    return frames


ORDERS: tuple[tuple[int, int, int], ...] = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))
_COLOURS = (RED, GREEN, BLUE)


def render_order(spec: SyntheticSpec, label: int, rng: np.random.Generator) -> np.ndarray:
    """A square that jitters in place shows three colours one after another, in the class's
    order; the three segment lengths are a random permutation of a near-equal split of the clip.
    (No drift: along a path, the middle colour would sit in the middle of the frame set.)"""
    size, obj, T = spec.size, max(5 * spec.object_size // 6, 3), spec.num_frames
    lengths = rng.permutation([T // 3 + (1 if k < T % 3 else 0) for k in range(3)])
    colours = [c for k, n in zip(ORDERS[label], lengths, strict=True) for c in [k] * int(n)]
    background = texture(rng, size)
    x, y = rng.uniform(1, size - obj - 1, 2)
    frames = np.empty((T, size, size, 3), dtype=np.uint8)
    for t in range(T):
        frame = background.copy()
        jx, jy = rng.uniform(-1, 1, 2)
        mask = _square(size, x + jx, y + jy, obj)  # half-transparent: the colour is faint
        frame[mask] = 0.8 * _COLOURS[colours[t]] + 0.2 * frame[mask]
        frames[t] = frame.astype(np.uint8)
    return frames


def render_speed(spec: SyntheticSpec, label: int, rng: np.random.Generator) -> np.ndarray:
    """A small red square wraps around the frame to the right (labels 0, 1) or left, once
    (labels 0, 2) or twice per clip, from a random phase."""
    sign = 1 if label in (0, 1) else -1
    laps = 1.0 if label in (0, 2) else 2.0
    # 7 px at the default object_size 12: at 8 px the default model reached 0.99, at 6 px 0.37
    size, obj, T = spec.size, max(7 * spec.object_size // 12, 3), spec.num_frames
    background = texture(rng, size)
    x0, y = rng.uniform(0, size), rng.uniform(0, size - obj)
    frames = np.empty((T, size, size, 3), dtype=np.uint8)
    for t in range(T):
        frame = background.copy()
        x = (x0 + sign * laps * size * t / T) % size
        frame[_square(size, x, y, obj, wrap=True)] = RED
        frames[t] = frame.astype(np.uint8)
    return frames


class Task(NamedTuple):
    classes: tuple[str, ...]
    render: Callable[[SyntheticSpec, int, np.random.Generator], np.ndarray]
    # part of the cache folder's name: bump it whenever the renderer draws differently, or a
    # cached dataset of the old drawing is reused (the spec's fields alone did not change)
    version: int = 1


TASKS: dict[str, Task] = {
    "direction": Task(("right_then_down", "right_then_up", "left_then_down", "left_then_up"),
                      render_direction, version=3),
    "rotation": Task(("clockwise_then_zoom_in", "clockwise_then_zoom_out",
                      "counterclockwise_then_zoom_in", "counterclockwise_then_zoom_out"),
                     render_rotation),
    "order": Task(tuple("_".join(("red", "green", "blue")[k] for k in o) for o in ORDERS), render_order,
                  version=2),
    "speed": Task(("right_slow", "right_fast", "left_slow", "left_fast"), render_speed, version=3),
}
