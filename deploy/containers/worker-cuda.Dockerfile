# syntax=docker/dockerfile:1
# A GPU worker (`ctxfuse worker --device cuda`) on PyTorch's official CUDA runtime image: its torch
# (with the CUDA libraries and the triton it was built with) stays; everything else comes from
# requirements/all.lock, hash-checked. Pick the tag whose torch is the one constraints.txt pins and
# whose Python is 3.11 (the lock's wheels): the build stops otherwise.
#   docker build -f deploy/containers/worker-cuda.Dockerfile -t ctxfuse-worker-cuda:0.1.0 .
ARG TORCH_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${TORCH_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CTXFUSE_HOME=/var/lib/ctxfuse

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/ctxfuse --create-home ctxfuse

WORKDIR /src
COPY constraints.txt constraints.txt
COPY requirements/all.lock requirements/all.lock
COPY deploy/containers/without_torch.py without_torch.py
# the image's torch must be the pinned one (the lock was resolved against it)
RUN python without_torch.py --check constraints.txt \
    && python without_torch.py requirements/all.lock > gpu.lock \
    && pip install --no-cache-dir --require-hashes --no-deps -r gpu.lock
COPY pyproject.toml README.md ./
COPY ctxfuse ctxfuse
COPY gateway gateway
COPY cloud cloud
COPY edge edge
COPY shared shared
COPY kernels kernels
RUN pip install --no-cache-dir --no-deps . && rm -rf /src

WORKDIR /var/lib/ctxfuse
USER 10001:10001
RUN ctxfuse models fetch --quiet
EXPOSE 8001
HEALTHCHECK --interval=15s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/health', timeout=2)"]
ENTRYPOINT ["ctxfuse"]
CMD ["worker", "--host", "0.0.0.0", "--port", "8001", "--device", "cuda", "--api-key-file", "/var/run/secrets/ctxfuse/backend-key"]
