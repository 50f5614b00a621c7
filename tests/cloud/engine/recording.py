"""The real sampler, keeping every logits row it is given: engine tests compare them to a reference."""

from __future__ import annotations

import torch

from cloud.engine.sampling.sampler import Sampler, SamplingBatch
from shared.engine_types import SampleResult


class RecordingSampler(Sampler):
    """The real sampler, recording the logits row it was given for each request at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.logits: dict[str, list[torch.Tensor]] = {}

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampleResult]:
        for row, req in enumerate(batch.rows):
            self.logits.setdefault(req.request_id, []).append(logits[row].clone())
        return super().__call__(logits, batch)
