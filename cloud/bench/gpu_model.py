"""The default model where it cannot be fetched: the GPU machine has no internet and takes at most
64 MiB with a command, and the default GGUF is 98 MB. So the GPU check carries a subset: the same
file with only its first layers (embeddings, tokenizer and chat template whole), written here with
the gguf package; and for throughput it rebuilds a full-depth model by cycling those layers, the
same shapes and cost per token as the real one (its logits mean nothing: throughput only).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf

from cloud.model.loading import LoadedModel


def write_model_subset(src: Path, dst: Path, layers: int) -> Path:
    """Copy a llama GGUF keeping its first `layers` blocks (quantized tensors copied as they are)."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    block_count = f"{arch}.block_count"
    total = int(reader.fields[block_count].contents())
    if not 1 <= layers <= total:
        raise ValueError(f"{src.name} has {total} layers; asked to keep {layers}")
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # written by the writer itself
        value = layers if field.name == block_count else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    return dst


def full_depth(loaded: LoadedModel, depth: int) -> LoadedModel:
    """The model with its layers repeated in turn up to `depth` layers (for throughput only)."""
    w = loaded.weights
    layers = [w.layers[i % len(w.layers)] for i in range(depth)]
    config = dataclasses.replace(w.config, num_layers=depth)
    weights = dataclasses.replace(w, config=config, layers=layers)
    return dataclasses.replace(loaded, weights=weights, name=f"{loaded.name} ({depth} layers cycled)")
