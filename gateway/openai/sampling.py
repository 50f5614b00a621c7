"""OpenAI sampling fields -> the engine's SamplingParams. Range checks live in SamplingParams.validate
(one rule for every caller); here only what the wire adds: defaults, spellings and unsupported options."""

from __future__ import annotations

from shared.engine_types import SamplingParams
from shared.errors import InvalidRequestError
from shared.protocol import SamplingFields

_INT64 = 2**63
_DEFAULTS = SamplingParams()


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    return out


def _stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's parameters for `req`; a field the client left out takes the engine's default."""
    if req.seed is not None and not -_INT64 <= req.seed < _INT64:
        raise InvalidRequestError("seed must fit in a signed 64-bit integer", param="seed")
    d = _DEFAULTS
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=d.temperature if req.temperature is None else req.temperature,
        top_p=d.top_p if req.top_p is None else req.top_p,
        top_k=d.top_k if req.top_k is None else req.top_k,
        min_p=d.min_p if req.min_p is None else req.min_p,
        repetition_penalty=d.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=d.presence_penalty if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=d.frequency_penalty if req.frequency_penalty is None else req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        seed=req.seed,
        stop=_stop(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        n=req.n,
    )
