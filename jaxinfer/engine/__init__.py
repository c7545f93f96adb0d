"""The engine. Host side, no JAX: `request` (SamplingParams, Request, RequestDelta),
`scheduler` (admission, KV page reservation, preemption, chunking; over `kv_pages`' pool),
`output` (stops, detokenisation, logprobs). `engine` ties them to `runner` (the jitted step;
`sampling` is its sampler) for one replica or several; `multihost` broadcasts each step to
the other processes of a multi-host job. `defaults` holds the engine's default sizes,
`memory_profile` measures what a step needs on a device (for the KV cache's plan)."""
