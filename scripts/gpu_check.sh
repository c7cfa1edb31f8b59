#!/usr/bin/env bash
# The prepared device calls of a session with a GPU lease: machine facts, the
# gpu-marked tests, the GPU bench suite (ResNet-50 + transformer, B=8 x T=16 at 224 px, bf16;
# 5 warm-up and 20 timed steps per row, GPU busy and kernels per step from torch.profiler; e2e
# with and without channels_last; ViT-B/16 at B=8 x 64 frames) and the default job (its data wait
# and the trainer's bottleneck warning), in two parts (below). Everything lands in $OUT, at
# most 8 files and one folder down, which is what the device tool brings back:
#   $OUT/machine.txt  $OUT/gpu_tests.log  $OUT/default_job.log  $OUT/default_job_results.json
#   $OUT/bench.log  $OUT/bench/bench.{json,md,png}
#
# Run it from the repository root, naming the commit (the copy on the device has no .git):
#   VIDEOTRAIN_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh
# as the device tool's `run` command (put the sha in the command string; timeout_s 600; the
# script ends by itself in about 575 s), then at once the same with PART=2 (below). Then copy
# $OUT/bench/* to docs/results/gpu/<gpu>/ (part 2's into a folder of its own there).
# Before the lease, here: `bash scripts/gpu_wheels.sh` (the packages the device lacks).
#
# Packages: the device image has torch 2.11, torchvision, timm, pytest(-timeout, -xdist),
# matplotlib, but not hydra-core, omegaconf, antlr4-python3-runtime, av, pytorchvideo and its
# needs (iopath, fvcore, parameterized, yacs, termcolor). `bash scripts/gpu_wheels.sh` puts them
# in .whl/ (git-ignored; about 37 MB, at this environment's versions); name `.whl` in the run's
# `carry`. This script installs whatever .whl/ holds into /tmp/site first.
#
# Two calls, one lease (15 minutes of device time: a machine's start, then at most 600 s a call;
# the second call must follow within the machine's 30 s warm time, or it starts a fresh one):
#   PART=1 (default): machine facts, the gpu-marked tests, then the acceptance rows
#          (ACCEPT below) in one bench run, so that their ratios share one e2e (about 575 s).
#   PART=2: the default job (its data wait against its step, the bottleneck warning),
#          then the comparison rows (frame dropout, SBP + recomputation, the ViT's recomputation,
#          memory=auto, then the compiled twins of the acceptance rows: trainer.compile=true,
#          one with CUDA graphs) with their own e2e; give it BENCH_S = the device time
#          left (status's budget_left_s) - JOB_S - 60, and timeout_s to match.
# Time: TEST_S seconds for the tests (default 120 in part 1),
# JOB_S for the default job (default 90 in part 2, at most JOB_STEPS=100 steps; 0 skips it),
# BENCH_S for the bench (default 450 in part 1, 300 in part 2: the rows that would start after
# it are reported as not run); ONLY: comma-separated row globs (default: the part's rows);
# ROUNDS (default 1).
set -uo pipefail
PART=${PART:-1}
ACCEPT="resnet50/e2e,resnet50/e2e-nchw,resnet50/sbp-frame-0.5,resnet50/sbp-frame-0.25"
ACCEPT+=",resnet50/sbp-frame-frozen-0.5,resnet50/checkpoint-sqrt,resnet50/checkpoint-optimal-b0.5"
ACCEPT+=",vit_b_16/e2e,vit_b_16/sbp-frame-0.5,vit_b_16/sbp-frame-0.25"
REST="resnet50/frame_dropout-0.5,resnet50/sbp-frame-checkpoint:optimal-0.5"
REST+=",vit_b_16/checkpoint-optimal-b0.5,resnet50/auto-b0.5,*-compiled*"
if [ "$PART" = 1 ]; then
    TEST_S=${TEST_S:-120}; JOB_S=${JOB_S:-0}; BENCH_S=${BENCH_S:-450}; ONLY=${ONLY:-$ACCEPT}
else
    TEST_S=${TEST_S:-0}; JOB_S=${JOB_S:-90}; BENCH_S=${BENCH_S:-300}; ONLY=${ONLY:-$REST}
fi
OUT=${OUT:-/tmp/gpu_check}
JOB_STEPS=${JOB_STEPS:-100}
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    nproc
    echo "commit: ${VIDEOTRAIN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    git status --short 2>/dev/null | head -20
    python3 - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "gpu", torch.cuda.get_device_name(0))
for name in ("torchvision", "timm", "hydra", "omegaconf", "av", "pytorchvideo", "pulp"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as err:  # noqa: BLE001
        print(name, "MISSING", type(err).__name__)
EOF
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# the gpu-marked tests (they fail, not skip, without a GPU); 4 workers share the one GPU
if [ "$TEST_S" -gt 0 ]; then
    timeout "$TEST_S" python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests \
        >"$OUT/gpu_tests.log" 2>&1
    echo "gpu tests: exit $? (log: gpu_tests.log)"; tail -n 5 "$OUT/gpu_tests.log"
fi

# the default job as a user starts it (data.num_workers: auto), cut to JOB_STEPS steps; its run
# folder stays outside $OUT, its results.json and the log's last lines come back
if [ "$JOB_S" -gt 0 ]; then
    job=/tmp/gpu_check_default_job
    rm -rf "$job"
    timeout "$JOB_S" python3 -m videotrain trainer.progress=false logger.wandb.mode=disabled \
        trainer.max_steps="$JOB_STEPS" hydra.run.dir="$job" >/tmp/gpu_check_default_job.log 2>&1
    echo "default job: exit $?"
    tail -n 40 /tmp/gpu_check_default_job.log >"$OUT/default_job.log"
    cp "$job/results.json" "$OUT/default_job_results.json" 2>/dev/null
    grep -h "bottleneck" /tmp/gpu_check_default_job.log | head -n 3
fi

# the GPU bench: bench.json names the GPU, torch and commit (meta.machine); --out keeps it in
# $OUT (without it the suite writes outputs/bench/gpu/<gpu>/, which the device tool does not bring back)
bench=(python3 -m videotrain.bench --suite gpu --out "$OUT/bench" --time-budget "$BENCH_S"
       --rounds "$ROUNDS" --only "$ONLY")
"${bench[@]}" 2>&1 | tee "$OUT/bench.log"
echo "bench: exit ${PIPESTATUS[0]}"
