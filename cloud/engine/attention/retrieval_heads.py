"""Retrieval heads (DuoAttention's split, Xiao et al. 2024): the few attention heads that fetch a fact
from far back in the context stay dense under sparse attention; the others keep Quest's selection
(sinks, the top blocks, the window).

Which heads retrieve is measured offline, once per model: a calibration run (`ctxfuse bench longctx
--calibrate-heads FILE`) answers synthetic needle questions with dense attention and records, per
layer and query head, the attention mass that the answer's queries put on the needle's tokens
(`NeedleMass`). A KV head is kept dense when any query head of its group averages at least
`threshold` there (`HeadCalibration.dense_kv_heads`); the engine reads the file with
`--sparse-retrieval-heads FILE`. DuoAttention finds such heads by optimising a gate per head over
synthetic passkeys; the attention mass on the needle is the simpler signal its authors compare
against (their "retrieval heads" baseline, after Wu et al. 2024).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from cloud.engine.attention.dense import AttentionMetadata, context
from shared.errors import InvalidRequestError

# calibrations made for the registered models, by name (`ctxfuse bench longctx`'s, seed and cases in
# longctx_calibrate.py)
SHIPPED = Path(__file__).resolve().parents[2] / "model" / "heads"


def calibration_path(setting: str | None, model_name: str) -> Path | None:
    """The calibration file a `retrieval_heads` setting names: "auto" -> the one shipped for
    `model_name` if any (a calibration of other weights of that name is refused at load by its
    shape), None or "none" -> none, else the path given."""
    if setting is None or setting == "none":
        return None
    if setting == "auto":
        # a registered name ("smollm2-135m-instruct") or a file's stem ("SmolLM2-135M-Instruct.Q4_1"):
        # the same weights whatever their quantization
        shipped = SHIPPED / f"{model_name.lower().split('.')[0]}.json"
        return shipped if shipped.is_file() else None
    return Path(setting)


class HeadCalibration(msgspec.Struct, kw_only=True):
    model: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    cases: int  # needle questions the means are over
    queries: int  # answer queries measured in all (the prompt's last, then each decode step's)
    mass: list[list[float]]  # [layer][query head]: mean dense attention mass on the needle

    def dense_kv_heads(self, threshold: float) -> torch.Tensor:
        """[layers, kv_heads] bool: the KV heads with a query head at or above `threshold`."""
        m = torch.tensor(self.mass).view(self.num_layers, self.num_kv_heads, -1)
        return (m >= threshold).any(-1)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=1))

    @classmethod
    def load(cls, path: str | Path, layers: int, heads: int, kv_heads: int) -> HeadCalibration:
        """The file at `path`, refused with the reason when it is missing, unreadable or of
        another model's shape."""
        try:
            cal = msgspec.json.decode(Path(path).read_bytes(), type=cls)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidRequestError(
                f"--sparse-retrieval-heads {path}: not a head calibration ({exc})"
            ) from None
        shape = (cal.num_layers, cal.num_heads, cal.num_kv_heads)
        rows_ok = len(cal.mass) == cal.num_layers and all(len(r) == cal.num_heads for r in cal.mass)
        if shape != (layers, heads, kv_heads) or not rows_ok:
            raise InvalidRequestError(
                f"--sparse-retrieval-heads {path}: calibrated for {shape[0]} layers x {shape[1]} heads "
                f"({shape[2]} KV heads), this model has {layers} x {heads} ({kv_heads})"
            )
        return cal


class NeedleMass:
    """An attention backend wrapper that measures, for the request it follows, each query head's
    dense attention mass on the needle at the answer's queries: the prompt's last query (the first
    answer token) and every decode step's. The backend's output is returned untouched."""

    def __init__(self, inner: Callable[..., torch.Tensor], num_layers: int, num_heads: int) -> None:
        self.inner = inner
        self.total = torch.zeros(num_layers, num_heads, dtype=torch.float64)
        self.counts = torch.zeros(num_layers, dtype=torch.int64)
        self.needle = (0, 0)
        self.prompt_len = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def follow(self, needle: tuple[int, int], prompt_len: int) -> None:
        self.needle, self.prompt_len = needle, prompt_len

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: Any,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        out = self.inner(layer, q, k, v, cache, meta)
        keys: torch.Tensor | None = None
        query: torch.Tensor | None = None
        if meta.num_decode and meta.decode_blocks is not None and meta.decode_lens is not None:
            kc, _ = context(cache, layer, meta.decode_blocks[0], 0, int(meta.decode_lens[0]))
            keys, query = kc[0], q[0]
        else:
            last = [s for s in meta.prefills if s.start_pos + s.q_len == self.prompt_len]
            if last:
                seq = last[0]
                kc, _ = context(cache, layer, seq.block_table, 0, seq.start_pos)
                own = k[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1).to(kc.dtype)
                keys, query = torch.cat([kc[0], own], dim=1), q[seq.q_start + seq.q_len - 1]
        if keys is not None and query is not None:
            self._add(layer, query, keys)
        return out

    def _add(self, layer: int, query: torch.Tensor, keys: torch.Tensor) -> None:
        """query [heads, d]; keys [kv_heads, n, d]."""
        kvh, n, d = keys.shape
        qg = query.float().view(kvh, -1, d)
        probs = torch.softmax((qg @ keys.float().transpose(-1, -2)) * d**-0.5, dim=-1)  # [kvh, g, n]
        s, e = self.needle[0], min(self.needle[1], n)
        self.total[layer] += probs[..., s:e].sum(-1).reshape(-1).double()
        self.counts[layer] += 1

    def calibration(self, model: str, num_kv_heads: int, cases: int) -> HeadCalibration:
        means = self.total / self.counts.clamp(min=1).unsqueeze(1)
        return HeadCalibration(
            model=model,
            num_layers=self.total.shape[0],
            num_heads=self.total.shape[1],
            num_kv_heads=num_kv_heads,
            cases=cases,
            queries=int(self.counts.max()),
            mass=[[round(float(x), 5) for x in row] for row in means],
        )
