"""The in-process half of `ctxfuse bench step-profile` (step_profile.py): the parts of a decode step,
exclusive timers that wrap the engine's real objects for a while and put them back, and one greedy
request decoded timed and untimed, round after round."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kernels.cpu.norm_rope as norm_rope_module
from cloud.engine.core import EngineCore
from cloud.engine.output import TextState
from shared.engine_types import SamplingParams

if TYPE_CHECKING:  # the serving backends load only where the seam is measured
    from cloud.serving.in_process import InProcessBackend
    from cloud.serving.process import ProcessBackend

    Backend = InProcessBackend | ProcessBackend


# Public domain prose (Dickens, A Tale of Two Cities): the prompt's words, repeated as needed
PROSE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way."
)


@dataclass(frozen=True, slots=True)
class Part:
    key: str  # its name in the JSON
    label: str  # its row in the table


SCHEDULER = Part("scheduler", "scheduler (schedule + update)")
PREPARE = Part("prepare", "runner: prepare inputs (batch rows, block tables, slots)")
EMBED = Part("embed", "forward: embedding lookup (dequantized rows)")
ROPE_TABLES = Part("rope_tables", "forward: RoPE cos/sin lookup")
GEMV_QKV = Part("gemv_qkv", "forward: GEMV qkv")
GEMV_O = Part("gemv_o", "forward: GEMV o")
GEMV_GATE_UP = Part("gemv_gate_up", "forward: GEMV gate+up")
GEMV_DOWN = Part("gemv_down", "forward: GEMV down")
LM_HEAD = Part("lm_head", "forward: lm_head GEMV")
KV_WRITE = Part("kv_write", "forward: KV cache write")
ATTENTION = Part("attention", "forward: attention kernel")
NORMS = Part("norms", "forward: norms + RoPE + SiLU*up kernels")
FORWARD_PY = Part("forward_python", "forward: Python between kernels")
SAMPLING = Part("sampling", "sampling")
RUNNER_PY = Part("runner_python", "runner: Python around the forward (sampling batch, results)")
OUTPUT = Part("output", "output building (RequestOutput, stop checks)")
DETOKENIZE = Part("detokenize", "detokenizing (incremental decoder)")
OTHER = Part("other", "other (Python between parts)")
PARTS = (
    SCHEDULER, PREPARE, EMBED, ROPE_TABLES, GEMV_QKV, KV_WRITE, ATTENTION, GEMV_O, GEMV_GATE_UP,
    GEMV_DOWN, NORMS, LM_HEAD, FORWARD_PY, SAMPLING, RUNNER_PY, OUTPUT, DETOKENIZE, OTHER,
)  # fmt: skip
GEMV_PARTS = (GEMV_QKV, GEMV_O, GEMV_GATE_UP, GEMV_DOWN, LM_HEAD)


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    prompt_tokens: int = 128
    new_tokens: int = 128
    rounds: int = 3  # each: an untimed and a timed decode, then a stream per mode at each seam
    api: bool = True  # also through the serving backends and `ctxfuse serve`
    torch_profiler: bool = False
    model: str | None = None  # None: the default model
    out: Path = Path("bench-results/step-profile.json")


# -- timers ----------------------------------------------------------------------------------------


class PartClock:
    """Exclusive seconds per part: entering a part pauses the part it was entered from. `span` is the
    time from each outermost enter to its leave, which the parts' seconds add up to exactly."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.span = 0.0
        self._stack: list[str] = []
        self._mark = 0.0
        self._root_start = 0.0

    def enter(self, part: str) -> None:
        now = time.perf_counter()
        if self._stack:
            top = self._stack[-1]
            self.seconds[top] = self.seconds.get(top, 0.0) + (now - self._mark)
        else:
            self._root_start = now
        self._stack.append(part)
        self._mark = now

    def leave(self) -> None:
        now = time.perf_counter()
        top = self._stack.pop()
        self.seconds[top] = self.seconds.get(top, 0.0) + (now - self._mark)
        self._mark = now
        if not self._stack:
            self.span += now - self._root_start


class Patches:
    """Attributes replaced for a while: an instance's (its own or a method of its class), a class's
    method or a module's function; `undo` puts every one back as it was."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def timed(self, owner: object, name: str, clock: PartClock, part: Part) -> None:
        fn = getattr(owner, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            clock.enter(part.key)
            try:
                return fn(*args, **kwargs)
            finally:
                clock.leave()

        own = getattr(owner, "__dict__", None)
        # a slot, a class's or a module's attribute is set back; an instance's view of its class's
        # method goes again (the class's is found once more)
        if own is None or name in own:
            self._undo.append(lambda: setattr(owner, name, fn))
        else:
            self._undo.append(lambda: delattr(owner, name))
        setattr(owner, name, timed_call)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


@contextmanager
def instrumented(core: EngineCore, clock: PartClock) -> Iterator[None]:
    """The core's step with every part timed by `clock`, put back as it was on leaving."""
    patches = Patches()
    runner, model = core.runner, core.runner.model
    try:
        patches.timed(core, "step", clock, OTHER)  # outermost: its own time is what no part covers
        patches.timed(core.scheduler, "schedule", clock, SCHEDULER)
        patches.timed(core.scheduler, "update", clock, SCHEDULER)
        patches.timed(runner, "prepare", clock, PREPARE)
        patches.timed(runner.cache, "begin_step", clock, PREPARE)
        patches.timed(runner, "execute", clock, RUNNER_PY)
        patches.timed(runner, "sampler", clock, SAMPLING)
        patches.timed(runner, "attention", clock, ATTENTION)  # bound to the cache afresh each step
        patches.timed(runner.cache, "write", clock, KV_WRITE)
        patches.timed(model, "forward", clock, FORWARD_PY)
        for name, part in (("_embed", EMBED), ("lm_head", LM_HEAD)):
            if hasattr(model, name):
                patches.timed(model, name, clock, part)
        rope = getattr(model, "rope", None)
        if rope is not None:
            patches.timed(rope, "tables", clock, ROPE_TABLES)
        for layer in getattr(model, "layers", []):
            for name, part in (
                ("qkv", GEMV_QKV),
                ("o", GEMV_O),
                ("gate_up", GEMV_GATE_UP),
                ("down", GEMV_DOWN),
            ):
                patches.timed(layer, name, clock, part)
        if getattr(model, "fused", False) and model.device.type == "cpu":
            # the fused forward imports these from the module at each call: timed there
            for name in ("rms_norm", "fused_add_rms_norm", "rope_apply_", "silu_mul"):
                patches.timed(norm_rope_module, name, clock, NORMS)
        elif hasattr(model, "_norm"):
            patches.timed(model, "_norm", clock, NORMS)
            if rope is not None:
                patches.timed(rope, "apply", clock, NORMS)
        patches.timed(core, "_emit", clock, OUTPUT)
        patches.timed(TextState, "add", clock, DETOKENIZE)
        yield
    finally:
        patches.undo()


# -- in process ------------------------------------------------------------------------------------


@dataclass(slots=True)
class InProcess:
    """Decode steps of one c=1 greedy request on EngineCore, each computing one token."""

    steps: int  # timed decode steps, all rounds together
    parts_ms: dict[str, float]  # part key -> ms per step (OTHER included): the timed step
    timed_ms: float  # ms per timed step: the parts' sum
    # ms per step without timers: the median over rounds of a round's mean, as the serving figures
    untimed_ms: float
    untimed_median_ms: float  # the median step
    same_tokens: bool  # the timed decodes generated the untimed decodes' tokens
    # per GEMV part and "all": the weight MiB a step reads (every layer's), and GB/s over its time
    gemv_mib: dict[str, float]
    gemv_gbs: dict[str, float]


def prompt_text(core: EngineCore, tokens: int) -> tuple[str, list[int]]:
    """A user message of prose whose chat prompt is as close to `tokens` tokens as whole words allow
    (at most `tokens`), and that prompt's ids."""
    words = PROSE.split()
    best = ("", core.encode_chat([{"role": "user", "content": ""}]))
    n = 1
    while True:
        text = " ".join(words[i % len(words)] for i in range(n))
        ids = core.encode_chat([{"role": "user", "content": text}])
        if len(ids) > tokens:
            return best
        best = (text, ids)
        n += 1 if tokens - len(ids) < 16 else max(1, (tokens - len(ids)) // 2)


def decode(
    core: EngineCore, prompt: list[int], new_tokens: int, request_id: str, clock: PartClock | None = None
) -> tuple[list[int], list[float]]:
    """One greedy request to its end: its tokens and the seconds of each step after the first (the
    first computes the prompt; every later one decodes one token). With a clock (the core
    instrumented), what the prompt's step put on it is taken off again."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(request_id, prompt, params)
    kept = None if clock is None else (dict(clock.seconds), clock.span)
    tokens: list[int] = []
    spans: list[float] = []
    while core.has_work():
        t0 = time.perf_counter()
        outs = core.step()
        spans.append(time.perf_counter() - t0)
        if clock is not None and kept is not None:
            clock.seconds, clock.span = kept
            kept = None
        for o in outs:
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            tokens += o.token_ids
    return tokens, spans[1:]


_LAYER_PROJECTIONS = ((GEMV_QKV, "qkv"), (GEMV_O, "o"), (GEMV_GATE_UP, "gate_up"), (GEMV_DOWN, "down"))


def _gemv_bytes(core: EngineCore) -> dict[str, int]:
    """The weight bytes each GEMV part reads in a step (a Linear's `nbytes`, over every layer)."""
    model = core.runner.model
    layers = getattr(model, "layers", [])
    found = {
        p.key: sum(int(getattr(getattr(la, n), "nbytes", 0)) for la in layers) for p, n in _LAYER_PROJECTIONS
    }
    found[LM_HEAD.key] = int(getattr(getattr(model, "lm_head", None), "nbytes", 0))
    return found


class StepProfiler:
    """Untimed and timed decodes of one prompt on the core, a pair per round; `result` sums them up."""

    def __init__(self, core: EngineCore, prompt: list[int], new_tokens: int) -> None:
        self.core, self.prompt, self.new_tokens = core, prompt, new_tokens
        self.clock = PartClock()
        self.untimed: list[list[float]] = []  # per round, seconds per untimed decode step
        self.steps = 0  # timed decode steps
        self.reference: list[int] | None = None  # the first untimed decode's tokens
        self.same = True
        decode(core, prompt, 8, "warmup")  # one-time costs (first calls, allocations): no round's

    def round(self, i: int) -> None:
        tokens, spans = decode(self.core, self.prompt, self.new_tokens, f"untimed-{i}")
        self.untimed.append(spans)
        self.reference = self.reference or tokens
        with instrumented(self.core, self.clock):
            timed, timed_spans = decode(self.core, self.prompt, self.new_tokens, f"timed-{i}", self.clock)
        self.steps += len(timed_spans)
        self.same = self.same and tokens == self.reference and timed == self.reference

    def result(self) -> InProcess:
        seconds, steps = self.clock.seconds, self.steps
        nbytes = _gemv_bytes(self.core)
        nbytes["all"] = sum(nbytes.values())
        gemv_s = {p.key: seconds.get(p.key, 0.0) / steps for p in GEMV_PARTS}
        gemv_s["all"] = sum(gemv_s.values())
        return InProcess(
            steps=steps,
            parts_ms={p.key: 1000 * seconds.get(p.key, 0.0) / steps for p in PARTS},
            timed_ms=1000 * self.clock.span / steps,
            untimed_ms=1000 * statistics.median(statistics.fmean(r) for r in self.untimed),
            untimed_median_ms=1000 * statistics.median(t for r in self.untimed for t in r),
            same_tokens=self.same,
            gemv_mib={k: n / 2**20 for k, n in nbytes.items()},
            gemv_gbs={k: n / gemv_s[k] / 1e9 if gemv_s[k] else 0.0 for k, n in nbytes.items()},
        )


def profile_in_process(core: EngineCore, prompt: list[int], opts: ProfileOptions) -> InProcess:
    """The in-process profile alone, over `opts.rounds` rounds."""
    profiler = StepProfiler(core, prompt, opts.new_tokens)
    for i in range(opts.rounds):
        profiler.round(i)
    return profiler.result()
