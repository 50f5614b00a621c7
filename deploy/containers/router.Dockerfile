# syntax=docker/dockerfile:1
# The gateway in front of the fleet (`ctxfuse serve --fleet ...`): the OpenAI API, keys, limits, the
# Batch API and the edge listener, with no engine. requirements/router.lock holds no torch.
#   docker build -f deploy/containers/router.Dockerfile -t ctxfuse-router:0.1.0 .   (from the repo root)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/ctxfuse/bin:$PATH \
    CTXFUSE_HOME=/var/lib/ctxfuse

# a virtual environment: the same steps work on a base whose system Python pip may not touch
RUN python3 -m venv /opt/ctxfuse \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/ctxfuse --create-home ctxfuse

WORKDIR /src
# the locked dependencies first (hash-checked, nothing else): a code change rebuilds only the last layer
COPY requirements/router.lock requirements/router.lock
RUN pip install --no-cache-dir --require-hashes --no-deps -r requirements/router.lock
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
EXPOSE 8000 8443
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["ctxfuse"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--fleet", "/etc/ctxfuse/fleet.toml", "--redis-url", "redis://redis:6379/0"]
