"""The image encoder at run time: one onnxruntime session over EfficientNet-Lite0 (INT8 by default),
giving the top classes with probabilities and the 128-d int8 embedding of an image.

Sessions are safe to run from several threads at once; the gateway and the agent call `encode`
from worker threads, never on the event loop.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from shared.image_features import ImageLabel

from .model_files import VisionFiles
from .preprocess import to_input

Precision = Literal["int8", "fp32"]
TOP_K = 5
# x86 CPUs without VNNI (AVX2, AVX-512F) run onnxruntime's U8S8 products with vpmaddubsw, whose int16
# pair sums saturate (255 * 127 * 2 > 32767): the same INT8 file then answers differently by CPU (the
# drawn crossword came out "digital clock"). This option makes onnxruntime take the exact U8U8 path.
# VNNI CPUs compute U8S8 exactly, and there the option would only slow INT8 below fp32 (5.2 ms against
# 2.4 ms; the answers are bit-identical), so it is set only where products can saturate. Either way
# the INT8 answers depend on the file alone, not on the CPU.
_EXACT_INT8_ON_X86 = "session.x64quantprecision"
_X86 = ("x86_64", "amd64", "i386", "i686", "x86")


def int8_products_can_saturate(machine: str | None = None, cpuinfo: Path | None = None) -> bool:
    """True on an x86 CPU without VNNI, or an x86 one whose flags cannot be read (the safe side)."""
    if (machine or platform.machine()).lower() not in _X86:
        return False  # Arm's dot-product kernels accumulate in int32
    try:
        flags = (cpuinfo or Path("/proc/cpuinfo")).read_text()
    except OSError:
        return True
    return not any(f in flags.split() for f in ("avx512_vnni", "avx_vnni", "avx512vnni"))


@dataclass(frozen=True, slots=True)
class Encoded:
    labels: list[ImageLabel]
    embedding: bytes  # 128 int8 values
    scale: float  # embedding * scale: the projected feature


def quantize_embedding(e: np.ndarray) -> tuple[bytes, float]:
    """Symmetric int8 with one scale: the largest magnitude maps to 127."""
    peak = float(np.abs(e).max())
    scale = peak / 127.0 if peak > 0 else 1.0
    q = np.clip(np.rint(e / scale), -127, 127).astype(np.int8)
    return q.tobytes(), scale


def dequantize_embedding(data: bytes, scale: float) -> np.ndarray:
    return np.frombuffer(data, np.int8).astype(np.float32) * scale


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class ImageEncoder:
    def __init__(self, files: VisionFiles, precision: Precision = "int8", threads: int = 1) -> None:
        import onnxruntime as ort  # ~30 MiB mapped: loaded with the first image, not by every router

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # one image is small work: more threads mostly wait
        options.inter_op_num_threads = 1
        if precision == "int8" and int8_products_can_saturate():
            options.add_session_config_entry(_EXACT_INT8_ON_X86, "1")
        path = files.int8 if precision == "int8" else files.fp32
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._projection = np.load(files.projection)  # [1280, 128]
        self._labels = files.labels.read_text().splitlines()
        self.precision = precision
        self.space = f"{files.projection_id()}/{precision}"

    def encode(self, rgb: Image.Image) -> Encoded:
        logits, pooled = self._session.run(None, {"image": to_input(rgb)})  # [1, 1000], [1, 1280]
        probs = _softmax(logits[0].astype(np.float64))
        top = np.argsort(probs)[::-1][:TOP_K]
        labels = [ImageLabel(label=self._labels[i], prob=round(float(probs[i]), 4)) for i in top]
        embedding, scale = quantize_embedding(pooled[0] @ self._projection)  # [128]
        return Encoded(labels, embedding, scale)
