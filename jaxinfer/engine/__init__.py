"""The engine: scheduler (no JAX), engine (request life cycle), model runner (the jitted
step), KV page pool, sampling, and the multi-host step broadcast."""
