"""The edge link without the network: what the agent encodes, the gateway stores and puts back is the
app's request exactly; an edit uploads only the chunks around it; missing chunks are named (409)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge.encode import chunk_strings
from gateway.edge.chunk_store import ChunkStore
from gateway.edge.link import MissingChunksError, expand, store_new_chunks
from shared.edge_protocol import EdgeRequest
from shared.errors import InvalidRequestError

THRESHOLD = 256
T = "tenant-a"  # the tenant every chunk here is stored and read as
LIMIT = 16 * 2**20  # the gateway's default body limit, which bounds an expanded request
texts = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=6000)


def over_the_wire(req: EdgeRequest) -> EdgeRequest:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EdgeRequest)


def send(store: ChunkStore, body: Any, held: set[bytes]) -> tuple[Any, int]:
    """Encode as the agent does (chunks the gateway holds go by reference), then serve as the gateway
    does; returns the reassembled body and the chunk bytes that travelled."""
    out = chunk_strings("chat.completions", body, THRESHOLD)
    out.attach([d for d in out.digests if d not in held])
    req = over_the_wire(out.request)
    store_new_chunks(store, req, LIMIT, tenant=T)
    held.update(out.digests)
    return expand(store, req, LIMIT, tenant=T), sum(len(out.chunks[d]) for d in req.chunks)


@pytest.fixture()
def store(tmp_path: Path) -> ChunkStore:
    return ChunkStore(tmp_path / "chunks.sqlite", max_bytes=64 * 2**20)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=texts, question=texts, other=st.lists(texts, max_size=3))
def test_reassembled_requests_are_identical_to_what_the_app_sent(
    store: ChunkStore, doc: str, question: str, other: list[str]
) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": doc + "\n" + question},
            *({"role": "user", "content": o} for o in other),
        ],
        "temperature": 0.5,
        "stop": [doc[:10]],
    }
    rebuilt, _ = send(store, body, set())
    assert rebuilt == body
    assert msgspec.json.encode(rebuilt) == msgspec.json.encode(body)


def _document(seed: int, size: int) -> str:
    rng = random.Random(seed)
    words = ["contract", "clause", "Übergabe", "価格", "🙂", "party", "shall", "notice", "\n"]
    return " ".join(rng.choice(words) for _ in range(size // 6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), at=st.floats(0, 1), edit=texts.filter(lambda t: len(t) < 20))
def test_an_edit_uploads_only_the_chunks_around_it(
    store: ChunkStore, seed: int, at: float, edit: str
) -> None:
    held: set[bytes] = set()
    doc = _document(seed, 30_000)
    _, first = send(store, {"prompt": doc}, held)
    i = int(at * len(doc))
    edited = doc[:i] + edit + doc[i + len(edit) :]
    rebuilt, second = send(store, {"prompt": edited}, held)
    assert rebuilt == {"prompt": edited}
    assert second <= 4 * 8192 and second < first / 4  # a few chunks at most (8 KiB is the largest)


def test_a_chunk_the_gateway_lacks_is_named_and_recovered(store: ChunkStore) -> None:
    body = {"prompt": "lorem ipsum dolor sit amet " * 400}
    out = chunk_strings("completions", body, THRESHOLD)  # sends no chunk bytes: believes all are held
    with pytest.raises(MissingChunksError) as err:
        expand(store, over_the_wire(out.request), LIMIT, tenant=T)
    assert set(err.value.missing) == set(out.digests)
    assert err.value.status == 409 and err.value.to_openai()["missing"] == [
        d.hex() for d in err.value.missing
    ]
    out.attach(err.value.missing)  # what the uplink does with the 409, then retries once
    retry = over_the_wire(out.request)
    store_new_chunks(store, retry, LIMIT, tenant=T)
    assert expand(store, retry, LIMIT, tenant=T) == body


def test_a_corrupt_chunk_is_refused_before_anything_is_stored(store: ChunkStore) -> None:
    out = chunk_strings("completions", {"prompt": "x" * 5000}, THRESHOLD)
    out.attach(out.digests)
    first = out.digests[0]
    out.request.chunks[first] = out.request.chunks[out.digests[-1]] if len(out.digests) > 1 else b"junk"
    with pytest.raises(InvalidRequestError):
        store_new_chunks(store, over_the_wire(out.request), LIMIT, tenant=T)
    assert store.count == 0


def test_a_body_pointing_past_its_texts_is_refused(store: ChunkStore) -> None:
    out = chunk_strings("completions", {"prompt": "y" * 5000}, THRESHOLD)
    out.request.texts = []
    req = over_the_wire(out.request)
    store_new_chunks(store, req, LIMIT, tenant=T)
    with pytest.raises(InvalidRequestError):
        expand(store, req, LIMIT, tenant=T)
