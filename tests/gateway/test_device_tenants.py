"""Devices belong to tenants through their certificate, and the edge link's chunk store answers per
tenant.

Real parts on loopback: the gateway's edge listener over mutual TLS, devices enrolled with the real
CA (`shared.certs`, and `ctxfuse certs` for the command line), its SQLite stores, the real model.
Tenant acme has two devices (a1, a2), tenant globex one (b1), and one device has no tenant (lone,
a tenant of its own).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend
from ctxfuse.cli import main
from gateway.backends.local import engine_gateway
from gateway.config import GatewayConfig
from gateway.edge.chunk_store import ChunkStore
from gateway.edge.server import build_edge_server
from shared import certs
from shared.chunking import digest
from shared.compression import compress
from shared.edge_protocol import EdgeRequest, text_ref
from shared.tls import client_context
from tests.edge.test_edge_e2e import ENGINE, MODEL, start
from tests.gateway.edge_rig import send_edge_request

DEVICES = {"a1": "acme", "a2": "acme", "b1": "globex", "lone": None}


@dataclass
class Edge:
    url: str  # the edge listener, https
    devices: dict[str, httpx.Client]  # mutual TLS, each with its own certificate
    store: ChunkStore

    def send(self, device: str, req: EdgeRequest) -> httpx.Response:
        return send_edge_request(self.devices[device], self.url, req)


@pytest.fixture(scope="module")
def edge(loaded_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    tls = tmp_path_factory.mktemp("tls")
    certs.init_ca(tls)
    certs.issue_server(tls, ["127.0.0.1", "localhost"])
    for name, tenant in DEVICES.items():
        certs.issue_device(tls, name, tenant=tenant)
    state = tmp_path_factory.mktemp("state")
    backend = InProcessBackend(AsyncEngine(EngineCore(ENGINE, loaded_model)))
    config = GatewayConfig(port=0, edge_host="127.0.0.1", edge_port=0, tls_dir=tls, data_dir=state / "gw")
    store = ChunkStore(state / "chunks.sqlite", 64 * 2**20)
    listener = build_edge_server(engine_gateway(backend, config, store))
    url = f"https://127.0.0.1:{start(listener, 'edge-listener')}"
    clients = {name: httpx.Client(verify=client_context(tls, name), timeout=120) for name in DEVICES}
    yield Edge(url, clients, store)
    for client in clients.values():
        client.close()
    listener.should_exit = True
    backend.shutdown()


def file_ids(edge: Edge, device: str) -> set[str]:
    resp = edge.devices[device].get(f"{edge.url}/v1/files")
    assert resp.status_code == 200, resp.text
    return {f["id"] for f in resp.json()["data"]}


def test_a_tenants_devices_share_its_files_and_batches_and_no_one_else_sees_them(edge: Edge) -> None:
    line = {"custom_id": "q1", "method": "POST", "url": "/v1/completions"}
    line["body"] = {"model": MODEL, "prompt": "hello", "max_tokens": 1}  # type: ignore[assignment]
    upload = edge.devices["a1"].post(
        f"{edge.url}/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n", "application/jsonl")},
    )
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    batch = edge.devices["a1"].post(
        f"{edge.url}/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"},
    )
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]

    # acme's second device: the same tenant, the same files and batches
    assert file_id in file_ids(edge, "a2")
    a2 = edge.devices["a2"]
    assert a2.get(f"{edge.url}/v1/files/{file_id}/content").content == json.dumps(line).encode() + b"\n"
    assert a2.get(f"{edge.url}/v1/batches/{batch_id}").status_code == 200
    assert batch_id in {b["id"] for b in a2.get(f"{edge.url}/v1/batches").json()["data"]}

    # another tenant's device, and a device without a tenant: not in lists, 404 by id
    for other in ("b1", "lone"):
        assert file_id not in file_ids(edge, other)
        client = edge.devices[other]
        assert batch_id not in {b["id"] for b in client.get(f"{edge.url}/v1/batches").json()["data"]}
        for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/batches/{batch_id}"):
            resp = client.get(f"{edge.url}{path}")
            assert resp.status_code == 404, (other, path, resp.text)
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def referencing(chunk: bytes, *, carry: bool) -> EdgeRequest:
    """A completion whose prompt is one chunk: sent with its bytes, or by reference only."""
    d = digest(chunk)
    return EdgeRequest(
        endpoint="completions",
        body={"model": MODEL, "prompt": text_ref(0), "max_tokens": 1},
        texts=[[d]],
        chunks={d: compress(chunk)} if carry else {},
    )


def missing_of(resp: httpx.Response) -> list[str]:
    assert resp.status_code == 409, resp.text[:300]
    body = resp.json()
    assert (body["error"]["type"], body["error"]["code"]) == ("invalid_request_error", "missing_chunks")
    return list(body["missing"])


def test_a_chunk_is_held_only_for_the_tenant_whose_device_sent_it(edge: Edge) -> None:
    chunk = b"acme's confidential quarterly figures, one chunk of them. " * 40
    d = digest(chunk).hex()
    assert edge.send("a1", referencing(chunk, carry=True)).status_code == 200
    stored = (edge.store.count, edge.store.total_bytes)

    # globex's device and the tenant-less one cannot learn that the gateway holds it, nor use it
    assert missing_of(edge.send("b1", referencing(chunk, carry=False))) == [d]
    assert missing_of(edge.send("lone", referencing(chunk, carry=False))) == [d]
    # acme's second device refers to it without sending it again
    resp = edge.send("a2", referencing(chunk, carry=False))
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["usage"]["prompt_tokens"] > 0

    # once b1 sends the bytes itself, globex holds the chunk too; the bytes are stored once
    assert edge.send("b1", referencing(chunk, carry=True)).status_code == 200
    assert edge.send("b1", referencing(chunk, carry=False)).status_code == 200
    assert (edge.store.count, edge.store.total_bytes) == stored
    assert missing_of(edge.send("lone", referencing(chunk, carry=False))) == [d]


def test_certs_issue_records_the_tenant_and_list_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(tmp_path / "tls")
    assert main(["certs", "init", root]) == 0
    assert main(["certs", "issue", root, "edge-1", "--tenant", "acme"]) == 0
    assert main(["certs", "issue", root, "edge-2"]) == 0
    capsys.readouterr()
    assert main(["certs", "list", root]) == 0
    rows = {line.split("\t")[0]: line.split("\t") for line in capsys.readouterr().out.splitlines()}
    assert "tenant acme" in rows["edge-1"] and "tenant -" in rows["edge-2"]
    cert = certs.TLSDir(Path(root)).device_cert("edge-1")
    san = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    uris = san.value.get_values_for_type(x509.UniformResourceIdentifier)
    assert uris == [certs.DEVICE_URI_PREFIX + "edge-1", certs.TENANT_URI_PREFIX + "acme"]


@pytest.mark.parametrize("tenant", ["", "bad name", "device:x", "-lead", "a" * 65, "acme\n", "../etc"])
def test_certs_issue_refuses_a_bad_tenant_name_and_issues_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tenant: str
) -> None:
    root = str(tmp_path / "tls")
    assert main(["certs", "init", root]) == 0
    assert main(["certs", "issue", root, "edge-1", f"--tenant={tenant}"]) == 2
    assert "tenant" in capsys.readouterr().err
    assert not certs.TLSDir(Path(root)).device_cert("edge-1").exists()
    assert certs.list_devices(Path(root)) == []
