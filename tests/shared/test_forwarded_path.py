"""The forwarded-path check (shared/forwarded_path.py): every way of hiding a traversal, a separator
or a control character in a path is refused in the OpenAI error shape; ordinary model paths pass
unchanged, still encoded as the client sent them."""

from __future__ import annotations

import pytest

from shared.forwarded_path import UnsafePathError, forwarded_path


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models",
        "/v1/models/smollm2-135m-instruct",
        "/v1/models/org/model-7b",  # a raw `/` in an id is a separator the route already matched
        "/v1/models/my%20model",  # kept encoded: the backend decodes it once
        "/v1/models/llama3.1:8b",
        "/v1/models/a..b",  # dots inside a segment are no dot segment
        "/v1/models/.hidden",
    ],
)
def test_an_ordinary_path_passes_as_it_came(path: str) -> None:
    assert forwarded_path(path) == path
    assert forwarded_path(path.encode()) == path


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/v1/models/..%2F..%2Finternal%2Fv1%2Fblocks", "encoded separator"),  # the finding
        ("/v1/models/..%2f..%2finternal", "encoded separator"),
        ("/v1/models/x%5C..%5Cinternal", "encoded separator"),
        ("/v1/models/x%5c", "encoded separator"),
        ("/v1/models/x\\..\\internal", "backslash"),
        ("/v1/models/../../internal/v1/blocks", "segment"),
        ("/v1/models/..", "segment"),
        ("/v1/models/./x", "segment"),
        ("/v1/models/%2e%2e/internal", "segment"),
        ("/v1/models/%2E%2E", "segment"),
        ("/v1/models/.%2e/internal", "segment"),
        ("/v1/models/%2e/x", "segment"),
        ("/v1/models/%252e%252e/internal", "segment"),  # encoded twice
        ("/v1/models/..%252F..%252Finternal", "encoded separator"),  # the separator encoded twice
        ("/v1/models/%25252525252e", "more than"),
        ("/v1/models/x%00", "control character"),
        ("/v1/models/x%0d%0aHost:%20evil", "control character"),
        ("/v1/models/x%7f", "control character"),
        ("/v1/models/x\x00", "control character"),
        ("/v1/models/x\t", "control character"),
        ("//evil.example/v1/models", "starts with //"),
        ("v1/models", "does not start with /"),
        ("/v1/models/x%zz", "no escape"),
        ("/v1/models/x%", "no escape"),
        ("/v1/models/%ff%fe", "not UTF-8"),
    ],
)
def test_a_path_that_could_name_another_route_is_refused(path: str, why: str) -> None:
    with pytest.raises(UnsafePathError) as caught:
        forwarded_path(path)
    assert why in caught.value.message
    assert caught.value.status == 400
    error = caught.value.to_openai()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_path"


def test_bytes_that_are_not_ascii_are_refused() -> None:
    with pytest.raises(UnsafePathError, match="not ASCII"):
        forwarded_path("/v1/models/é".encode())
