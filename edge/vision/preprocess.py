"""An RGB image as the encoder's input: the shorter side resized to 224 px, the centre 224x224 kept,
scaled to [0, 1] and normalized with ImageNet's mean and std (the preprocessing the EfficientNet-Lite
PyTorch port documents; on our checks it gave the more confident, more sensible labels of the two
conventions, the other being TF-Lite's (x - 127) / 128)."""

from __future__ import annotations

import numpy as np
from PIL import Image

INPUT_SIZE = 224
_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
_STD = np.array([0.229, 0.224, 0.225], np.float32)


def to_input(rgb: Image.Image) -> np.ndarray:
    """[1, 3, 224, 224] float32."""
    w, h = rgb.size
    scale = INPUT_SIZE / min(w, h)
    nw, nh = max(INPUT_SIZE, round(w * scale)), max(INPUT_SIZE, round(h * scale))
    # reducing_gap: a large image is first shrunk by an integer factor, a big saving on megapixel photos
    img = rgb.convert("RGB").resize((nw, nh), Image.Resampling.BILINEAR, reducing_gap=3.0)
    left, top = (nw - INPUT_SIZE) // 2, (nh - INPUT_SIZE) // 2
    img = img.crop((left, top, left + INPUT_SIZE, top + INPUT_SIZE))
    x = (np.asarray(img, np.float32) / 255.0 - _MEAN) / _STD  # [224, 224, 3]
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])
