"""KV storage: the block pool and its event log, the per-request block manager, the caches (full
precision, int8/int4, fp8) and what a token costs in memory."""
