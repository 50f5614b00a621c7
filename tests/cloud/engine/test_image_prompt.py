"""Images in the prompt of a text-only model: an image_features part is rendered as a tagged text
block, found again among the prompt's tokens, and its content hash enters the prefix-cache hash of
every block it touches, so only the same image reuses those blocks."""

from __future__ import annotations

import pytest

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.manager import KVManager
from cloud.engine.request import Request
from cloud.text.image_text import render_image
from shared.engine_types import ImageSpan, SamplingParams
from shared.image_features import ImageFeatures, ImageLabel

CONFIG = EngineConfig(dtype="float32", weight_quant="none", kv_cache_memory_gib=0.25, max_model_len=1024)


def features(digit: str, ocr: str | None = None) -> ImageFeatures:
    return ImageFeatures(
        sha256=digit * 64,
        width=640,
        height=480,
        labels=[ImageLabel(label="traffic light", prob=0.49), ImageLabel(label="ping-pong ball", prob=0.127)],
        embedding=bytes(128),
        embedding_scale=0.01,
        embedding_space="test",
        ocr_text=ocr,
    )


def chat(f: ImageFeatures, question: str = "What is in this picture?") -> list[dict[str, object]]:
    preamble = "You look at pictures for a living. " * 8  # a few blocks before the image
    return [
        {"role": "system", "content": preamble},
        {
            "role": "user",
            "content": [{"type": "text", "text": question}, {"type": "image_features", "image_features": f}],
        },
    ]


@pytest.fixture(scope="module")
def core(loaded_model) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(CONFIG, loaded_model)


def test_the_rendering_gives_labels_with_probabilities_and_the_ocr_text() -> None:
    text = render_image(features("a", "STOP\nno entry"))
    assert text.startswith("<image width=640 height=480>") and text.endswith("</image>")
    assert "traffic light (49%), ping-pong ball (13%)" in text
    assert "STOP\nno entry" in text
    assert "Text in the image" not in render_image(features("a"))


def test_the_image_span_covers_exactly_its_rendered_block(core: EngineCore) -> None:
    f = features("b", "STOP")
    prompt = core.chat_prompt(chat(f))
    (span,) = prompt.image_spans
    assert span.digest == bytes.fromhex("b" * 64)
    inside = core.tokenizer.decode(prompt.token_ids[span.start : span.end], skip_special=False)
    assert render_image(f) in inside
    assert len(inside) - len(render_image(f)) <= 2  # a token may straddle the block's edge
    before = core.tokenizer.decode(prompt.token_ids[: span.start], skip_special=False)
    assert before.endswith("What is in this picture?\n") or before.endswith("What is in this picture?")
    assert core.encode_chat(chat(f)) == prompt.token_ids


def test_a_text_only_conversation_has_no_image_spans(core: EngineCore) -> None:
    assert core.chat_prompt([{"role": "user", "content": "hi"}]).image_spans == ()


def _hashes(tokens: list[int], spans: tuple[ImageSpan, ...], block_size: int = 16) -> list[bytes]:
    kv = KVManager(BlockPool(64), block_size)
    req = Request("r", tokens, SamplingParams(max_tokens=1), image_spans=spans)
    return kv._extend_hashes(req)


def test_the_image_hash_enters_only_the_blocks_it_touches_and_chains_on() -> None:
    tokens = list(range(100, 180))  # five 16-token blocks
    a = _hashes(tokens, (ImageSpan(40, 50, b"\x01" * 32),))
    b = _hashes(tokens, (ImageSpan(40, 50, b"\x02" * 32),))
    plain = _hashes(tokens, ())
    assert a[:2] == b[:2] == plain[:2]  # blocks 0-1 hold tokens 0-31: before the image
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))  # block 2 holds the image; the rest chain
    assert a == _hashes(tokens, (ImageSpan(40, 50, b"\x01" * 32),))


def _cached(core: EngineCore, rid: str, messages: list[dict[str, object]]) -> tuple[int, int]:
    prompt = core.chat_prompt(messages)
    core.add_request(rid, prompt.token_ids, SamplingParams(max_tokens=1), image_spans=prompt.image_spans)
    cached = 0
    while core.has_work():
        for out in core.step():
            if out.finished:
                cached = out.num_cached_tokens
    return cached, prompt.image_spans[0].start


def test_only_the_same_image_reuses_the_blocks_after_it(core: EngineCore) -> None:
    bs = core.kv_plan.block_size
    _cached(core, "first", chat(features("c")))
    same, start = _cached(core, "same", chat(features("c")))
    other, _ = _cached(core, "other", chat(features("d")))  # same text, another image
    assert same > start  # the image's blocks and those after it were reused
    assert other == start // bs * bs  # reuse stops at the block where the image starts
