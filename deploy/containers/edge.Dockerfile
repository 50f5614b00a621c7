# syntax=docker/dockerfile:1
# The edge agent (`ctxfuse edge`): the `[edge]` install from requirements/edge.lock, no torch.
# One file for amd64 and arm64 (the lock carries both platforms' hashes):
#   docker buildx build --platform linux/amd64,linux/arm64 -f deploy/containers/edge.Dockerfile \
#       -t ctxfuse-edge:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/ctxfuse/bin:$PATH \
    CTXFUSE_HOME=/var/lib/ctxfuse

RUN python3 -m venv /opt/ctxfuse \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/ctxfuse --create-home ctxfuse

WORKDIR /src
COPY requirements/edge.lock requirements/edge.lock
RUN pip install --no-cache-dir --require-hashes --no-deps -r requirements/edge.lock
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
# the agent's state (acked chunks, the batch outbox) lives here: mount a volume to keep it
VOLUME ["/var/lib/ctxfuse"]
EXPOSE 8100
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8100/health', timeout=2)"]
ENTRYPOINT ["ctxfuse", "edge", "--host", "0.0.0.0", "--port", "8100", "--tls-dir", "/etc/ctxfuse/tls"]
# then: --gateway https://GATEWAY:8443 --name DEVICE (the name its certificate was issued for)
CMD ["--help"]
