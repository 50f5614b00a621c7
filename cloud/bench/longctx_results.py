"""What crosses the process seam of the long-context benchmark: the parent's order to a worker, and
the lines the worker writes back (one per finished case, one per engine that could not be built,
one at the end). Every line is one JSON object tagged by `type`; the same case records go into the
report unchanged, with the parent's agreement fields filled in.
"""

from __future__ import annotations

import msgspec

from cloud.engine.attention.sparse_probe import LayerTrace
from cloud.engine.config import DType
from cloud.model.formats import WeightQuant

from .longctx_configs import Grid
from .longctx_data import Task


class WorkerSpec(msgspec.Struct, kw_only=True, frozen=True):
    config: str  # a name in CONFIGS
    tasks: tuple[Task, ...]
    lengths: tuple[int, ...]
    depths: tuple[int, ...]
    samples: int
    native_context: int
    yarn_factor: float
    seed: int
    max_tokens: int
    model: str | None
    dtype: DType
    weight_quant: WeightQuant
    device: str = "auto"
    probe: bool = False  # follow the needle through sparse selection (sparse_probe.py)
    heads: str | None = None  # the retrieval-head calibration file (made here where missing)

    def grid(self) -> Grid:
        return Grid(
            self.tasks, self.lengths, self.depths, self.samples, self.native_context, self.yarn_factor
        )


class CaseResult(msgspec.Struct, kw_only=True, tag="case"):
    config: str
    task: Task
    length: int  # the case's total tokens (prompt + answer)
    depth: int  # requested, percent
    sample: int
    prompt_tokens: int = 0
    prompt_crc: int = 0  # CRC-32 of the prompt ids: configurations compare like with like
    needle_depth: float | None = None  # measured, 0 .. 1
    key: str = ""
    subject: str | None = None
    max_model_len: int = 0
    rope_scaling: dict[str, float | str] | None = None
    answer: str = ""  # the generated text up to the first end-of-sequence token
    # the answer's gist, compared between configurations (longctx_data.answer_gist): the first number
    # for single-key tasks, every number for multivalue, the words for vartrack, cwe and nolima
    number: str | None = None
    score: float | None = None  # the share of the expected items the answer holds
    correct: bool = False  # it holds them all
    prefill_s: float | None = None  # submission to first token
    prefill_attention_s: float | None = None  # of which inside the attention backend
    decode_tokens: int = 0  # tokens after the first (decode steps), end-of-sequence ignored
    decode_ms_per_token: float | None = None
    decode_attention_ms_per_token: float | None = None
    kv_bytes_per_token: float | None = None
    kv_peak_mib: float | None = None  # the KV cache's most blocks in use during the case, in MiB
    error: str | None = None
    # with --probe, a sparse configuration's view of the needle per sparse layer (sparse_probe.py)
    trace: list[LayerTrace] | None = None
    # filled by the parent, against the reference configuration's record of the same case
    agrees_text: bool | None = None
    agrees_number: bool | None = None

    @property
    def cell(self) -> tuple[str, int, int, int]:
        return (self.task, self.length, self.depth, self.sample)


class EngineInfo(msgspec.Struct, kw_only=True):
    max_model_len: int
    rope_scaling: dict[str, float | str] | None
    lengths: tuple[int, ...]
    kv_cache_memory_gib: float
    kv_bytes_per_token: float
    block_size: int
    weights: str  # the weight plan, as the engine describes it
    init_s: float


class GroupFailed(msgspec.Struct, kw_only=True, tag="failed"):
    """An engine that could not be built: its cases did not run."""

    config: str
    max_model_len: int
    rope_scaling: dict[str, float | str] | None
    cases: int
    error: str


class WorkerDone(msgspec.Struct, kw_only=True, tag="done"):
    config: str
    model: str
    native_context: int  # the model's own trained context, as its file states it
    torch_threads: int
    peak_rss_mib: float  # the worker's high-water mark (ru_maxrss): model, engines, cases
    engines: list[EngineInfo]


WorkerLine = CaseResult | GroupFailed | WorkerDone
