#!/usr/bin/env bash
# Fetch the wheels the device machine lacks (scripts/gpu_check.sh installs them from .whl/).
#
# The device image has torch, torchvision, timm, pytest and matplotlib, and no package index.
# This fetches the rest of what the gpu-marked tests and the GPU bench import, at the versions
# this environment has installed (the ones its tests ran with), for the device's CPython 3.12
# on x86-64: binary wheels where the index has them, else a wheel built here from the sdist,
# which must come out pure Python (py3-none-any) to run there. Run it once, here, in the
# repository root (`.whl/` is git-ignored), then name `.whl` in the device run's `carry`:
#   bash scripts/gpu_wheels.sh            # PYTHON=.venv/bin/python by default
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
DEST=${DEST:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
# pulp (torch's sac_milp peer) is left out: the GPU suite has no sac_milp row, and it is 16 MB
NAMES=(hydra-core omegaconf antlr4-python3-runtime av pytorchvideo iopath fvcore parameterized
       yacs termcolor)

pins=$("$PYTHON" - "${NAMES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        sys.exit(f"error: {name} is not installed in this environment; install the project first")
EOF
)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
for pin in $pins; do
    if "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
            --implementation cp "${platforms[@]}" -d "$DEST" "$pin" 2>/dev/null; then
        continue
    fi
    # no binary wheel for CPython $PY_VERSION: build one from the sdist; it must be pure Python
    tmp=$(mktemp -d)
    "$PYTHON" -m pip wheel -q --no-deps -w "$tmp" "$pin"
    for whl in "$tmp"/*.whl; do
        case "$whl" in
            *-none-any.whl) mv "$whl" "$DEST"/ ;;
            *) echo "error: $pin built a platform wheel ($(basename "$whl")); it would not run there" >&2
               exit 2 ;;
        esac
    done
    rm -rf "$tmp"
done
ls -1 "$DEST"
du -sh "$DEST"
