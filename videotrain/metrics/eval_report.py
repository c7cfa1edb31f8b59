"""What an evaluation writes: ``eval.json`` (the summary), ``per_class.csv`` and
``confusion.png`` (row-normalised video-level confusion matrix with class names)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import torch

from videotrain.untrusted import shown_name, write_bytes, write_text

EVAL_JSON, PER_CLASS_CSV, CONFUSION_PNG = "eval.json", "per_class.csv", "confusion.png"
# above this many classes the tick labels would overlap: the axes show indices instead
MAX_LABELLED_CLASSES = 60


def per_class_rows(confusion: torch.Tensor, class_names: list[str]) -> list[dict[str, Any]]:
    """One row per class: videos, top-1 hits, accuracy, and the class it is most often taken
    for (the largest off-diagonal count of its row). Names (read from a dataset's files) are
    escaped and cut (``shown_name``)."""
    class_names = [shown_name(n) for n in class_names]
    rows = []
    for i, name in enumerate(class_names):
        row = confusion[i].clone()
        total, correct = float(row.sum()), float(row[i])
        row[i] = -1
        j = int(row.argmax()) if len(row) > 1 else i
        confused = float(row[j]) if j != i else 0.0
        rows.append({
            "class_index": i, "class_name": name, "videos": int(total), "correct": int(correct),
            "top1": correct / total if total else None,
            "most_confused_with": class_names[j] if confused > 0 else "",
            "confused_videos": int(confused),
        })
    return rows


# a text cell starting with one of these is run as a formula by Excel / LibreOffice
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _csv_text(value: str) -> str:
    """``value`` (a class name from an annotation file: untrusted) as a CSV text cell: with a
    leading ``'`` when it starts with ``= + - @``, a tab or a carriage return, so that a
    spreadsheet opening ``per_class.csv`` shows it as text instead of running it as a formula
    (CSV injection, OWASP's recommendation); any other value unchanged. Only for text cells:
    numbers are written as they are."""
    return f"'{value}" if value.startswith(_FORMULA_STARTS) else value


def write_per_class_csv(path: Path, rows: list[dict[str, Any]], root: Path | None = None) -> None:
    f = io.StringIO(newline="")  # built in memory, then written without following a link
    writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["class_index"])
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if v is None else f"{v:.4f}" if isinstance(v, float)
                             else _csv_text(v) if isinstance(v, str) else v)
                         for k, v in r.items()})
    write_text(path, f.getvalue(), root)


def plot_confusion(path: Path, confusion: torch.Tensor, class_names: list[str], title: str,
                   root: Path | None = None) -> None:
    """Rows are true classes, columns predictions, each row normalised to sum to 1. Drawn into
    memory and written by the one writer (``root``: the run folder it goes into)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    class_names = [shown_name(n) for n in class_names]
    k = len(class_names)
    norm = confusion / confusion.sum(dim=1, keepdim=True).clamp_min(1)
    side = min(max(5.0, 0.28 * k + 2.5), 40.0)
    fig, ax = plt.subplots(figsize=(side + 1.5, side))
    image = ax.imshow(norm.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    if k <= MAX_LABELLED_CLASSES:
        # class names come from annotation files (untrusted): drawn as plain text, never parsed as
        # mathtext (a name such as "$\frac{$" made savefig raise, and eval.json was never written)
        ax.set_xticks(range(k), class_names, rotation=90, fontsize=7, parse_math=False)
        ax.set_yticks(range(k), class_names, fontsize=7, parse_math=False)
        if k <= 20:  # small enough to print the counts
            for i in range(k):
                for j in range(k):
                    if confusion[i, j]:
                        ax.text(j, i, int(confusion[i, j]), ha="center", va="center", fontsize=7,
                                color="white" if norm[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    write_bytes(path, png.getvalue(), root)  # never through a link at path or below root
    plt.close(fig)


def write_eval_report(out_dir: str | Path, summary: dict[str, Any], confusion: torch.Tensor,
                      class_names: list[str]) -> dict[str, str]:
    """Write the three files into ``out_dir``, a run folder (created if missing; one that is a
    link, or has a link below it, is refused: nothing is written); returns their paths by kind."""
    out_dir = Path(out_dir)
    files = {"eval": str(out_dir / EVAL_JSON), "per_class": str(out_dir / PER_CLASS_CSV),
             "confusion": str(out_dir / CONFUSION_PNG)}
    write_per_class_csv(out_dir / PER_CLASS_CSV, per_class_rows(confusion, class_names), out_dir)
    title = (f"video top-1 {summary['video_top1']:.3f}, mean class acc "
             f"{summary['mean_class_acc']:.3f} ({summary['videos']} videos, {summary['clips']} clips "
             f"x {summary['crops']} crops, {summary['aggregate']} of softmax)")
    plot_confusion(out_dir / CONFUSION_PNG, confusion, class_names, title, out_dir)
    write_text(out_dir / EVAL_JSON, json.dumps({**summary, "files": files}, indent=2) + "\n",
               out_dir)
    return files
