"""An engine that answers at once: the Backend protocol with no model, so the gateway's own cost is
all that is left to measure. Every request gets the same few tokens (n=1 as planned by the gateway).

The tokenizer is a byte-level vocabulary of 256 tokens plus `<|im_end|>`, built in memory: planning a
request (encode, check) runs the gateway's real code path without a model file.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

from cloud.model.tokenizer import Tokenizer
from shared.engine_types import ChatPrompt, EngineStats, ImageSpan, RequestOutput, SamplingParams
from shared.errors import EngineError

MODEL_NAME = "bench-instant"
# One engine output per piece: the stream carries one content chunk per piece.
PIECES = ("Hello", " from", " the", " bench", ".")


def byte_level_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte-level characters
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    rust = _RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    return Tokenizer(rust, bos_id=None, eos_id=rust.token_to_id("<|im_end|>"))


@dataclass(slots=True)
class InstantGeneration:
    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        last = len(PIECES) - 1
        for i, piece in enumerate(PIECES):
            yield RequestOutput(
                request_id=self.request_id,
                index=0,
                text=piece,
                token_ids=[i + 1],
                finished=i == last,
                finish_reason="stop" if i == last else None,
                num_prompt_tokens=8,
                num_output_tokens=i + 1,
            )

    def close(self) -> None:
        pass


class InstantBackend:
    max_model_len = 4096
    hidden_size = 1
    context_overflow = "error"

    def __init__(self) -> None:
        self.model_name = MODEL_NAME
        self.tokenizer = byte_level_tokenizer()

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        return ChatPrompt(self.tokenizer.encode(" ".join(str(m.get("content", "")) for m in messages)))

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return max(1, self.max_model_len - num_prompt_tokens)

    def check_text_size(self, num_chars: int) -> None:
        pass  # the fake upstream refuses nothing by size

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate(self.tokenizer.vocab_size)

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> InstantGeneration:
        return InstantGeneration(request_id)

    async def embed(self, inputs: list[list[int]], pooling: str, request_id: str) -> Any:
        raise EngineError("the bench's instant backend computes no embeddings")

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 1, 1, 0.0, 1, 0, 0)

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass
