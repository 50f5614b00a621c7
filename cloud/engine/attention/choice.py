"""Which attention backend an engine runs (`--attention`, `--attention-kernels`, the device): the
PyTorch references (dense or sparse), wrapped by the Triton kernels on a GPU or the compiled C++
kernels on a CPU."""

from __future__ import annotations

import os

import torch

from cloud.engine.attention.cpu import CpuKernelAttention
from cloud.engine.attention.dense import AttentionBackend, DenseAttention
from cloud.engine.attention.retrieval_heads import HeadCalibration, calibration_path
from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.config import EngineConfig
from cloud.model.config import ModelConfig
from cloud.model.rope import RotaryEmbedding
from kernels.cpu.paged_attention import available as cpu_kernels_available
from shared.errors import InvalidRequestError


def use_triton(kernels: str, device: torch.device) -> bool:
    """Whether attention runs the Triton kernels: on a GPU by default; on a CPU only when asked and
    under the interpreter (slow: for tests)."""
    if kernels in ("torch", "cpu") or (kernels == "auto" and device.type != "cuda"):
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidRequestError(
            "--attention-kernels triton needs a CUDA GPU (or TRITON_INTERPRET=1 on a CPU, for tests)"
        )
    return True


def make_attention(
    config: EngineConfig,
    model: ModelConfig,
    rope: RotaryEmbedding,
    block_size: int,
    device: torch.device,
    model_name: str = "",
) -> AttentionBackend:
    """`model_name`: the registered name, for the retrieval-head calibration shipped with it."""
    dense = DenseAttention(model.num_heads, model.num_kv_heads, model.head_dim, rope)
    backend: DenseAttention | SparseAttention = dense
    if config.attention == "sparse":
        dense_heads = None
        if (path := calibration_path(config.sparse.retrieval_heads, model_name)) is not None:
            cal = HeadCalibration.load(path, model.num_layers, model.num_heads, model.num_kv_heads)
            dense_heads = cal.dense_kv_heads(config.sparse.retrieval_threshold).to(device)
        backend = SparseAttention(dense, config.sparse, block_size, dense_heads)
    kernels = config.attention_kernels
    if use_triton(kernels, device):
        from cloud.engine.attention.gpu import TritonAttention  # defines kernels: only where they can run

        return TritonAttention(backend)
    if device.type == "cpu" and kernels in ("auto", "cpu") and cpu_kernels_available():
        return CpuKernelAttention(backend)
    if kernels == "cpu":
        raise InvalidRequestError("--attention-kernels cpu: the C++ kernels could not be built here")
    return backend
