"""Benchmarks, for `jaxinfer bench` and the scripts in bench/: `harness` (timing, the
device's ceilings, roofline rows, the parts of kernel tables), `kernels` (kernel inputs,
`bench kernels`), `end_to_end` (`bench latency` / `throughput`, the decode workload of the
host-side scripts), `serve_load` (the HTTP load generator of `bench serve`) and `accuracy`
(perplexity and logit agreement, `bench/perplexity.py`). Weight counting is
`jaxinfer.loading.weights`."""
