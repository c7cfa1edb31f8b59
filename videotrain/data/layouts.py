"""Writers of the on-disk layouts the real datasets ship in, fed by the synthetic generator,
and ``generate`` / ``ensure_synthetic``, which write (once, atomically) and cache a dataset.

Each writer takes the same clips (``synthetic.render_all``) and writes videos and annotation
files the way the dataset's own download does (``kinetics``, ``folder``, ``ucf101``,
``hmdb51``, ``ssv2``), so each reader is tested on files that no reader wrote. Fold 1 of UCF101
and HMDB51 tests on the generator's val clips, matching the Kinetics layout's split exactly;
folds 2 and 3 test on other, rotated, blocks of clips. Each layout's files:
``docs/design/internals.md``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from videotrain.data.synthetic import Clip, SyntheticSpec, render_all, write_video
from videotrain.untrusted.files import make_dirs, rename, write_bytes, write_text

FOLDS = (1, 2, 3)


def clip_number(spec: SyntheticSpec, clip: Clip) -> int:
    """The clip's index within its class over both splits (train first)."""
    return clip.i + (spec.train_per_class if clip.split == "val" else 0)


def in_test_fold(spec: SyntheticSpec, j: int, fold: int) -> bool:
    """Whether clip ``j`` of a class is a test clip of ``fold`` (a rotating block)."""
    n = spec.train_per_class + spec.val_per_class
    return (j - spec.train_per_class - spec.val_per_class * (fold - 1)) % n < spec.val_per_class


def camel(name: str) -> str:
    """UCF101 class names are CamelCase: ``right_then_down`` -> ``RightThenDown``."""
    return "".join(w.capitalize() for w in name.split("_"))


def ssv2_template(name: str) -> str:
    return "Moving [something] " + name.replace("_", " ")


def write_kinetics(root: Path, spec: SyntheticSpec, clips: Iterable[Clip],
                   annotations: bool = True) -> None:
    lines: dict[str, list[str]] = {"train": [], "val": []}
    for clip in clips:
        name = spec.classes[clip.label]
        rel = f"{clip.split}/{name}/{name}_{clip.i:04d}.mp4"
        write_video(root / rel, clip.frames, spec.fps, root)
        lines[clip.split].append(f"{rel} {clip.label}")
    if annotations:
        for split, split_lines in lines.items():
            write_text(root / f"{split}.csv", "\n".join(split_lines) + "\n", root)
        write_text(root / "classes.txt", "\n".join(spec.classes) + "\n", root)


def write_folder(root: Path, spec: SyntheticSpec, clips: Iterable[Clip]) -> None:
    write_kinetics(root, spec, clips, annotations=False)


def write_ucf101(root: Path, spec: SyntheticSpec, clips: Iterable[Clip]) -> None:
    entries = []  # (label, j, relative path)
    for clip in clips:
        cls, j = camel(spec.classes[clip.label]), clip_number(spec, clip)
        rel = f"{cls}/v_{cls}_g{j + 1:02d}_c01.avi"
        write_video(root / "UCF-101" / rel, clip.frames, spec.fps, root)
        entries.append((clip.label, j, rel))
    entries.sort()
    lists = root / "ucfTrainTestlist"

    def write(name: str, lines: list[str]) -> None:  # the official files use CRLF
        write_bytes(lists / name, "".join(f"{ln}\r\n" for ln in lines).encode(), root)

    write("classInd.txt", [f"{k + 1} {camel(n)}" for k, n in enumerate(spec.classes)])
    for fold in FOLDS:
        write(f"trainlist0{fold}.txt",
              [f"{rel} {label + 1}" for label, j, rel in entries if not in_test_fold(spec, j, fold)])
        write(f"testlist0{fold}.txt",
              [rel for _, j, rel in entries if in_test_fold(spec, j, fold)])


def write_hmdb51(root: Path, spec: SyntheticSpec, clips: Iterable[Clip]) -> None:
    videos: dict[int, list[tuple[int, str]]] = {}
    for clip in clips:
        name, j = spec.classes[clip.label], clip_number(spec, clip)
        video = f"Synth_{j:03d}_{name}_u_nm_np1_fr_med_0.avi"
        write_video(root / "hmdb51_org" / name / video, clip.frames, spec.fps, root)
        videos.setdefault(clip.label, []).append((j, video))
    lists = root / "testTrainMulti_7030_splits"
    for label, items in videos.items():
        for fold in FOLDS:
            lines = [f"{video} {2 if in_test_fold(spec, j, fold) else 1} \n"  # sic: trailing space
                     for j, video in sorted(items, key=lambda x: x[1])]
            write_text(lists / f"{spec.classes[label]}_test_split{fold}.txt", "".join(lines), root)


def write_ssv2(root: Path, spec: SyntheticSpec, clips: Iterable[Clip]) -> None:
    entries: dict[str, list[dict]] = {"train": [], "val": []}
    for number, clip in enumerate(clips, start=1):
        vid, name = str(number), spec.classes[clip.label]
        write_video(root / "20bn-something-something-v2" / f"{vid}.webm", clip.frames, spec.fps,
                    root)
        entries[clip.split].append({
            "id": vid, "label": f"moving box {name.replace('_', ' ')}",
            "template": ssv2_template(name), "placeholders": ["box"],
        })
    labels = root / "labels"
    mapping = {ssv2_template(n).replace("[", "").replace("]", ""): str(k)
               for k, n in enumerate(spec.classes)}
    write_text(labels / "labels.json", json.dumps(mapping, indent=1) + "\n", root)
    for split, fname in (("train", "train.json"), ("val", "validation.json")):
        body = ",\n".join(json.dumps(e, separators=(",", ":")) for e in entries[split])
        write_text(labels / fname, f"[\n{body}\n]\n", root)


WRITERS: dict[str, Callable[[Path, SyntheticSpec, Iterable[Clip]], None]] = {
    "kinetics": write_kinetics,
    "folder": write_folder,
    "ucf101": write_ucf101,
    "hmdb51": write_hmdb51,
    "ssv2": write_ssv2,
}
LAYOUTS = tuple(WRITERS)


def generate(root: str | Path, spec: SyntheticSpec | None = None, layout: str = "kinetics") -> Path:
    """Write the dataset under ``root`` in ``layout`` (one of ``LAYOUTS``), atomically: a
    finished tree has ``spec.json``.

    Returns ``root``. Re-running with an existing finished tree does nothing, so this is
    safe to call at the start of every run.
    """
    if layout not in WRITERS:
        raise ValueError(f"layout must be one of {', '.join(WRITERS)}, got {layout!r}")
    spec = spec or SyntheticSpec()
    root = Path(root)
    if (root / "spec.json").exists():
        return root
    # the folder it goes in is the user's own (followed as given); the dataset's folder and all
    # below it are the project's: every file goes through the one writer with that folder as
    # its root, so no link there is followed, and the finished tree is renamed into place
    parent = root.parent.resolve()
    tmp = parent / f"{root.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftovers (a link is not followed)
    make_dirs(tmp, root=tmp)
    WRITERS[layout](tmp, spec, render_all(spec))
    write_text(tmp / "spec.json", json.dumps(asdict(spec), indent=2), tmp)
    try:
        rename(tmp, parent / root.name, root=parent)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def default_cache_root() -> Path:
    """``$VIDEOTRAIN_CACHE`` or ``~/.cache/videotrain``."""
    return Path(os.environ.get("VIDEOTRAIN_CACHE", Path.home() / ".cache" / "videotrain"))


def ensure_synthetic(cache_dir: str | Path | None = None, layout: str = "kinetics",
                     **spec_kwargs: int | float) -> Path:
    """Generate (once) and return the synthetic dataset root for these spec values; the
    folder is ``synthetic-<hash>`` for the Kinetics layout, ``synthetic-<layout>-<hash>`` else."""
    spec = SyntheticSpec(**spec_kwargs)
    base = Path(cache_dir) if cache_dir else default_cache_root()
    name = "synthetic" if layout == "kinetics" else f"synthetic-{layout}"
    return generate(base / f"{name}-{spec.digest()}", spec, layout)
