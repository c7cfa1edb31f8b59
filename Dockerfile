# GPU image: python 3.11 + PyPI's CUDA torch (the torch CI tests) + videotrain, non-root. See
# docs/cluster.md ("Docker"); scripts/build_image.sh builds it and runs five checks inside it.
#   docker build -t videotrain .
#   docker run --gpus all --shm-size=16g -v DATA:/data -v OUT:/outputs videotrain \
#     +exp=kinetics_sbp data.root=/data/kinetics
#   docker run --gpus all --shm-size=16g -v DATA:/data -v OUT:/outputs --entrypoint torchrun \
#     videotrain --standalone --nproc_per_node=8 -m videotrain +exp=kinetics_sbp data.root=/data/kinetics
#
# Why this base: the torch in the image must be the torch CI tests, pinned in one file
# (constraints/tested.txt). A pytorch/pytorch or CUDA runtime base brings its own torch (or a CUDA
# that must match the wheel's), and pip keeps a base's torch when it satisfies `torch>=...`. PyPI's
# Linux torch wheels are CUDA builds that bring their CUDA libraries (cuDNN, cuBLAS, NCCL, ...) as
# nvidia-* wheels, so a plain python 3.11 Debian bookworm base is enough; the host's NVIDIA driver
# comes in through the NVIDIA container toolkit (`--gpus all`) and must support the wheel's CUDA
# (torch 2.14.1 from PyPI: CUDA 13.0, driver >= 580). The project lives in a venv at /opt/venv
# (--upgrade-deps: pip and setuptools from PyPI), so nothing depends on the base's pip.
#
# One stage: every dependency is a wheel or a pure-Python sdist, so no compiler is needed, and one
# stage does not copy torch's ~5 GB from a builder stage. FFmpeg (Debian's, no recommends) is
# for data.decoder=torchcodec: torchcodec loads its shared libraries.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    VIDEOTRAIN_CACHE=/outputs/.cache
WORKDIR /opt/videotrain
COPY pyproject.toml setup.py README.md ./
COPY constraints ./constraints
COPY videotrain ./videotrain
COPY configs ./configs
COPY scripts ./scripts
# editable: the Hydra configs stay next to the package that reads them (configs/ beside
# videotrain/). -c constraints/tested.txt: torch and torchvision exactly as CI tests them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ffmpeg \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv --upgrade-deps /opt/venv \
    && pip install --no-cache-dir -c constraints/tested.txt -e ".[slurm,torchcodec]" \
    && useradd --create-home --uid 1000 --user-group videotrain \
    && mkdir -p /outputs /data \
    && chown 1000:1000 /outputs \
    && python -c "import videotrain.run, torch, torchvision, torchcodec; print('videotrain on torch', torch.__version__, 'torchvision', torchvision.__version__, 'torchcodec', torchcodec.__version__)"
USER 1000:1000
# outputs (Hydra run folders, checkpoints, wandb, the synthetic-data cache) go here: mount it
WORKDIR /outputs
VOLUME ["/outputs"]
ENTRYPOINT ["python", "-m", "videotrain"]
