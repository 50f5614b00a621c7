"""What a `ctxfuse worker` tells the gateway that routes to it (internal routes, never OpenAI's).

- `GET /internal/v1/state` (JSON): the worker's load and how its prefix cache names blocks.
- `GET /internal/v1/text-side` (msgpack): the model's tokenizer and chat template, so a router that
  holds no model file names prompt blocks exactly as the worker does.
- `GET /internal/v1/blocks?epoch=E&since=N` (msgpack): the prefix-cache blocks stored and evicted
  since event N. A gateway that asks with another epoch (the worker restarted) or with an event the
  worker no longer keeps gets `reset: true` and, in `stored`, every block the worker holds now.
- `POST /internal/v1/generate` (msgpack `GenerateRequest`): a request the router has planned (token
  ids and sampling parameters: the engine seam, gateway/seam.py, over HTTP). A refusal is an error
  status with the OpenAI error body; an accepted request streams `RequestOutput`s, each one frame
  (`frame`: a 4-byte big-endian length, then msgpack). Closing the connection aborts the request.
- `POST /internal/v1/embed` (msgpack `EmbedRequest`): float32 embeddings, row-major, little-endian,
  `inputs` rows of the width the text side names.

Block hashes are the engine's own (cloud/engine/kv/block_pool.py `hash_block`: BLAKE2b-128 chained over
the parent's hash, the block's token ids and any extra key), so a gateway that tokenizes a prompt
with the same model can name the blocks it would need.
"""

from __future__ import annotations

from msgspec import Struct

from shared.engine_types import ImageSpan, Pooling, SamplingParams

HASH_SCHEME = "blake2b128-chain-v1"  # what hash_block computes; a worker with another is not matched


class WorkerLoad(Struct, kw_only=True):
    running: int  # requests being computed this step
    waiting: int  # requests queued
    max_num_seqs: int  # how many may run at once
    kv_usage: float  # share of KV blocks in use, 0..1


class WorkerState(Struct, kw_only=True):
    model: str  # the served model name
    epoch: str  # changes each time the worker process starts: its block events start over
    block_size: int  # tokens per KV block
    hash_scheme: str
    load: WorkerLoad
    draining: bool  # finishing what runs, taking nothing new
    next_event: int  # the sequence number the next block event will get
    # its context: what the router reserves against a key's tokens per minute for a request that
    # sets no max_tokens (0 from a worker older than the field)
    max_model_len: int = 0


class BlockEvents(Struct, kw_only=True):
    epoch: str
    reset: bool  # stored lists every block held now; forget what was known of this worker
    stored: list[bytes]  # block hashes that entered the prefix cache
    evicted: list[bytes]  # block hashes that left it
    next_event: int  # ask with since=next_event for what follows


class TextSide(Struct, kw_only=True):
    """A model's tokenizer and chat template, as a worker serves them to its router."""

    model: str  # the served model name
    tokenizer_json: str  # the `tokenizers` library's own serialization of the vocabulary and rules
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    template: str  # the Jinja chat template the worker renders with (its --chat-template, if given)
    bos_token: str
    eos_token: str
    # what a router needs to plan requests as the worker would (zeros from a worker older than them)
    max_model_len: int = 0
    hidden_size: int = 0  # the width of an embedding
    context_overflow: str = "error"  # the worker's --context-overflow


class GenerateRequest(Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # checked again by the worker: it trusts its router's key, not its input
    priority: int = 0
    image_spans: list[ImageSpan] = []


class EmbedRequest(Struct, kw_only=True):
    request_id: str
    inputs: list[list[int]]
    pooling: Pooling


OUTPUTS_MEDIA = "application/x-ctxfuse-outputs"
_LEN = 4


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_LEN, "big") + payload


class Frames:
    """Whole frames out of a byte stream cut anywhere."""

    def __init__(self) -> None:
        self._pending = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._pending
        buf += data
        out, at = [], 0
        while len(buf) - at >= _LEN:
            size = int.from_bytes(buf[at : at + _LEN], "big")
            if len(buf) - at - _LEN < size:
                break
            out.append(bytes(buf[at + _LEN : at + _LEN + size]))
            at += _LEN + size
        del buf[:at]
        return out

    @property
    def partial(self) -> bool:
        """Whether a frame was cut off (the stream ended inside it)."""
        return bool(self._pending)
