"""The annotation suite (``python -m benchmarks.annotations``, from the repository root): what
a training start pays to read the official annotation files at their real sizes, against a
plain parse of the same files in the same run.

The files are written in the official formats (SSv2's JSON trio, Kinetics-400 and -700 CSVs,
UCF101's and HMDB51's split lists; docs/data.md, "Real annotation files") into a temporary folder
under ``$VIDEOTRAIN_CACHE``, removed at the end. Rows: every index build a start pays, ``prepare
kinetics`` on the K700 CSV, and the preflight of a mostly missing K400 list, first and cached.
Each figure is the best of ``repeat`` runs, plain parse and build alternating (the machine is
shared). ``bench.json`` and ``bench.md`` go to ``outputs/bench_annotations/`` unless ``--out``
names another folder. The files' sizes and rows: ``docs/design/internals.md``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import logging
import os
import pickle
import random
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from videotrain.untrusted.files import make_dirs, write_bytes, write_text

# the official sizes (rows of the files a training start reads)
SIZES = {"ssv2_train": 168_913, "ssv2_val": 24_777, "k400_train": 240_000, "k700_train": 545_000,
         "ucf_train": 9_537, "ucf_test": 3_783, "hmdb_per_class": 133}
TARGET_RATIO = 3.0  # an index build within 3x of the plain parse of its file
TARGET_PREFLIGHT_S = 30.0  # the preflight of 240,000 paths, first start
PRESENT_FRACTION = 0.1  # a partial download: 90% of the K400 videos missing
ID_CHARS = string.ascii_letters + string.digits + "-_"


def _crlf(path: Path, lines: list[str], root: Path | None = None) -> None:
    write_bytes(path, "".join(f"{ln}\r\n" for ln in lines).encode(), root)


def youtube_ids(n: int, rng: random.Random) -> list[str]:
    return ["".join(rng.choice(ID_CHARS) for _ in range(11)) for _ in range(n)]


def write_ssv2(root: Path, n_train: int, n_val: int) -> None:
    templates = [f"Putting [something] {k} next to [something]" for k in range(174)]
    keys = [t.replace("[", "").replace("]", "") for t in templates]
    make_dirs(root / "20bn-something-something-v2", root)
    write_text(root / "labels" / "labels.json",
               "{\n" + ",\n".join(f' "{k}": "{i}"' for i, k in enumerate(keys)) + "\n}\n", root)
    rng, vid = random.Random(0), 0
    for name, n in (("train.json", n_train), ("validation.json", n_val)):
        entries = []
        for _ in range(n):
            vid += 1
            t = templates[rng.randrange(174)]
            entries.append(json.dumps({"id": str(vid), "label": t.replace("[something]", "a cup"),
                                       "template": t, "placeholders": ["a cup", "a cup"]}))
        write_bytes(root / "labels" / name,
                    ("[\r\n" + ",\r\n".join(entries) + "\r\n]\r\n").encode(), root)


def kinetics_labels(n: int) -> list[str]:
    """``n`` class names shaped like Kinetics' (spaces, parentheses, apostrophes)."""
    extra = ("passing American football (in game) {}", "massaging person's head {}", "air drumming {}")
    return sorted(extra[k % 3].format(k) for k in range(n))


def write_kinetics_release(path: Path, rows: int, labels: list[str], rng: random.Random) -> list[tuple]:
    """The release CSV (header, quoted labels); returns its (label, id, start, end) rows."""
    out = []
    lines = ["label,youtube_id,time_start,time_end,split"]
    for yid in youtube_ids(rows, rng):
        label, start = labels[rng.randrange(len(labels))], rng.randrange(0, 300)
        out.append((label, yid, start, start + 10))
        lines.append(f'"{label}",{yid},{start},{start + 10},train')
    write_text(path, "\n".join(lines) + "\n")
    return out


def write_kinetics_list(root: Path, rows: int, present: float) -> Path:
    """``prepare kinetics``'s output for a partial download: ``train.csv`` (``path label``,
    paths relative to ``root``), ``classes.txt``, and the first ``present`` of the videos
    (small files; the others missing). Returns the video folder."""
    from videotrain.prepare.kinetics import list_line

    labels = kinetics_labels(400)
    rng = random.Random(1)
    videos = make_dirs(root / "videos_320" / "train", root)
    lines, keep = [], int(rows * present)
    for i, yid in enumerate(youtube_ids(rows, rng)):
        rel = f"videos_320/train/{yid}_{i % 300:06d}_{i % 300 + 10:06d}.mp4"
        lines.append(list_line(rel, rng.randrange(400)))
        if i < keep:
            write_bytes(root / rel, b"\0" * 16, root)
    write_text(root / "train.csv", "".join(lines), root)
    write_text(root / "classes.txt", "".join(f"{n}\n" for n in labels), root)
    return videos


def write_ucf101(root: Path, n_train: int, n_test: int) -> None:
    classes = [f"Class{k:03d}Action" for k in range(101)]
    lists = root / "ucfTrainTestlist"
    _crlf(lists / "classInd.txt", [f"{k + 1} {c}" for k, c in enumerate(classes)], root)
    _crlf(lists / "trainlist01.txt", [f"{classes[i % 101]}/v_{classes[i % 101]}_g{i % 25 + 8:02d}_c{i % 7 + 1:02d}.avi {i % 101 + 1}"
                                      for i in range(n_train)], root)
    _crlf(lists / "testlist01.txt", [f"{classes[i % 101]}/v_{classes[i % 101]}_g{i % 7 + 1:02d}_c{i % 5 + 1:02d}.avi"
                                     for i in range(n_test)], root)
    make_dirs(root / "UCF-101", root)


def write_hmdb51(root: Path, per_class: int) -> None:
    classes = sorted(f"action_{k:02d}" + ("_ball" if k % 5 == 0 else "") for k in range(51))
    lists = root / "testTrainMulti_7030_splits"
    for name in classes:
        videos = [f"Some_Clip_[{i}]_(take_2)!_&_more_{name}_f_cm_np1_fr_med_{i}.avi" for i in range(per_class)]
        for fold in (1, 2, 3):
            ids = [(i + fold) % 10 for i in range(per_class)]  # 7 train, 3 test of 10 (and 0s)
            marks = ["1" if k < 6 else "2" if k < 9 else "0" for k in ids]
            write_text(lists / f"{name}_test_split{fold}.txt",
                       "".join(f"{v} {m} \n" for v, m in zip(videos, marks, strict=True)), root)
    make_dirs(root / "hmdb51_org", root)


# ---------------------------------------------------------------------- timing
def best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """(the shortest of ``repeat`` timed calls, the last result). The garbage collector stays
    on, as in a real start, whose parse pays its collections too."""
    times, result = [], None
    for _ in range(repeat):
        result = None  # the last call's result is freed (by reference count) before the next
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def csv_rows(*paths: Path, delimiter: str = ",") -> list[list[str]]:
    """The rows of ``paths`` through ``csv.reader`` (kept, as an index keeps its entries)."""
    rows: list[list[str]] = []
    for path in paths:
        with path.open(newline="", encoding="utf-8") as f:
            rows.extend(csv.reader(f, delimiter=delimiter))
    return rows


def compare(name: str, files: list[Path], plain: Callable[[], Any], build: Callable[[], Any],
            repeat: int, paid: str, entries: Callable[[Any], int] = len) -> dict[str, Any]:
    """One row: ``plain`` and ``build`` timed alternately, best of ``repeat`` each (more for a
    small file, so that a millisecond parse is timed about 0.5 s in all)."""
    plain_s, build_s, built = [], [], None
    gc.collect()  # once per row, not per call: 0.2 s a call in a process of many objects (pytest)
    rounds = max(repeat, min(50, int(0.5 / max(best_of(plain, 1)[0], 1e-4))))
    for _ in range(rounds):
        built = None
        plain_s.append(best_of(plain, 1)[0])
        t, built = best_of(build, 1)
        build_s.append(t)
    ratio = min(build_s) / min(plain_s)
    return {"name": name, "files": [f.name for f in files], "entries": entries(built),
            "bytes": sum(f.stat().st_size for f in files), "plain_s": min(plain_s),
            "build_s": min(build_s), "ratio": ratio, "target": f"<= {TARGET_RATIO:g}x plain",
            "meets_target": ratio <= TARGET_RATIO, "paid": paid}


# ---------------------------------------------------------------------- the report
def annotations_markdown(rows: list[dict[str, Any]]) -> str:
    """The annotation suite's table: each file's plain parse against what videotrain pays."""
    def s(v: Any) -> str:
        return "" if v is None else f"{v:.3f}"

    lines = ["| what a start reads | entries | plain parse s | videotrain s | × plain | target | "
             "met | paid under torchrun with N ranks |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        met = {True: "yes", False: "**no**", None: ""}[r["meets_target"]]
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['name']} | {r['entries']:,} | {s(r['plain_s'])} | {s(r['build_s'])} | "
                     f"{ratio} | {r['target']} | {met} | {r['paid']} |")
    return "\n".join(lines) + "\n"


def write_annotations(out_dir: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """``bench.json`` and ``bench.md`` of the annotation suite, in the user's own ``out_dir``
    (through the one writer: never through a link); returns the table."""
    table = annotations_markdown(rows)
    write_text(out_dir / "bench.json", json.dumps({"rows": rows, "meta": meta}, indent=2) + "\n")
    m = meta["machine"]
    title = (f"{m.get('cpus')} CPUs ({m.get('processor')}), python {m.get('python')}, torch "
             f"{meta['torch']}; x{meta['scale']:g} the official sizes, best of {meta['repeat']} "
             f"runs each; load average {meta['load_avg_start']} at the start (a shared machine)")
    write_text(out_dir / "bench.md", f"# videotrain bench: annotation files at official sizes\n\n"
                                     f"{title}\n\n{table}")
    return table


PAID_INDEX = ("once per rank per start (each rank reads the lists itself, all at once); "
              "videotrain.eval: once")
PAID_PREFLIGHT = "rank 0 only, once per start; the other ranks receive its list"


def run_annotation_bench(out: str | Path | None = None, scale: float = 1.0, repeat: int = 3,
                         log: Callable[..., None] = print) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """Write the files (``scale`` x the official sizes), time every row, write ``bench.json``
    and ``bench.md`` into ``out``; returns (rows, meta, markdown table)."""
    from videotrain.bench.spawn import machine_info
    from videotrain.data.layouts import default_cache_root
    from videotrain.data.loaders import read_index
    from videotrain.data.preflight import preflight
    from videotrain.prepare.kinetics import prepare_kinetics, read_release_csv

    def size(key: str) -> int:
        return max(int(SIZES[key] * scale), 20)

    def say(msg: str) -> None:
        log(msg, file=sys.stderr)

    # a private folder (0700) for the generated files; each is written by the one writer
    tmp = Path(tempfile.mkdtemp(prefix="bench-annotations-", dir=make_dirs(default_cache_root())))
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        say(f"writing the annotation files (x{scale:g} the official sizes) under {tmp}")
        write_ssv2(tmp / "ssv2", size("ssv2_train"), size("ssv2_val"))
        k400 = tmp / "k400"
        write_kinetics_list(k400, size("k400_train"), PRESENT_FRACTION)
        k700_csv = tmp / "k700" / "train.csv"
        k700_rows = write_kinetics_release(k700_csv, size("k700_train"), kinetics_labels(700),
                                           random.Random(2))
        k700_videos = make_dirs(tmp / "k700" / "videos", tmp)
        for _, yid, start, end in k700_rows[: len(k700_rows) // 100]:  # 1% downloaded
            write_bytes(k700_videos / f"{yid}_{start:06d}_{end:06d}.mp4", b"\0" * 16, tmp)
        k700_count = len(k700_rows)
        del k700_rows  # a training start's heap holds no such list: full collections stay small
        write_ucf101(tmp / "ucf101", size("ucf_train"), size("ucf_test"))
        write_hmdb51(tmp / "hmdb51", SIZES["hmdb_per_class"] if scale >= 1 else 10)
        say(f"written in {time.perf_counter() - t_start:.0f} s")

        def timed(name: str, files: list[Path], plain, build, **kw) -> None:
            rows.append(compare(name, files, plain, build, repeat, **kw))
            r = rows[-1]
            say(f"{name}: {r['entries']} entries, plain {r['plain_s']:.3f} s, videotrain "
                f"{r['build_s']:.3f} s ({r['ratio']:.2f}x)")

        ssv2 = tmp / "ssv2" / "labels"
        for split, file in (("train", "train.json"), ("val", "validation.json")):
            timed(f"SSv2 {file} index", [ssv2 / file],
                  lambda f=ssv2 / file: json.loads(f.read_text()),
                  lambda s=split: read_index("ssv2", tmp / "ssv2", s, None, {}), paid=PAID_INDEX)
        timed("K400 train.csv index (prepared list)", [k400 / "train.csv"],
              lambda: csv_rows(k400 / "train.csv"),
              lambda: read_index("kinetics", k400, "train", None, {}), paid=PAID_INDEX)
        ucf = tmp / "ucf101" / "ucfTrainTestlist"
        for split, file in (("train", "trainlist01.txt"), ("val", "testlist01.txt")):
            timed(f"UCF101 {file} index", [ucf / "classInd.txt", ucf / file],
                  lambda f=ucf / file: csv_rows(ucf / "classInd.txt", f, delimiter=" "),
                  lambda s=split: read_index("ucf101", tmp / "ucf101", s, None, {}), paid=PAID_INDEX)
        hmdb = sorted((tmp / "hmdb51" / "testTrainMulti_7030_splits").glob("*_test_split1.txt"))
        timed("HMDB51 *_test_split1.txt index (train)", hmdb,
              lambda: csv_rows(*hmdb, delimiter=" "),
              lambda: read_index("hmdb51", tmp / "hmdb51", "train", None, {}), paid=PAID_INDEX)
        timed("K700 release train.csv: read_release_csv", [k700_csv], lambda: csv_rows(k700_csv),
              lambda: read_release_csv(k700_csv), paid="prepare kinetics: once, before training")
        n_prep = [0]

        def prepare() -> int:
            n_prep[0] += 1
            prepare_kinetics([k700_csv], k700_videos, tmp / "k700" / f"out{n_prep[0]}", log=lambda m: None)
            return k700_count

        timed("K700 release train.csv: prepare kinetics (lists, missing_train.csv)", [k700_csv],
              lambda: csv_rows(k700_csv), prepare, paid="once, before training (no torchrun)",
              entries=lambda n: n)
        rows[-1]["target"], rows[-1]["meets_target"] = "(timed only)", None

        index = read_index("kinetics", k400, "train", None, {})
        cache, run_dir = tmp / "cache", tmp / "run"
        quiet = logging.getLogger("videotrain.data.preflight")
        level, quiet.level = quiet.level, logging.ERROR  # one warning per split; not printed here
        try:
            first_s, bad = best_of(lambda: (shutil.rmtree(cache, ignore_errors=True),
                                            preflight(index, 1.0, cache, "train", run_dir))[1], repeat)
            again_s, _ = best_of(lambda: preflight(index, 1.0, cache, "train", run_dir), repeat)
        finally:
            quiet.level = level
        blob = pickle.dumps(bad)
        t0 = time.perf_counter()
        pickle.loads(blob)
        unpickle_s = time.perf_counter() - t0
        for label, secs in (("first start: every file stat-ed", first_s),
                            ("second start: cached, bad files re-checked", again_s)):
            rows.append({"name": f"preflight of {len(index)} K400 paths ({len(bad)} missing), {label}",
                         "files": ["train.csv"], "entries": len(index), "plain_s": None,
                         "build_s": secs, "ratio": None, "target": f"< {TARGET_PREFLIGHT_S:g} s",
                         "meets_target": secs < TARGET_PREFLIGHT_S, "paid": PAID_PREFLIGHT,
                         "missing": len(bad), "broadcast_bytes": len(blob),
                         "unpickle_s": unpickle_s})
            say(f"{rows[-1]['name']}: {secs:.2f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    machine = machine_info("cpu")
    meta = {"suite": "annotations", "scale": scale, "repeat": repeat, "sizes": {
                k: (SIZES[k] if k == "hmdb_per_class" and scale >= 1 else size(k)) for k in SIZES},
            "machine": machine, "torch": machine["torch"], "load_avg_start": load_start,
            "load_avg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "wall_s": time.perf_counter() - t_start, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    table = write_annotations(Path(out), rows, meta) if out else annotations_markdown(rows)
    return rows, meta, table


# ---------------------------------------------------------------------- the command line
RESULTS = "outputs/bench_annotations"  # the default --out (the published table: --out docs/...)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.annotations",
        description="Index builds, prepare kinetics and the preflight on annotation files of the "
                    "official sizes (SSv2, K400, K700, UCF101, HMDB51), each against a plain "
                    "parse of the same files. Run from the repository root.")
    p.add_argument("--out", default=RESULTS,
                   help=f"write bench.json and bench.md here (default {RESULTS}/; the published "
                        "table is docs/results/bench_annotations/)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="the files' sizes as a fraction of the official ones (default 1; 0.1 for "
                        "a quick look)")
    p.add_argument("--repeat", type=int, default=3,
                   help="timed runs of each row, the best kept (default 3)")
    args = p.parse_args(argv)
    if args.scale <= 0 or args.repeat < 1:
        p.error("--scale must be > 0 and --repeat >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, _, table = run_annotation_bench(out=args.out, scale=args.scale, repeat=args.repeat)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
