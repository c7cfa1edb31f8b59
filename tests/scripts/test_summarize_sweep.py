"""scripts/summarize_sweep.py on a fabricated Hydra multirun folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "summarize_sweep.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def summarize_sweep(load_script):
    return load_script("summarize_sweep")


def make_job(root: Path, name: str, overrides: list[str], results: dict | None = None,
             memory_cfg: dict | None = None) -> Path:
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if memory_cfg is not None:
        (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"memory": memory_cfg}))
    if results is not None:
        (job / "results.json").write_text(json.dumps(results))
    return job


def results(strategy: str, top1: float, mem: float, **memory) -> dict:
    return {"val_top1": top1, "val_top5": 1.0, "train_peak_mem_mb": mem, "step_time_s": 0.5,
            "clips_per_s": 16.0, "memory_strategy": strategy,
            "memory": {"strategy": strategy, **memory}, "epochs": 5}


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "multirun" / "2024-01-01" / "12-00-00"
    (root).mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    make_job(root, "0_memory=e2e", ["memory=e2e"], results("e2e", 0.90, 160.0))
    # keep ratio from the override
    make_job(root, "1_memory=sbp,memory.keep_ratio=0.5", ["memory=sbp", "memory.keep_ratio=0.5"],
             results("sbp", 0.88, 80.0, keep_ratio=0.5, granularity="frame"))
    # crashed before results.json: strategy and keep ratio still come from the overrides
    make_job(root, "2_memory=sbp,memory.keep_ratio=0.25", ["memory=sbp", "memory.keep_ratio=0.25"],
             memory_cfg={"_target_": "videotrain.memory.sbp.StochasticBackprop",
                         "keep_ratio": 0.25, "granularity": "frame"})
    return root


def table_rows(table: str) -> list[list[str]]:
    """The rows of the first table (the per-job one; the paired tables follow it)."""
    lines = [ln for ln in table.split("\n## ")[0].splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_summary_table_and_plot(sweep: Path, summarize_sweep) -> None:
    jobs, table = summarize_sweep.summarize(sweep)
    assert len(jobs) == 3
    rows = table_rows(table)
    assert [(r[1], r[3]) for r in rows] == [("e2e", "1.00"), ("sbp", "0.25"), ("sbp", "0.50")]
    e2e, failed, sbp = rows
    assert e2e[4] == "0.900" and e2e[6] == "160.0" and e2e[10] == "ok"
    assert sbp[2] == "frame" and sbp[4] == "0.880" and sbp[6] == "80.0"
    assert failed[10].startswith("failed") and failed[4] == "–" and failed[2] == "frame"
    md = (sweep / "summary.md").read_text()
    assert table in md
    png = sweep / "summary.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


def test_keep_ratio_fallbacks(tmp_path: Path, summarize_sweep) -> None:
    make_job(tmp_path, "0_exp", ["+exp=synthetic_sbp"], results("sbp", 0.5, 50.0, keep_ratio=0.75))
    make_job(tmp_path, "1_seed=1", ["seed=1"], results("e2e", 0.6, 100.0))
    make_job(tmp_path, "2_seed=2", ["model/backbone=vit_tiny"], results("frame_dropout", 0.4, 40.0))
    jobs = {j["job"]: j for j in map(lambda p: summarize_sweep.load_job(p, tmp_path),
                                     summarize_sweep.find_jobs(tmp_path))}
    assert jobs["0_exp"]["keep_ratio"] == 0.75  # from results["memory"]
    assert jobs["1_seed=1"]["keep_ratio"] == 1.0  # e2e
    assert jobs["2_seed=2"]["keep_ratio"] is None  # unknown: shown as "–", not plotted
    _, table = summarize_sweep.summarize(tmp_path)
    assert "varying overrides" in table  # +exp and model/backbone differ across jobs


def test_cli_prints_table(sweep: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(sweep)], capture_output=True,
                          text=True, env=os.environ.copy(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(table_rows(proc.stdout)) == 3
    assert "1 failed job(s)" in proc.stderr


def test_cli_missing_dir(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a directory" in proc.stderr


def test_paired_summary_against_e2e_of_the_same_seed(tmp_path: Path, summarize_sweep) -> None:
    """Rows of the accuracy sweep (``row=``) on two tasks and three seeds, and an equal-time
    row in a second folder: each job is paired with e2e of its task and seed."""
    steps, at_time = tmp_path / "steps", tmp_path / "time"
    e2e = {"direction": [0.90, 0.80, 1.00], "order": [0.50, 0.60, 0.70]}
    sbp = {"direction": [0.88, 0.76, 1.00], "order": [0.55, 0.60, 0.70]}
    for task in e2e:
        for seed in range(3):
            common = [f"data.synthetic.task={task}", f"seed={seed}", "+sweep=accuracy"]
            make_job(steps, f"{task}/e2e/seed{seed}", ["row=e2e", *common],
                     {**results("e2e", e2e[task][seed], 100.0), "val_loss": 1.0,
                      "param_digests": [f"e{task}{seed}"]})
            # recomputation trains e2e's weights exactly
            make_job(steps, f"{task}/recompute-optimal/seed{seed}", ["row=recompute-optimal", *common],
                     {**results("recompute", e2e[task][seed], 60.0), "val_loss": 1.0,
                      "param_digests": [f"e{task}{seed}"]})
            make_job(at_time, f"{task}/sbp-at-time/seed{seed}",
                     ["row=sbp-at-time", *common, "hydra.searchpath=[file:///x]"],
                     {**results("sbp", sbp[task][seed], 50.0, keep_ratio=0.5), "val_loss": 0.5,
                      "param_digests": ["other"]})
    out = tmp_path / "report"
    jobs, table = summarize_sweep.summarize([steps, at_time], out)
    assert len(jobs) == 18 and (out / "summary.md").is_file() and (out / "summary.png").is_file()
    paired = table.split("## Paired against e2e")[1]
    top1 = {ln.split("|")[1].strip(): ln for ln in paired.split("\n\n")[2].splitlines()[2:]}
    # direction: diffs -2, -4, 0 points; order: +5, 0, 0; pooled mean -1/6 point over 6 pairs
    diffs = [-0.02, -0.04, 0.0, 0.05, 0.0, 0.0]
    m, sd, ci = summarize_sweep.mean_ci(diffs)
    assert ci == pytest.approx(2.571 * sd / 6 ** 0.5)  # t(5) = 2.571
    cell = top1["sbp-at-time"]
    assert "0.880 ± 0.120 (Δ -2.0 ± 5.0)" in cell  # direction: t(2) = 4.303 x 0.02 / sqrt 3
    assert f"{100 * m:+.1f} ± {100 * ci:.1f} (n=6)" in cell
    assert "weights identical to e2e" in top1["recompute-optimal"] and "+0.0" in top1["recompute-optimal"]
    assert "weights identical" not in cell and top1["e2e"].rstrip().endswith("reference |")
    loss = paired.split("\n\n")[3]
    assert "| sbp-at-time |" in loss and "-0.500 ± 0.000 (n=6)" in loss


# ---------------------------------------------------------------------- a shared sweep folder
ALIAS_BOMB = ("- &a [x, x, x, x, x, x, x, x, x]\n"
              + "".join(f"- &{c} [" + ", ".join([f"*{p}"] * 9) + "]\n"
                        for p, c in zip("abcdefgh", "bcdefghi", strict=True)))


@pytest.mark.parametrize(("rel", "text", "says"), [
    (".hydra/overrides.yaml", ALIAS_BOMB, "unreadable .hydra/overrides.yaml: "),
    (".hydra/overrides.yaml", "- !!python/object/apply:os.system ['true']\n", "a YAML tag"),
    (".hydra/overrides.yaml", "[" * 100_000, "nested more than 32 levels deep"),
    ("results.json", "[" * 100_000 + "]" * 100_000, "unreadable results.json: "),
    ("results.json", json.dumps({"val_top1": "9" * 10**6}), "val_top1 must be null or a number"),
    ("results.json", "[" + "{}," * 3_000_000 + "{}]", "more than 2000000 values"),
])
def test_a_bad_job_file_fails_that_job_alone(sweep: Path, summarize_sweep, rel: str, text: str,
                                             says: str) -> None:
    """A shared sweep's job file that is a bomb (an alias bomb of 660 bytes, deep nesting, a
    long string where a number goes, 3 million values): that job is listed as failed, naming
    the file and why, never its text; the others are summarized; all within seconds."""
    job = sweep / "0_memory=e2e"
    (job / rel).write_text(text)
    start = time.monotonic()
    jobs, table = summarize_sweep.summarize(sweep)
    assert time.monotonic() - start < 10
    bad = next(j for j in jobs if j["job"] == job.name)
    assert bad["status"] == "failed" and says in bad["error"], bad["error"]
    assert "9" * 200 not in table and "*a" not in table
    assert [r[10].split(" ")[0] for r in table_rows(table)].count("ok") == 1  # the sbp job


def test_text_from_a_job_cannot_break_the_table(sweep: Path, summarize_sweep) -> None:
    """A job's folder name and its results' strategy holding newlines, ``|`` and terminal
    escapes: one escaped line per job, in the file and what is printed."""
    forged = "x\n| forged | row |\x1b]0;owned\x07"
    (sweep / "0_memory=e2e").rename(sweep / f"0_{forged.replace('/', '_')}")
    job = sweep / "1_memory=sbp,memory.keep_ratio=0.5"
    results = json.loads((job / "results.json").read_text())
    (job / "results.json").write_text(json.dumps({**results, "memory_strategy": forged}))
    _, table = summarize_sweep.summarize(sweep)
    for text in (table, (sweep / "summary.md").read_text()):
        assert "\x1b" not in text and "\x07" not in text
        assert not any(ln.lstrip().startswith("| forged") for ln in text.splitlines())
    assert len(table_rows(table)) == 3


@pytest.mark.parametrize("where", ["sweep", "out"])
def test_a_link_in_the_folder_written_is_refused(tmp_path: Path, sweep: Path, where: str) -> None:
    """``summary.md`` planted as a link to a file outside (a ``.pth`` in site-packages runs at
    the next Python start): refused with one error line, the file behind it unchanged."""
    outside = tmp_path / "site-packages" / "evil.pth"
    outside.parent.mkdir()
    outside.write_text("# the user's file\n")
    folder = sweep if where == "sweep" else tmp_path / "report"
    folder.mkdir(exist_ok=True)
    (folder / "summary.md").symlink_to(outside)
    args = [str(sweep)] + (["--out", str(folder)] if where == "out" else [])
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr
    assert "summary.md" in errors[0] and "symbolic link" in errors[0]
    assert outside.read_text() == "# the user's file\n" and (folder / "summary.md").is_symlink()

