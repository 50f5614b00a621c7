"""The INT8 encoder gives the same answers on every x86 CPU our users run, not only on this one. On
a CPU without VNNI (AVX2 only, as many AMD EPYC hosts are) onnxruntime's U8S8 products can saturate,
which once turned the drawn crossword into "digital clock"; the encoder asks for exact products
there. This runs it on an emulated AVX2-only CPU (qemu's Haswell model; `.ci/run` installs
qemu-user) and holds its answers to fp32's and to this machine's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge.vision.encoder import ImageEncoder, dequantize_embedding
from edge.vision.model_files import VisionFiles
from gateway.bench.edge.pictures import crossword, photo, traffic_light

REPO = Path(__file__).resolve().parents[3]
HASWELL_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2"

# Runs in the emulated CPU. The decision the encoder makes there comes from the CPU's flags, which
# qemu-user does not put in /proc/cpuinfo (that file is the host's): they are handed over instead.
CHILD = """
import json, sys
from pathlib import Path
from edge.vision import encoder
from edge.vision.model_files import VisionFiles
from gateway.bench.edge.pictures import crossword, photo, traffic_light

flags = Path(sys.argv[2])
decide = encoder.int8_products_can_saturate
encoder.int8_products_can_saturate = lambda: decide("x86_64", flags)
files = VisionFiles(Path(sys.argv[1]))
out = {}
for precision in ("int8", "fp32"):
    enc = encoder.ImageEncoder(files, precision)
    pictures = {"traffic": traffic_light(), "crossword": crossword(), "photo": photo(640, 480, seed=3)}
    for name, img in pictures.items():
        e = enc.encode(img)
        out[f"{precision}/{name}"] = [e.labels[0].label, e.embedding.hex(), e.scale]
print(json.dumps(out))
"""


def _embedding(hexed: str, scale: float) -> np.ndarray:
    return dequantize_embedding(bytes.fromhex(hexed), scale)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def emulated(vision_files: VisionFiles, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.skip("qemu-user is not installed (apt-get install qemu-user; CI installs it)")
    flags = tmp_path_factory.mktemp("cpu") / "cpuinfo"
    flags.write_text(f"processor\t: 0\nflags\t\t: {HASWELL_FLAGS}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [qemu, "-cpu", "Haswell", sys.executable, "-c", CHILD, str(vision_files.root), str(flags)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,  # a hang guard only: the emulated run takes seconds
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, list] = json.loads(proc.stdout)
    return result


def test_an_avx2_only_cpu_keeps_the_fp32_answers(emulated: dict[str, list]) -> None:
    for name in ("traffic", "crossword", "photo"):
        label8, raw8, scale8 = emulated[f"int8/{name}"]
        label32, raw32, scale32 = emulated[f"fp32/{name}"]
        assert label8 == label32, name
        assert _cos(_embedding(raw8, scale8), _embedding(raw32, scale32)) > 0.9, name
    assert emulated["int8/crossword"][0] == "crossword puzzle"


def test_an_avx2_only_cpu_answers_as_this_one(emulated: dict[str, list], vision_files: VisionFiles) -> None:
    here = ImageEncoder(vision_files, "int8")
    for name, img in (
        ("traffic", traffic_light()),
        ("crossword", crossword()),
        ("photo", photo(640, 480, seed=3)),
    ):
        e = here.encode(img)
        label, raw, scale = emulated[f"int8/{name}"]
        assert label == e.labels[0].label, name
        assert _cos(_embedding(raw, scale), dequantize_embedding(e.embedding, e.scale)) > 0.99, name
