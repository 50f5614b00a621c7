"""Issue 17, finding 3, on the device: the agent forwards `/v1/models/{id}` to the gateway's edge
listener with the device's certificate. A real agent in front of a real edge listener: a traversal
hidden in the id gets a 400 in OpenAI's error shape and the gateway receives nothing; ordinary model
lookups still go through."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from tests.gateway.raw_http import get_raw_path

from .agent_stack import Gatewayside, gatewayside, running_agent

TRAVERSALS = [
    "/v1/models/..%2F..%2Fv1%2Ffiles",  # the device's view of every tenant's files, before issue 17
    "/v1/models/..%2F..%2Fedge%2Fv1%2Frequest",
    "/v1/models/..%5C..%5Cv1%5Cfiles",
    "/v1/models/../../v1/files",
    "/v1/models/%2e%2e/%2e%2e/v1/files",
    "/v1/models/%252e%252e/%252e%252e/v1/files",
    "/v1/models/stub%0d%0aX-Injected:%201",
]


@dataclass
class Side:
    gateway: Gatewayside
    url: str


@pytest.fixture(scope="module")
def side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Side]:
    tmp = tmp_path_factory.mktemp("paths")
    with gatewayside(tmp) as gw, running_agent(gw.agent_config(tmp / "dev1")) as url:
        yield Side(gw, url)


@pytest.mark.parametrize("path", TRAVERSALS)
def test_a_traversal_through_the_model_route_never_leaves_the_device(side: Side, path: str) -> None:
    before = side.gateway.gateway_requests()
    status, body = get_raw_path(side.url, path)
    assert status == 400, body[:200]
    error = json.loads(body)["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_path"
    assert side.gateway.gateway_requests() == before  # the gateway was not asked anything


def test_model_lookups_still_reach_the_gateway(side: Side) -> None:
    client = openai.OpenAI(base_url=f"{side.url}/v1", api_key="unused", max_retries=0, timeout=30)
    before = side.gateway.gateway_requests()
    assert "stub" in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):  # the stub serves no model by id: its 404, relayed
        client.models.retrieve("stub")
    assert side.gateway.gateway_requests() == before + 2
