"""The KV tiers an engine asks for (--kv-host-memory, --kv-offload-dir, --kv-offload-dtype), checked
and hooked to its block pool and prefix lookup; kept out of the engine core, which only calls
`make_tiers`."""

from __future__ import annotations

import os
from pathlib import Path

from cloud.engine.config import EngineConfig
from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.fp8_cache import Fp8KVCache
from cloud.engine.kv.manager import KVManager
from cloud.engine.kv.memory import KVPlan
from cloud.engine.kv.quant import BITS
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from cloud.engine.kv.tiers.codec import ColdCodec
from cloud.engine.kv.tiers.offload import KVTiers, model_identity, tier_namespace
from cloud.engine.kv.tiers.records import BlockRecords
from cloud.model.config import ModelConfig
from shared.errors import InvalidRequestError
from shared.fleet_protocol import HASH_SCHEME


def make_tiers(
    config: EngineConfig,
    plan: KVPlan,
    model: ModelConfig,
    weights: str,
    model_path: Path,
    cache: KVCache | QuantizedKVCache,
    pool: BlockPool,
    kv: KVManager,
) -> KVTiers | None:
    """The tiers below the pool, hooked to it and to the prefix lookup; None when neither tier is
    asked for. weights: the weight plan as described (part of the disk tier's namespace)."""
    host = int(config.kv_host_memory_gib * 2**30)
    if host <= 0 and config.kv_offload_dir is None:
        return None
    if config.kv_host_memory_gib < 0 or config.kv_offload_disk_gib <= 0:
        raise InvalidRequestError("--kv-host-memory must be >= 0 and --kv-offload-disk > 0")
    if not config.enable_prefix_caching:
        raise InvalidRequestError("KV tiers keep prefix-cache blocks: they need prefix caching on")
    records = BlockRecords(cache.block_parts())
    codec = cold_codec(config, plan, model, cache)
    namespace = tier_namespace(
        config.kv_offload_dtype,
        model_identity(model_path),
        model,
        config.run_dtype,
        weights,
        plan.kv_dtype,
        plan.block_size,
        records.layout(),
        HASH_SCHEME,
    )
    disk_dir = None if config.kv_offload_dir is None else writable_dir(Path(config.kv_offload_dir))
    tiers = KVTiers(
        records, max(host, 0), disk_dir, int(config.kv_offload_disk_gib * 2**30), namespace, pool, codec
    )
    pool.tiers = tiers
    kv.tiers = tiers
    return tiers


def writable_dir(path: Path) -> Path:
    """The disk tier's directory, made and probed; refused with the reason when it cannot be written."""
    path = path.expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InvalidRequestError(
            f"--kv-offload-dir {path} cannot be written ({exc.strerror or exc}): "
            "give a directory this user can write"
        ) from None
    return path


def cold_codec(
    config: EngineConfig, plan: KVPlan, model: ModelConfig, cache: KVCache | QuantizedKVCache
) -> ColdCodec | None:
    """The disk tier's lower precision (--kv-offload-dtype), for a full-precision cache only."""
    cold = config.kv_offload_dtype
    if cold == "auto":
        return None
    if not isinstance(cache, KVCache) or isinstance(cache, Fp8KVCache):
        raise InvalidRequestError(
            f"--kv-offload-dtype {cold} quantizes a full-precision cache's blocks; this cache is "
            f"{plan.kv_dtype} already (its disk tier stores its own bytes: leave it auto)"
        )
    c = model
    tail = 0 if cache.summaries is None else cache.summaries.block_bytes
    return ColdCodec(c.num_layers, c.num_kv_heads, plan.block_size, c.head_dim, cache.dtype, BITS[cold], tail)
