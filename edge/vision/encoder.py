"""The image encoder at run time: one onnxruntime session over EfficientNet-Lite0 (INT8 by default),
giving the top classes with probabilities and the 128-d int8 embedding of an image.

Sessions are safe to run from several threads at once; the gateway and the agent call `encode`
from worker threads, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnxruntime as ort
from PIL import Image

from shared.image_features import ImageLabel

from .model_files import VisionFiles
from .preprocess import to_input

Precision = Literal["int8", "fp32"]
TOP_K = 5


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
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # one image is small work: more threads mostly wait
        options.inter_op_num_threads = 1
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
