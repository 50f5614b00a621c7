"""`ctxfuse bench serve`: the serving benchmark of `vllm bench serve`, against any OpenAI-compatible
server (ours, llama.cpp's `llama-server`, vLLM, ...), with streamed requests.

Usage
-----
    ctxfuse bench serve --base-url http://127.0.0.1:8000
    ctxfuse bench serve --base-url http://127.0.0.1:8000 --dataset long-doc --input-len 2000 \\
        --output-len 64 --concurrency 1,4,16 --num-prompts 48
    ctxfuse bench serve --base-url http://127.0.0.1:8000 --request-rate 2 --concurrency 16
    ctxfuse bench serve --base-url http://127.0.0.1:8000 --dataset ShareGPT_V3.json --num-prompts 200

Comparing `ctxfuse serve` with `llama-server` on the same GGUF, in one bench: start both, then name
both. Each server gets every run, one server after the other, with the same prompts and the same
arrival times; the table has a row per server and concurrency value.

    ctxfuse serve --port 8000 &
    llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf --port 8080 -np 32 &
    ctxfuse bench serve --base-url http://127.0.0.1:8000 --base-url http://127.0.0.1:8080 \\
        --ignore-eos --output-len 128 --concurrency 1,8,32 --out bench-results/ours-vs-llama.json

`--ignore-eos` makes every answer run to --output-len on both sides, so their token counts match;
leave it out for a server that rejects unknown fields. llama-server serves as many requests at once
as it has slots (`-np`): give it at least the highest concurrency, or it queues the rest.

What is measured
----------------
Per request (gateway/bench/serving/stream.py): TTFT, from sending to the first chunk with content;
ITL, each gap between content chunks; TPOT, (E2E - TTFT) / (output tokens - 1); E2E, to `[DONE]`;
output tokens from the server's usage chunk (`stream_options.include_usage`), else the count of
content chunks. An HTTP error, an error event or a broken stream is a failed request with its
message, never a crash. Per run (gateway/bench/serving/metrics.py): completed and failed requests,
duration, request and token throughputs, and TTFT, ITL, TPOT and E2E mean, p50, p90 and p99 in ms;
a markdown table on stdout, every run in the --out JSON file (the API key is not written).

Datasets (gateway/bench/serving/dataset.py): `random`, --input-len random words per prompt, fresh
for every run so no run finds another's prompts cached; `long-doc`, one document of --input-len
words shared by every request with a short question of its own, to show prefix caching (TTFT after
the first request falls to the question's prefill on a server that caches prefixes); or a
ShareGPT-like JSON/JSONL file (gateway/bench/serving/sharegpt.py). Lengths are in words: the
built-in datasets use common words of about one token each (9,000 words made 9,030 SmolLM2 tokens
with the chat template), free text runs nearer 1.3 tokens per word. The table's token throughputs
use the servers' own counts whenever they send usage.

The client (gateway/bench/serving/client.py) keeps one HTTP/1.1 connection per request in flight
and reads the stream a line at a time; at concurrency 32 and a few hundred tokens per second it
stays far from being the bottleneck. A server that does not answer at all is a one-line error and
exit status 2.
"""

from __future__ import annotations

from gateway.bench.serving.cli import add_serve_bench_parser

__all__ = ["add_serve_bench_parser"]
