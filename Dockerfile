# GPU image: CUDA PyTorch runtime + videotrain, running as a non-root user. See docs/cluster.md.
#   docker build -t videotrain .
#   docker run --gpus all --shm-size=16g -v DATA:/data -v OUT:/outputs videotrain \
#     +exp=kinetics_sbp data.root=/data/kinetics
#   docker run --gpus all --shm-size=16g -v DATA:/data -v OUT:/outputs --entrypoint torchrun \
#     videotrain --standalone --nproc_per_node=8 -m videotrain +exp=kinetics_sbp data.root=/data/kinetics
#
# Two stages from the same CUDA runtime base (its torch, torchvision and CUDA libraries are used
# as they are): the builder has compilers for any dependency without a wheel and installs
# videotrain's own dependencies under /opt/deps; the final stage gets only those files.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/videotrain
COPY pyproject.toml setup.py README.md ./
COPY videotrain ./videotrain
COPY configs ./configs
COPY scripts ./scripts
# editable: the Hydra configs stay next to the package that reads them (configs/ beside
# videotrain/). --prefix keeps everything this adds (not the base's torch) in one folder.
RUN pip install --no-cache-dir --prefix=/opt/deps -e ".[slurm]"

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIDEOTRAIN_CACHE=/outputs/.cache
# merged into the base environment's prefix, so python, torchrun and videotrain see each other
COPY --from=builder /opt/deps/ /opt/conda/
COPY --from=builder /opt/videotrain /opt/videotrain
RUN useradd --create-home --uid 1000 --user-group videotrain \
    && mkdir -p /outputs /data \
    && chown 1000:1000 /outputs \
    && python -c "import videotrain.run, torch; print('videotrain on torch', torch.__version__)"
USER 1000:1000
# outputs (Hydra run folders, checkpoints, wandb, the synthetic-data cache) go here: mount it
WORKDIR /outputs
VOLUME ["/outputs"]
ENTRYPOINT ["python", "-m", "videotrain"]
