"""Several gateway replicas over one Redis, as they run behind a load balancer: real `ctxfuse serve
--backend ... --redis-url ...` processes (each with its own data dir, an edge listener on one CA) in
front of two real `ctxfuse worker` processes. A replica can be killed with -9 and started again."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.bench.worker_proc import ChildServer, WorkerProcess
from shared.certs import init_ca, issue_device, issue_server
from tests.redis_rig import free_port

MODEL = "smollm2-135m-instruct"
WORKER_KEY = "replicas-test-worker-key"  # the workers' --api-key, the replicas' --backend-key
ENGINE_ARGS = (
    "--dtype", "float32", "--weight-quant", "none", "--kv-cache-memory", "0.25",
    "--max-model-len", "2048", "--max-num-seqs", "4",
    "--context-overflow", "truncate_middle",  # a device's long document still gets an answer
)  # fmt: skip
BATCH_LEASE_S = 3.0
DEVICE = "dev-1"  # the device certificate issued in the cluster's tls dir


class ReplicaProcess(ChildServer):
    """One gateway replica: `ctxfuse serve` as a router over `backends`, sharing `redis_url`."""

    def __init__(
        self, name: str, backends: list[str], redis_url: str, data_dir: Path, tls_dir: Path, model: Path
    ) -> None:
        self.name = name
        self.edge_port = free_port()
        args = ["serve", "--port", "0", "--model", str(model), "--served-model-name", MODEL]
        args += ["--data-dir", str(data_dir), "--redis-url", redis_url]
        # short: another replica takes over a killed one's batch within seconds
        args += ["--batch-lease", str(BATCH_LEASE_S)]
        args += ["--edge-host", "127.0.0.1", "--edge-port", str(self.edge_port), "--tls-dir", str(tls_dir)]
        for url in backends:
            args += ["--backend", url]
        env = {k: v for k, v in os.environ.items() if k not in ("CTXFUSE_API_KEY", "CTXFUSE_REDIS_URL")}
        env["CTXFUSE_BACKEND_KEY"] = WORKER_KEY
        super().__init__(args, env)
        self.wait_ready()
        self.base_url = f"{self.url}/v1"
        self.edge_url = f"https://127.0.0.1:{self.edge_port}"

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Cluster:
    redis_url: str
    model: Path
    workdir: Path
    tls_dir: Path
    workers: list[WorkerProcess]
    replicas: list[ReplicaProcess] = field(default_factory=list)

    @property
    def backends(self) -> list[str]:
        return [w.url for w in self.workers]

    def start_replica(self, i: int) -> ReplicaProcess:
        """Start replica `i` (again, after a kill: same data dir, a new process and ports)."""
        data = self.workdir / f"replica-{i}"
        data.mkdir(exist_ok=True)
        replica = ReplicaProcess(f"r{i}", self.backends, self.redis_url, data, self.tls_dir, self.model)
        if i < len(self.replicas):
            self.replicas[i] = replica
        else:
            self.replicas.append(replica)
        return replica

    def device_client(self) -> httpx.Client:
        """The device's mutual-TLS client (certificate `DEVICE` of the cluster's CA)."""
        devices = self.tls_dir / "devices"
        return httpx.Client(
            verify=str(self.tls_dir / "ca.pem"),
            cert=(str(devices / f"{DEVICE}.pem"), str(devices / f"{DEVICE}.key")),
            timeout=120,
        )

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        for w in self.workers:
            w.stop()


def start_cluster(redis_url: str, model: Path, workdir: Path, replicas: int = 2) -> Cluster:
    tls = workdir / "tls"
    init_ca(tls)
    issue_server(tls, ["127.0.0.1", "localhost"])
    issue_device(tls, DEVICE)
    workers = [WorkerProcess(model, MODEL, *ENGINE_ARGS, api_key=WORKER_KEY) for _ in range(2)]
    cluster = Cluster(redis_url, model, workdir, tls, workers)
    try:
        for w in workers:
            w.wait_ready()
        for i in range(replicas):
            cluster.start_replica(i)
    except BaseException:
        cluster.stop()
        raise
    return cluster
