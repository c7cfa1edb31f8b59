"""``python -m videotrain.prepare kinetics --csv kinetics400/train.csv --videos DIR --out DIR
[--resize 320] [--workers N]``."""

from __future__ import annotations

import argparse
import os
import sys

from videotrain.prepare.kinetics import KineticsCsvError, prepare_kinetics
from videotrain.prepare.reencode import EncodeSettings
from videotrain.untrusted import UnsafeFileError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m videotrain.prepare",
                                description="Convert a dataset as downloaded into the lists "
                                            "videotrain reads.")
    sub = p.add_subparsers(dest="dataset", required=True)
    k = sub.add_parser(
        "kinetics", help="official Kinetics CSVs + downloaded videos -> data=kinetics lists",
        description="Writes OUT/{train,val,test}.csv (path label), OUT/classes.txt (sorted "
                    "labels) and OUT/missing_<split>.csv; then train with data=kinetics "
                    "data.root=OUT.")
    k.add_argument("--csv", action="append", required=True,
                   help="a release CSV (label,youtube_id,time_start,time_end,split); repeat "
                        "for several splits, so that they share one classes.txt")
    k.add_argument("--videos", required=True,
                   help="folder of downloaded videos, {youtube_id}_{start:06d}_{end:06d}.mp4 "
                        "(.mkv, .webm too; a bare {youtube_id}.mp4 for an id with one row), flat "
                        "or in sub-folders (per label or split); files under replacement*/ win, "
                        "0-byte files count as missing")
    k.add_argument("--out", required=True, help="output folder (data.root)")
    k.add_argument("--resize", type=int, choices=(256, 320),
                   help="re-encode to this short side (H.264, keyframe every second) into "
                        "OUT/videos_<N>/<split>/; resumable: finished files are skipped")
    k.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="re-encoding processes (default: the CPU count)")
    k.add_argument("--crf", type=int, default=23, help="x264 quality for --resize (default 23)")
    k.add_argument("--preset", default="veryfast", help="x264 preset for --resize")
    k.add_argument("--keyframe-s", type=float, default=1.0,
                   help="seconds between keyframes for --resize (default 1: a random clip "
                        "decodes from at most 1 s before its start)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = EncodeSettings(short_side=args.resize, crf=args.crf, preset=args.preset,
                              keyframe_s=args.keyframe_s) if args.resize else None
    try:
        summaries = prepare_kinetics(args.csv, args.videos, args.out, resize=args.resize,
                                     workers=max(args.workers, 1), settings=settings)
    except (KineticsCsvError, UnsafeFileError, OSError) as err:  # a bad CSV; a CSV that is a folder,
        # a FIFO or too large; a file or folder missing or unreadable
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 1 if any(s.found == 0 for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
