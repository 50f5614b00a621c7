"""The serving engine: requests, block pool, scheduler, model runner, sampler and the engine loop."""
