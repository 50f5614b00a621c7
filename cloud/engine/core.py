"""The engine core: loads a model, owns the scheduler and the runner, and runs one step at a time:
schedule -> run -> update -> emit. No threads here (see async_engine.py for the serving loop).

Every submission is checked before it is queued (prompt length, max_tokens, sampling values), so a
bad request is refused with its reason and never reaches a step. A step that raises fails only the
requests it carried; the core keeps serving.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace
from typing import Any

import torch

from cloud.engine.attention.choice import make_attention, use_triton
from cloud.engine.config import EngineConfig
from cloud.engine.kv.block_events import BlockEventLog
from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.memory import make_kv_cache, plan_kv, release_free_heap
from cloud.engine.kv.prune_plan import PruneLimit
from cloud.engine.kv.prune_plan import check as check_pruning
from cloud.engine.kv.tiers.setup import make_tiers
from cloud.engine.output import TextState, make_output
from cloud.engine.request import FinishReason, Request
from cloud.engine.runner.cuda_graphs import CudaGraphs, eligible
from cloud.engine.runner.model_runner import ModelRunner
from cloud.engine.runner.profile import profile_run
from cloud.engine.sampling.sampler import Sampler
from cloud.engine.scheduling.admission import Admission
from cloud.engine.scheduling.overflow import OverflowPolicy
from cloud.engine.scheduling.scheduler import Scheduler, SchedulerConfig, TokenEvent
from cloud.engine.speculative.drafts import SpecConfig
from cloud.grammar.compiled import CompiledGrammar
from cloud.grammar.compiler import GrammarCompiler
from cloud.model.chat_template import ChatTemplate
from cloud.model.linear import WeightPlan, plan_weights
from cloud.model.loading import LoadedModel, build_model, load_model
from cloud.model.rope import scaled_context, with_rope_scaling
from cloud.model.tokenizer import Tokenizer
from cloud.model.weights import ModelWeights
from cloud.text.prompt import render_chat_prompt
from shared.block_hash import salt_key
from shared.engine_types import (
    ChatPrompt,
    EngineStats,
    ImageSpan,
    RequestOutput,
    SampleResult,
    SamplingParams,
)
from shared.errors import InvalidRequestError, QueueFullError


@dataclass(slots=True)
class _Choice:
    """Engine-side state of one choice: the parent id the caller knows, its index, its text."""

    parent_id: str
    index: int
    text: TextState
    prompt_logprobs: dict[int, SampleResult] | None = None  # by prompt position, while prefilling


GRAMMAR_DEAD_END = (
    "the output reached a point where its grammar allows no token the model can write (a dead end in "
    "the grammar); the output so far is incomplete"
)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_model(config.model)
        self.model_name = config.served_model_name or loaded.name
        weights = loaded.weights
        if config.rope_scaling is not None:  # the user's RoPE scaling overrides the model's
            weights = replace(weights, config=with_rope_scaling(weights.config, config.rope_scaling))
        self.model_config = weights.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.chat_template: ChatTemplate = loaded.chat_template
        if config.chat_template is not None:
            self.chat_template = loaded.chat_template.replaced(config.chat_template, "--chat-template")
        c = self.model_config
        windowed = any(c.attention_window(i) is not None for i in range(c.num_layers))
        check_pruning(config, config.kv_block_size, windowed)
        dtype = config.torch_dtype
        self.device = device = config.torch_device
        self.weight_plan = self._weight_plan(device, weights)
        if device.type == "cuda":  # the KV budget is what the weights and the largest step leave
            context = config.max_model_len or scaled_context(c)
            self.model = build_model(
                weights, dtype=dtype, plan=self.weight_plan, max_positions=context, device=device
            )
            gpu = None
            if config.kv_cache_memory_gib is None:
                gpu = profile_run(self.model, config.max_num_batched_tokens, config.max_num_seqs)
            self.kv_plan = plan_kv(config, c, scaled_context(c), device, gpu)
            self.model.resize_rope(self.kv_plan.max_model_len)
        else:
            self.kv_plan = plan_kv(config, c, scaled_context(c))
            self.model = build_model(
                weights, dtype=dtype, plan=self.weight_plan, max_positions=self.kv_plan.max_model_len
            )
        loaded_path, registered = loaded.path, loaded.name
        # the model holds what it runs on: the float copies of projections it serves from the file's
        # blocks go now, before the KV cache is allocated (peak RSS), unless the caller holds them
        del weights, loaded
        release_free_heap()
        self.max_model_len = self.kv_plan.max_model_len
        self.kv_bytes_per_token = self.kv_plan.bytes_per_token
        # the prefix cache's history, for a router that wants to know what this engine holds
        self.block_events = BlockEventLog()
        layout = self.kv_plan.layout
        groups = 0 if layout is None else layout.num_groups
        self.pool = BlockPool(
            self.kv_plan.num_blocks, config.enable_prefix_caching, self.block_events, groups
        )
        bs = self.kv_plan.block_size
        self.overflow = OverflowPolicy(
            config.context_overflow,
            self.max_model_len,
            config.max_num_batched_tokens,
            config.sparse.sinks,
            bs,
        )
        budget = config.kv_prune_budget
        prune = None if budget is None else PruneLimit(budget, bs, self.kv_plan.num_blocks)
        self.admission = Admission(c.vocab_size, self.max_model_len, self.overflow, prune)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.max_waiting,
                self.max_model_len,
                self.overflow.sink_blocks,
                self.overflow.ring_blocks,
                config.long_prefill_tokens,
                config.kv_prune_budget,
                self._speculative(config),
            ),
            self.pool,
            bs,
            layout,
        )
        self.cache = make_kv_cache(
            self.kv_plan,
            c,
            dtype,
            lambda b: self.pool.blocks[b].ref_count == 0,
            config.max_num_seqs,
            device,
            spare_blocks=1 if device.type == "cuda" else 0,
            page_map=self.pool.page_map,
        )
        self.tiers = make_tiers(
            config,
            self.kv_plan,
            c,
            self.weight_plan.describe(),
            loaded_path,
            self.cache,
            self.pool,
            self.scheduler.kv,
        )
        self.sampler = Sampler(device)
        self.grammars = GrammarCompiler(self.tokenizer, c.vocab_size)
        self.runner = ModelRunner(
            self.model,
            self.cache,
            make_attention(config, c, self.model.rope, self.kv_plan.block_size, device, registered),
            self.sampler,
            self.overflow.sink_blocks,
            config.max_num_seqs,
            self.max_model_len,
            config.kv_prune_budget,
        )
        if self.tiers is not None:
            self.runner.before_forward = self.tiers.apply_loads
        elif layout is not None:
            self.runner.before_forward = self._sync_pages
        self.graphs_off = self._capture_graphs()  # why decode steps run eagerly (None: graphs)
        self._choices: dict[str, _Choice] = {}
        self._children: dict[str, list[str]] = {}
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)

    def _speculative(self, config: EngineConfig) -> SpecConfig | None:
        """Drafts from predicted outputs always, from prompt lookup with --speculative ngram."""
        ngram = config.speculative == "ngram"
        if config.attention == "sparse":  # a rejected draft's keys would widen its block's key bounds
            if ngram:
                raise InvalidRequestError("--speculative ngram needs dense attention, not --attention sparse")
            return None  # (a prediction then only goes unused: the output is the same)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise InvalidRequestError("--prompt-lookup-min is above --prompt-lookup-max")
        return SpecConfig(
            ngram,
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.speculative_max_running,
            within_block=config.kv_dtype in ("int8", "int4"),
        )

    def _sync_pages(self) -> None:
        """The page map's changed rows to the cache's copy (on a CPU they share one tensor)."""
        pool, cache = self.pool, self.cache
        if pool.dirty and isinstance(cache, KVCache) and cache.page_map is not None:
            if cache.page_map is not pool.page_map and pool.page_map is not None:
                rows = torch.tensor(sorted(pool.dirty), dtype=torch.long)
                cache.page_map[rows.to(cache.device)] = pool.page_map[rows].to(cache.device)
            pool.dirty.clear()

    def close(self) -> None:
        """Finish what outlives the engine (the disk tier's queued writes)."""
        if self.tiers is not None:
            self.tiers.close()

    def _weight_plan(self, device: torch.device, weights: ModelWeights) -> WeightPlan:
        config, c = self.config, self.model_config
        if device.type != "cpu":  # int8 / int4 weights are CPU kernels; a GPU runs dense weights
            if config.weight_quant in ("int8", "int4"):
                raise InvalidRequestError(
                    f"--weight-quant {config.weight_quant} uses CPU kernels; on {device} use none or auto"
                )
            return WeightPlan.single(config.run_dtype)  # type: ignore[arg-type]
        layers = weights.layers
        qtype = layers[0].blocks["w_gate"].qtype if layers and "w_gate" in layers[0].blocks else None
        return plan_weights(
            config.run_dtype,
            config.weight_quant,
            (2 * c.intermediate_size, c.hidden_size),
            c.num_layers,
            qtype,
        )

    def describe_device(self) -> str:
        """One line for the start-up log: where the engine runs and how."""
        attention = type(self.runner.attention).__name__
        graphs = "CUDA graphs for decode" if self.graphs_off is None else f"eager decode ({self.graphs_off})"
        return (
            f"engine on {self.device} ({self.config.run_dtype}, weights {self.weight_plan.describe()}, "
            f"{attention}, {graphs})"
        )

    def _capture_graphs(self) -> str | None:
        triton = use_triton(self.config.attention_kernels, self.device)
        cache = self.cache
        why = eligible(self.device, self.config.enforce_eager, cache, triton)
        if why is not None or not isinstance(cache, KVCache):
            return why
        spare_slot = self.kv_plan.num_blocks * self.kv_plan.block_size
        graphs = CudaGraphs(
            self.model,
            cache,
            self.runner.attention,
            self.config.max_num_seqs,
            self.runner.batch.max_blocks,
            spare_slot,
        )
        graphs.capture()
        self.runner.graphs = graphs
        return None

    # -- submission -------------------------------------------------------------------------

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
    ) -> list[int]:
        """Prompt ids for a conversation of text messages (chat_prompt for the general case)."""
        return self.chat_prompt(messages, tools, tool_choice).token_ids

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        """The prompt for a conversation (prompt.py)."""
        return render_chat_prompt(
            self.chat_template, self.tokenizer, messages, tools, tool_choice, template_kwargs
        )

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return self.admission.default_max_tokens(num_prompt_tokens)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the client's mistake, if any, before anything is queued."""
        self.admission.check(prompt_token_ids, params)

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar a request needs (cached by spec); raises InvalidRequestError when its
        spec cannot be compiled. Call it off the engine thread: compiling can take a while."""
        return None if params.grammar is None else self.grammars.compile(params.grammar)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        grammar: CompiledGrammar | None = None,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> None:
        """Queue a request (its n choices share the prompt's blocks). Raises on bad input or a full queue.
        `grammar` is params.grammar compiled (compile_grammar); compiled here when not given.
        `image_spans`: where the prompt's images are (chat_prompt)."""
        self.check(prompt_token_ids, params)
        if grammar is None:
            grammar = self.compile_grammar(params)
        prompt_token_ids, dropped = self.overflow.fit(prompt_token_ids, params)
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id} is already in use")
        if len(self.scheduler.waiting) + params.n > self.scheduler.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.config.max_waiting} requests)")
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_ids
        extra_key = salt_key(params.cache_salt)
        if dropped and image_spans:  # positions moved: every block carries every image's hash instead
            extra_key, image_spans = extra_key + b"".join(s.digest for s in image_spans), ()
        first: Request | None = None
        kids = []
        for i in range(params.n):
            p = params
            if params.n > 1:
                # each choice samples with its own generator; a seeded request stays reproducible
                seed = None if params.seed is None else params.seed + i
                p = replace(params, n=1, seed=seed)
            if p.seed is None and not p.greedy:
                p = replace(p, seed=self._rng.getrandbits(63))
            rid = f"{request_id}#{i}" if params.n > 1 else request_id
            req = Request(
                rid,
                list(prompt_token_ids),
                p,
                eos,
                priority,
                extra_key,
                image_spans,
                wait_for=first,
                grammar=grammar,
            )
            req.num_truncated_tokens = dropped
            req.sliding = self.overflow.slides(len(prompt_token_ids), params.max_tokens)
            first = first or req
            self.scheduler.add(req)
            if req is first:  # (the other choices share its prompt)
                self.scheduler.kv.prefetch(req)
            self._choices[rid] = _Choice(
                request_id,
                i,
                TextState(self.tokenizer, p.stop),
                {} if p.prompt_logprobs is not None else None,
            )
            kids.append(rid)
        self._children[request_id] = kids

    def abort(self, request_id: str) -> list[RequestOutput]:
        """End a request and all its choices at once, freeing their blocks."""
        outs = []
        for rid in self._children.get(request_id, []):
            req = self.scheduler.finish(rid, FinishReason.ABORT)
            if req is not None:
                outs.append(self._final(req, FinishReason.ABORT))
        return outs

    # -- the step ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # fail the step's requests, keep the engine alive
            return self._fail([c.request for c in out.chunks], exc)
        for rid, scored in result.prompt_logprobs.items():
            choice = self._choices[rid]
            if choice.prompt_logprobs is not None:
                choice.prompt_logprobs.update(scored)  # a recompute after preemption rewrites the same
        sampled = {rid: [r.token_id for r in res] for rid, res in result.sampled.items()}
        events = self.scheduler.update(out, sampled)
        if self.tiers is not None:
            self.tiers.write_through()  # the blocks this step filled, to disk
        return [self._emit(ev, result.sampled[ev.request.request_id]) for ev in events]

    def _emit(self, ev: TokenEvent, results: list[SampleResult]) -> RequestOutput:
        """One output for the step's tokens of a request (several: drafts it accepted)."""
        req = ev.request
        choice = self._choices[req.request_id]
        finish = ev.finish
        text, hit_stop, n = "", False, 0
        for n, token in enumerate(ev.token_ids, 1):
            if results[n - 1].rejected:  # never let output that left its grammar through as if it were fine
                n -= 1
                break
            stop_token = (
                n == len(ev.token_ids) and finish is FinishReason.STOP and token in self._stop_ids(req)
            )
            piece, hit_stop = choice.text.add(token, emit_text=not stop_token)
            text += piece
            if hit_stop:
                break
        if n < len(ev.token_ids):  # tokens past a stop string or a grammar's dead end are not output
            del req.output_token_ids[n - len(ev.token_ids) :]
            del req.token_ids[n - len(ev.token_ids) :]
        if n < len(ev.token_ids) and not hit_stop:
            # the grammar allowed no token here (a dead end in it): this choice ends, the others go on
            self.scheduler.finish(req.request_id, FinishReason.ERROR)
            out = self._final(req, FinishReason.ERROR, GRAMMAR_DEAD_END)
            out.error_code = "grammar_dead_end"
            out.text, out.token_ids = text, ev.token_ids[:n]
            return out
        if hit_stop and finish is None:
            finish = FinishReason.STOP
            self.scheduler.finish(req.request_id, finish)
        elif finish is not None:
            finish = FinishReason.STOP if hit_stop else finish
            text += choice.text.flush()
        o = make_output(req, choice.parent_id, choice.index, text, ev.token_ids[:n], finish)
        if req.params.logprobs is not None or req.params.constrained_logprobs:
            o.logprobs = results[:n]
        if choice.prompt_logprobs is not None and len(req.output_token_ids) == 1:
            first = SampleResult(req.prompt_token_ids[0])  # nothing precedes it: no logprob
            o.prompt_logprobs = [first] + [choice.prompt_logprobs[p] for p in range(1, req.num_prompt_tokens)]
            choice.prompt_logprobs = None
        if finish is not None:
            self._forget(req.request_id)
        return o

    def _stop_ids(self, req: Request) -> frozenset[int] | set[int]:
        return req.eos_token_ids | set(req.params.stop_token_ids)

    def _final(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        choice = self._choices[req.request_id]
        o = make_output(req, choice.parent_id, choice.index, "", [], reason)
        o.error = error
        self._forget(req.request_id)
        return o

    def _fail(self, reqs: list[Request], exc: Exception) -> list[RequestOutput]:
        outs = []
        for req in reqs:
            if self.scheduler.finish(req.request_id, FinishReason.ERROR) is not None:
                outs.append(
                    self._final(req, FinishReason.ERROR, f"engine error: {type(exc).__name__}: {exc}")
                )
        return outs

    def fail_all(self, exc: Exception) -> list[RequestOutput]:
        """End every unfinished request with an error (after a failure outside the model step)."""
        return self._fail(list(self.scheduler.requests.values()), exc)

    def is_live(self, request_id: str) -> bool:
        """Whether some choice of this submitted request is still unfinished."""
        return request_id in self._children

    def _forget(self, rid: str) -> None:
        choice = self._choices.pop(rid, None)
        self.sampler.forget(rid)
        if choice is None:
            return
        kids = self._children.get(choice.parent_id, [])
        if all(k not in self._choices for k in kids):
            self._children.pop(choice.parent_id, None)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.pool.num_free,
            num_blocks=self.pool.num_blocks,
            kv_usage=self.pool.usage,
            kv_bytes_per_token=self.kv_bytes_per_token,
            prefix_queried_tokens=self.scheduler.prefix_queried_tokens,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            grammar_cache_hits=self.grammars.hits,
            grammar_cache_misses=self.grammars.misses,
            kv_tiers=() if self.tiers is None else self.tiers.stats(),
            spec_draft_tokens=self.scheduler.num_draft_tokens,
            spec_accepted_tokens=self.scheduler.num_accepted_tokens,
            kv_dtype=self.kv_plan.kv_dtype,
        )

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"
