"""The split-KV reduction against its PyTorch reference (under TRITON_INTERPRET=1 on the CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.triton.split_reduce import merge_splits, merge_splits_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_merge_equals_reference_with_empty_splits(splits: int) -> None:
    g = torch.Generator().manual_seed(splits)
    o = torch.randn(2, 3, splits, 64, generator=g)
    lse = torch.randn(2, 3, splits, generator=g) * 4
    lse[0, 0, 0] = -torch.inf  # a split that saw no key
    lse[1, 2, :] = -torch.inf  # a head whose whole context was empty: output 0
    o, lse = o.to(DEVICE), lse.to(DEVICE)
    out = merge_splits(o, lse, torch.empty(2, 3, 64, device=DEVICE))
    ref = merge_splits_reference(o, lse)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(out[1, 2]) == 0


def test_merge_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        merge_splits(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 4), torch.zeros(1, 2, 8))
