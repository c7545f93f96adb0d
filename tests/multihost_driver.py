"""One process of the two-process test (tests/test_sharding.py): joins the job, loads the
model onto a mesh spanning both processes, and prints one JSON line: process 0 the greedy
tokens it generated (and whether its engine overlapped its steps), process 1 the tokens of
every step it ran as a follower."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

from jaxinfer.engine import multihost  # noqa: E402

path, mesh, coordinator, process_id, prompt, max_tokens = sys.argv[1:]
multihost.initialize(coordinator, 2, int(process_id))

from jaxinfer import LLM, SamplingParams  # noqa: E402

llm = LLM(path, dtype="float32", mesh=mesh, kv_cache_bytes=1 << 22)
if multihost.is_leader():
    params = SamplingParams(max_tokens=int(max_tokens), ignore_eos=True, temperature=0)
    out = llm.generate([json.loads(prompt)], params)
    print(json.dumps({"tokens": out[0].token_ids, "overlap": llm.engine.overlap}), flush=True)
else:
    steps = llm.follow()
    print(json.dumps({"tokens": [int(t) for s in steps for t in s[0] if t >= 0]}),  # row 0
          flush=True)
