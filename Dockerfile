# GPU image: CUDA PyTorch base + videotrain. See README "Docker" for how to run it.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIDEOTRAIN_CACHE=/outputs/.cache

WORKDIR /opt/videotrain
COPY pyproject.toml README.md ./
COPY videotrain ./videotrain
COPY configs ./configs
# editable install: the Hydra configs stay next to the package they configure
RUN pip install -e . && useradd --create-home --uid 1000 videotrain \
    && mkdir -p /outputs /data && chown videotrain /outputs

USER videotrain
WORKDIR /outputs
ENTRYPOINT ["python", "-m", "videotrain"]
