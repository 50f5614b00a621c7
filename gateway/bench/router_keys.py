"""`ctxfuse bench router-keys`: what the fleet router spends naming a chat request's prompt blocks
(gateway/backends/fleet/keys.py: render the chat template, tokenize, hash 16-token blocks), for a
conversation's first turn and its next one, with the key memo (key_memo.py) and without, side by side.

Each repeat keys a conversation of its own (a tag in its system message keeps the memo from carrying
one repeat's prompt into the next): the first turn, then the same messages with the assistant's answer
and a new question appended. Both makers key the same two requests in the same repeat, alternating
which goes first. The figures are medians over the repeats, in milliseconds, on one thread.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import msgspec

from cloud.model.text_side import load_text_side
from cloud.model.tokenizer import Tokenizer
from gateway.backends.fleet.keys import KeyMaker
from shared.protocol import ChatCompletionRequest

SIZES = (50, 2_000, 16_000)  # the first turn's prompt tokens, roughly
BLOCK_SIZE = 16  # the workers' default KV block
TEXT = (
    "the router names each block of a prompt by its tokens so that a request goes where its prefix "
    "is already cached and a long conversation is not prefilled twice while short questions wait "
    "behind it on another worker 2048 tokens 16 blocks of éclair and naïve café"
)
WORDS = tuple(TEXT.split())


def _conversation(tokenizer: Tokenizer, tokens: int, tag: int, rng: random.Random) -> list[dict[str, str]]:
    """Alternating turns until the prompt holds about `tokens` tokens, ending on a user's turn."""
    words = 60 if tokens >= 500 else max(1, tokens // 4)
    messages = [{"role": "system", "content": f"Conversation {tag}. Answer briefly."}]
    count = 0
    while True:
        role = "user" if len(messages) % 2 else "assistant"
        messages.append({"role": role, "content": " ".join(rng.choices(WORDS, k=words))})
        count += len(tokenizer.encode(messages[-1]["content"])) + 5  # ChatML adds ~5 a message
        if count >= tokens and role == "user":
            return messages


def _request(messages: list[dict[str, str]]) -> ChatCompletionRequest:
    body = msgspec.json.encode({"model": "m", "messages": messages})
    return msgspec.json.decode(body, type=ChatCompletionRequest)


def _timed(maker: KeyMaker, req: ChatCompletionRequest) -> float:
    """Milliseconds to key `req` as the router does for a ctxfuse worker: its tokens and block hashes."""
    t = time.perf_counter()
    maker.chat(req, True).blocks(BLOCK_SIZE)
    return (time.perf_counter() - t) * 1e3


def run(repeats: int, seed: int) -> dict[str, Any]:
    tokenizer, template = load_text_side()
    makers = {"no_memo": KeyMaker(tokenizer, template, memo=False), "memo": KeyMaker(tokenizer, template)}
    rng = random.Random(seed)
    rows = []
    for size in SIZES:
        times: dict[str, list[float]] = {f"{t}_{m}": [] for t in ("first", "next") for m in makers}
        prompt_tokens = 0
        for r in range(repeats):
            first = _conversation(tokenizer, size, r + size * 1000, rng)
            answer = {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=60))}
            question = {"role": "user", "content": " ".join(rng.choices(WORDS, k=20))}
            turns = {"first": _request(first), "next": _request([*first, answer, question])}
            order = list(makers) if r % 2 else list(reversed(makers))
            for name in order:
                for turn, req in turns.items():
                    times[f"{turn}_{name}"].append(_timed(makers[name], req))
            prompt_tokens = len(makers["no_memo"].chat(turns["first"], True).token_ids)
        med = {k: round(statistics.median(v), 3) for k, v in times.items()}
        rows.append(
            {
                "prompt_tokens": prompt_tokens,
                **med,
                "next_speedup": round(med["next_no_memo"] / med["next_memo"], 1),
            }
        )
    return {"repeats": repeats, "block_size": BLOCK_SIZE, "ms_medians": rows}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| prompt tokens | first turn, no memo | first turn, memo | next turn, no memo | next turn, memo "
        "| next turn speedup |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["ms_medians"]:
        lines.append(
            f"| {row['prompt_tokens']:,} | {row['first_no_memo']:.3f} ms | {row['first_memo']:.3f} ms "
            f"| {row['next_no_memo']:.3f} ms | {row['next_memo']:.3f} ms | {row['next_speedup']}x |"
        )
    return "\n".join(lines)


def add_router_keys_bench_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench.add_parser(
        "router-keys",
        help="ms the fleet router spends keying a conversation's first and next turn, memo vs none",
    )
    p.add_argument("--repeats", type=int, default=21, help="conversations per size (default 21)")
    p.add_argument("--seed", type=int, default=0, help="the conversations' text (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    result = run(args.repeats, args.seed)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0
