"""The benchmark harness (timing, ceilings, rooflines) that `jaxinfer bench` and the
scripts in bench/ use, and the serving load generator."""
