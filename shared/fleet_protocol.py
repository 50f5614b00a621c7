"""What a `ctxfuse worker` tells the gateway that routes to it (internal routes, never OpenAI's).

- `GET /internal/v1/state` (JSON): the worker's load and how its prefix cache names blocks.
- `GET /internal/v1/text-side` (msgpack): the model's tokenizer and chat template, so a router that
  holds no model file names prompt blocks exactly as the worker does.
- `GET /internal/v1/blocks?epoch=E&since=N` (msgpack): the prefix-cache blocks stored and evicted
  since event N. A gateway that asks with another epoch (the worker restarted) or with an event the
  worker no longer keeps gets `reset: true` and, in `stored`, every block the worker holds now.

Block hashes are the engine's own (cloud/engine/kv/block_pool.py `hash_block`: BLAKE2b-128 chained over
the parent's hash, the block's token ids and any extra key), so a gateway that tokenizes a prompt
with the same model can name the blocks it would need.
"""

from __future__ import annotations

from msgspec import Struct

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
