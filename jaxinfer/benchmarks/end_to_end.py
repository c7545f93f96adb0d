"""Engine-level benchmarks: `jaxinfer bench latency` and `bench throughput`, and the decode
workload the host-side scripts in bench/ share (`decoding_llm`).

Model steps are timed on the host clock (what a user waits for). Each report has roofline
rows against the ceilings the caller measured: a step's bytes are the weights it reads
(`jaxinfer.loading.weights`: every parameter once, the MoE experts its tokens hit, one input
embedding row per token) plus the K/V it reads; its FLOPs are 2 per weight a token multiplies
plus attention's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.benchmarks.harness import Ceilings, gc_pauses, roofline
from jaxinfer.engine.engine import heap_frozen
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.loading.weights import active_weight_count, step_reads, weight_bytes
from jaxinfer.sharding import MeshSpec


def bench_latency(llm, input_len: int, output_len: int, batch: int, ceilings: Ceilings,
                  seed: int = 0, repeats: int = 3) -> tuple[dict, list[dict]]:
    """Time to first token and per-token decode time for `batch` prompts of input_len tokens:
    the medians of `repeats` timed runs (one run of 128 tokens varies by ~5% at batch-1
    decode on an H200)."""
    if repeats < 1:
        raise ValueError(f"repeats {repeats}: at least 1 timed run required")
    c = llm.config
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    def run():
        """Returns (seconds until every request has its first token, seconds per token after
        that: the decode phase's time over its tokens per sequence, so a multi-step decode
        counts every token it produced)."""
        for _ in range(batch):
            llm.engine.add_request(rng.integers(2, c.vocab_size, input_len).tolist(), params)
        start, waiting_first, ttft = time.perf_counter(), batch, None
        while llm.engine.has_unfinished():
            deltas = llm.engine.step()  # returns after the sampled ids reach the host
            waiting_first -= sum(d.request.num_output == len(d.token_ids) for d in deltas)
            if ttft is None and waiting_first == 0:
                ttft = time.perf_counter() - start
        decode = time.perf_counter() - start - ttft
        return ttft, decode / max(output_len - 1, 1)

    run()  # compile every bucket this shape touches
    for runner in llm.engine.runners:  # and wait for those compiling in the background
        runner.steps.compile_many(runner.steps.shapes())
    runs = [run() for _ in range(repeats)]
    ttft, itl = (statistics.median(x) for x in zip(*runs, strict=True))
    w_bytes = step_reads(llm.model).step_bytes(batch)  # a decode step of `batch` tokens
    kv_token = c.kv_bytes_per_token(kv_itemsize(llm))
    mid_ctx = input_len + output_len // 2
    step_bytes = w_bytes + batch * mid_ctx * kv_token
    attn_flops = 4 * batch * mid_ctx * c.num_heads * c.head_dim * c.num_layers
    step_flops = 2 * active_weight_count(llm.model) * batch + attn_flops
    summary = {"batch": batch, "input_len": input_len, "output_len": output_len,
               "ttft_ms": ttft * 1e3, "itl_ms": itl * 1e3, "tokens_per_s": batch / itl,
               "itl_ms_runs": [r[1] * 1e3 for r in runs],
               "weight_bytes": weight_bytes(llm.model), "step_weight_bytes": w_bytes}
    devices = llm.runner.mesh.size  # a sharded model streams from all its devices at once
    summary["devices"] = devices
    rows = [roofline(f"decode step B={batch} (ctx ~{mid_ctx}, {devices} device"
                     f"{'s' if devices > 1 else ''})", itl, step_bytes, step_flops,
                     ceilings.times(devices))]
    return summary, rows


def kv_itemsize(llm) -> int:
    """Bytes of one K or V element in llm's cache pages (1 with an fp8 cache)."""
    return llm.runner.kv_avals[0][0].dtype.itemsize


def bench_throughput(llm, num_requests: int, input_len: int, output_len: int,
                     ceilings: Ceilings, seed: int = 0, temperature: float = 0.0,
                     top_p: float = 1.0) -> tuple[dict, list[dict]]:
    """Offline: num_requests prompts, lengths uniform in [input_len/2, input_len], all at once;
    greedy unless temperature > 0 (vLLM's throughput benchmark samples at temperature 1).

    Each engine step is timed and given its own floor, the slower of its FLOPs (2 x active
    weights per token run, plus attention) at the matmul rate and its bytes (the weights
    once per device iteration and dp replica, one input embedding row per token run, every
    live token's K/V once per iteration) at the copy bandwidth; a run's floor is the sum of
    its steps' floors. Three rows: the whole run (prefill included); its decode-only steps
    (every request of the step decoding; requests may wait for a sequence slot meanwhile),
    the batch's decode roofline; and the steps that ran a prompt chunk (with the decodes
    beside it), so that the run's time splits between the two kinds of step."""
    rng = np.random.default_rng(seed)
    c, engine = llm.config, llm.engine
    lens = rng.integers(max(input_len // 2, 1), input_len + 1, num_requests)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=output_len,
                            ignore_eos=True)
    kv_token = c.kv_bytes_per_token(kv_itemsize(llm))
    reads = step_reads(llm.model)
    # Read once per device iteration (MoE: ~the experts a step of every request hits) ...
    w_bytes = reads.streamed_bytes(num_requests)
    row_bytes = reads.embedding_row_bytes  # ... and one embedding row per token run
    flops_token = 2 * active_weight_count(llm.model)
    head_flops = 2 * c.vocab_size * c.hidden_size  # logits: one row per sequence and step
    attn_flops = 4 * c.num_heads * c.head_dim * c.num_layers  # per (query, key) pair
    # Data parallel: every replica reads its own weights, on its own devices.
    replicas = len(engine.runners)
    devices = llm.runner.mesh.size * replicas
    cd = ceilings.times(devices)

    def run(prompts) -> dict:
        start = time.perf_counter()
        for p in prompts:
            engine.add_request(p, params)
        # totals over all steps ("all"), the decode-only ones ("decode") and the others
        # ("prompt": a prompt chunk ran)
        tot = {k: dict(seconds=0.0, bytes=0.0, flops=0.0, floor=0.0, steps=0, tokens=0,
                       queries=0) for k in ("all", "decode", "prompt")}
        # Each step's batch and what it left, kept for the accounting after the run: done
        # between the steps it would hold up the next one's planning, a host cost the
        # engine alone does not have.
        steps = []
        while engine.has_unfinished():
            t = time.perf_counter()
            deltas = engine.step()
            seconds = time.perf_counter() - t
            batch = engine.last_batch
            steps.append((seconds, batch, [r.num_cached for r, _ in batch],
                          {d.request: len(d.token_ids) for d in deltas}))
        wall = time.perf_counter() - start
        for seconds, batch, num_cached_after, produced in steps:
            iterations, kv_tokens, flops, queries = 1, 0.0, 0.0, 0
            # A decode-only step runs one token of every request in it, each sampled (also
            # while others wait for a sequence slot: such a step runs no prompt either).
            decode_only = bool(batch) and all(
                len(chunk.new_tokens) == 1 and r in produced for r, chunk in batch)
            for (r, chunk), after in zip(batch, num_cached_after, strict=True):
                # what ran, admitted this step or before
                cached = chunk.num_cached
                n = after - cached  # queries run: a chunk's tokens, or decode iterations
                if len(chunk.new_tokens) == 1 and r in produced:  # decoding, n iterations
                    iterations = max(iterations, n)
                    kv_read = n * cached + n * (n + 1) / 2  # contexts cached + 1 .. cached + n
                    attn_pairs, logits_rows = kv_read, n
                else:  # a prefill chunk: its keys read once, causal pairs ~n x (cached + n/2)
                    kv_read = cached + n
                    attn_pairs, logits_rows = n * (cached + n / 2), 1
                kv_tokens += kv_read
                queries += n
                flops += ((flops_token - head_flops) * n + head_flops * logits_rows
                          + attn_flops * attn_pairs)
            kv_bytes = kv_tokens * kv_token
            step_bytes = iterations * w_bytes * replicas + queries * row_bytes + kv_bytes
            floor = max(step_bytes / cd.copy_bytes_per_s, flops / cd.matmul_flops_per_s)
            for key in ("all", "decode" if decode_only else "prompt"):
                k = tot[key]
                k["seconds"] += seconds
                k["bytes"] += step_bytes
                k["flops"] += flops
                k["floor"] += floor
                k["steps"] += 1
                k["tokens"] += sum(produced.values())
                k["queries"] += queries
        tot["all"]["seconds"] = wall  # the wall time, not only the steps'
        return tot

    # A first pass with other prompts of the same lengths compiles every step shape the
    # workload touches; the same prompts again would hit the prefix cache and skip prefill.
    run([rng.integers(2, c.vocab_size, n).tolist() for n in lens])
    with gc_pauses() as pauses, heap_frozen():  # as LLM.generate and the server run
        tot = run([rng.integers(2, c.vocab_size, n).tolist() for n in lens])
    a, d, p = tot["all"], tot["decode"], tot["prompt"]
    summary = {"num_requests": num_requests, "input_len": input_len, "output_len": output_len,
               "temperature": temperature, "top_p": top_p, "page_size": llm.runner.page_size,
               "seconds": a["seconds"], "steps": a["steps"], "output_tokens": a["tokens"],
               "decode_tokens": d["tokens"], "prompt_tokens": int(sum(lens)),
               "tokens_run": a["queries"],
               "output_tokens_per_s": a["tokens"] / a["seconds"],
               "requests_per_s": num_requests / a["seconds"], "devices": devices,
               "floor_seconds": a["floor"], "decode_steps_run": d["steps"],
               "decode_tokens_per_s": d["tokens"] / d["seconds"] if d["steps"] else 0.0,
               "decode_roofline_tokens_per_s": d["tokens"] / d["floor"] if d["steps"] else 0.0,
               "decode_steps_seconds": d["seconds"], "prompt_steps_run": p["steps"],
               "prompt_steps_seconds": p["seconds"], "prompt_steps_floor_seconds": p["floor"],
               # the host's garbage collections in the timed pass: count and seconds
               "gc_collections": sum(n for n, _ in pauses.values()),
               "gc_full_collections": pauses[2][0], "gc_seconds": sum(
                   t for _, t in pauses.values())}
    rows = [roofline(f"whole run ({a['steps']} steps, {a['tokens']} output tokens, {devices} "
                     f"device{'s' if devices > 1 else ''})", a["seconds"], a["bytes"],
                     a["flops"], cd, floor=a["floor"])]
    if d["steps"]:
        rows.append(roofline(f"decode-only steps ({d['steps']}, {d['tokens']} tokens)",
                             d["seconds"], d["bytes"], d["flops"], cd, floor=d["floor"]))
    if p["steps"]:
        rows.append(roofline(f"steps with a prompt chunk ({p['steps']}, {p['queries']} tokens "
                             "run)", p["seconds"], p["bytes"], p["flops"], cd, floor=p["floor"]))
    return summary, rows


# --- the decode workload of the host-side scripts ------------------------------------------


def decoding_llm(preset: str, batch: int, ctx: int, decode_steps: int, steps: int,
                 mesh_spec: str | None, min_kv_bytes: int = 8 << 30, page_size: int = 16,
                 quantize: str | None = None, extra_seqs: int = 0):
    """(LLM, mesh) with `batch` requests of `ctx` prompt tokens prefilled and decoding (decode
    shapes compiled), with room for 8 measurements of `steps` engine steps. The KV pool holds
    every sequence's whole length, and at least `min_kv_bytes`. `quantize`: the preset's
    projections quantized to this format. `extra_seqs`: sequence slots beyond the batch, for
    prompts that arrive while it decodes."""
    config = preset_config(preset)
    max_len = ctx + 8 * steps * decode_steps + 64
    mesh = MeshSpec.parse(mesh_spec).meshes()[0]
    # Pages for every sequence's whole length: a smaller pool would preempt and recompute.
    kv_bytes = batch * max_len * config.kv_bytes_per_token(2)  # bf16
    llm = LLM(random_model(config, jnp.bfloat16, mesh=mesh, quantize=quantize),
              kv_cache_bytes=max(min_kv_bytes, int(1.1 * kv_bytes)),
              max_model_len=max_len, max_num_seqs=batch + extra_seqs, decode_steps=decode_steps,
              mesh=mesh_spec, page_size=page_size)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_len - ctx - 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request([2 + (i + j) % min(1000, config.vocab_size - 2)
                            for j in range(ctx)], params)
    while any(r.num_output == 0 for r in list(engine.running) + list(engine.waiting)):
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # compile the decode shapes
    return llm, mesh


def workload_parser(steps: int, steps_help: str, description: str | None = None
                    ) -> argparse.ArgumentParser:
    """The command-line options of `decoding_llm`'s workload (and --json)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--mesh", default=None, help="e.g. tp=2: kernel time is per device")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--quantize", default=None, help="projections quantized: int8, int4:g128...")
    ap.add_argument("--json", default=None)
    return ap
