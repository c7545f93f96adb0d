"""Benchmarks: device ceilings, kernels against them, end-to-end latency and throughput.

Kernel times are device-side on GPUs (CUPTI through `jax.experimental.mosaic.gpu.profiler`,
kernel time only) and host-side elsewhere; model steps are wall-clock (what a user waits
for). Every figure is a median; every run measures its own ceilings, and each result is
printed with a roofline line: bytes and FLOPs per step and the % of each ceiling reached.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.ops.attention import AttentionMetadata, ragged_paged_attention
from jaxinfer.ops.linear import linear


@dataclasses.dataclass
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    matmul_flops_per_s: float  # bf16 matmul through XLA

    def line(self) -> str:
        return (f"ceilings: copy {self.copy_bytes_per_s / 1e9:.1f} GB/s, "
                f"bf16 matmul {self.matmul_flops_per_s / 1e12:.2f} TFLOP/s")

    def times(self, devices: int) -> Ceilings:
        """The ceilings of `devices` such devices working together (a sharded model)."""
        return Ceilings(self.copy_bytes_per_s * devices, self.matmul_flops_per_s * devices)


def median_seconds(fn, *args, iters: int = 20, warmup: int = 3) -> float:
    """Median time of fn(*args): device kernel time on GPU, host time with a sync elsewhere."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if jax.default_backend() == "gpu":
        from jax.experimental.mosaic.gpu import profiler

        times_ms = []
        for _ in range(iters):  # one call at a time: each output is freed before the next
            out, ms = profiler.measure(fn)(*args)
            del out
            times_ms.append(ms)
        return statistics.median(times_ms) / 1e3
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_ceilings(copy_bytes: int | None = None, matmul_n: int | None = None) -> Ceilings:
    """Copy bandwidth (a buffer several times the L2) and the bf16 matmul rate, measured now."""
    gpu = jax.default_backend() == "gpu"
    copy_bytes = copy_bytes or (2 << 30 if gpu else 64 << 20)
    matmul_n = matmul_n or (8192 if gpu else 1024)
    key = jax.random.key(0)
    x = jax.random.normal(key, (copy_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 2)  # one read and one write per element
    t_copy = median_seconds(copy, x)
    del x
    a = jax.random.normal(key, (matmul_n, matmul_n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (matmul_n, matmul_n), jnp.bfloat16)
    t_mm = median_seconds(jax.jit(jnp.matmul), a, b, iters=10)
    return Ceilings(2 * copy_bytes / t_copy, 2 * matmul_n**3 / t_mm)


def roofline(name: str, seconds: float, bytes_moved: float, flops: float, c: Ceilings,
             floor: float | None = None) -> dict:
    """One measured thing against both ceilings. The floor is the slower of the two unless
    given (a run of steps: the sum of each step's floor)."""
    if floor is None:
        floor = max(bytes_moved / c.copy_bytes_per_s, flops / c.matmul_flops_per_s)
    return {
        "name": name, "time_us": seconds * 1e6, "bytes": bytes_moved, "flops": flops,
        "pct_copy_bw": 100 * bytes_moved / seconds / c.copy_bytes_per_s,
        "pct_matmul": 100 * flops / seconds / c.matmul_flops_per_s,
        "floor_us": floor * 1e6, "pct_of_floor": 100 * floor / seconds,
    }


def format_rows(rows: list[dict]) -> str:
    out = ["| what | time (us) | MB moved | GFLOP | % copy BW | % bf16 matmul | floor (us) "
           "| floor / time |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['name']} | {r['time_us']:.1f} | {r['bytes'] / 1e6:.1f} | "
                   f"{r['flops'] / 1e9:.2f} | {r['pct_copy_bw']:.1f} | {r['pct_matmul']:.1f} | "
                   f"{r['floor_us']:.1f} | {r['pct_of_floor']:.0f}% |")
    return "\n".join(out)


# --- kernels ---------------------------------------------------------------------------------

def attention_decode_case(batch, ctx, hq, hkv, d, page_size, dtype, seed=0):
    """Inputs for one decode step: `batch` sequences of `ctx` cached tokens, pages shuffled."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-(ctx + 1) // page_size)
    num_pages = batch * pages_per_seq
    key = jax.random.key(seed)
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (batch, hq, d), dtype)
    k = jax.random.normal(ks[1], (batch, hkv, d), dtype)
    v = jax.random.normal(ks[2], (batch, hkv, d), dtype)
    k_pages = jax.random.normal(ks[3], (num_pages, page_size, hkv, d), dtype)
    v_pages = jax.random.normal(ks[4], (num_pages, page_size, hkv, d), dtype)
    md = AttentionMetadata(
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
        kv_lens=jnp.full((batch,), ctx + 1, jnp.int32),
        page_indices=jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq),
                                 jnp.int32),
        num_seqs=jnp.array([batch], jnp.int32))
    kv_bytes = 2 * batch * (ctx + 1) * hkv * d * jnp.dtype(dtype).itemsize
    flops = 4 * batch * (ctx + 1) * hq * d
    return (q, k, v, k_pages, v_pages, md), kv_bytes, flops


def bench_kernels(ceilings: Ceilings, backend: str = "reference", small: bool = False) -> list:
    """Attention (decode) and linear layers against the ceilings. backend: 'reference' today."""
    if backend != "reference":
        raise ValueError(f"backend {backend!r}: only 'reference' exists so far")
    rows = []
    dtype = jnp.bfloat16
    shapes = [(8, 256, 8, 2, 64)] if small else [(64, 2048, 32, 8, 128), (8, 32768, 32, 8, 128)]
    for batch, ctx, hq, hkv, d in shapes:
        args, kv_bytes, flops = attention_decode_case(batch, ctx, hq, hkv, d, 16, dtype)
        fn = jax.jit(lambda *a, d=d: ragged_paged_attention(*a, sm_scale=d ** -0.5)[0])
        t = median_seconds(fn, *args)
        rows.append(roofline(f"attention decode ref B={batch} ctx={ctx} Hq={hq} Hkv={hkv} D={d}",
                             t, kv_bytes, flops, ceilings))
    mats = [(1, 256, 256), (64, 256, 256)] if small else [
        (m, 8192, 8192) for m in (1, 16, 128, 4096)]
    key = jax.random.key(1)
    for m, n, k in mats:
        x = jax.random.normal(key, (m, k), dtype)
        w = jax.random.normal(jax.random.fold_in(key, 1), (n, k), dtype)
        t = median_seconds(jax.jit(linear), x, w)
        rows.append(roofline(f"linear ref bf16 M={m} N={n} K={k}", t,
                             2 * (m * k + n * k + m * n), 2 * m * n * k, ceilings))
    return rows


# --- end to end ------------------------------------------------------------------------------

def expert_fraction(config, tokens: int) -> float:
    """Expected share of a layer's experts that `tokens` tokens hit, each choosing k of E
    (uniform routing: 1 - (1 - k/E)^tokens; k/E for one token)."""
    if not config.is_moe:
        return 1.0
    return 1.0 - (1.0 - config.num_experts_per_tok / config.num_experts) ** tokens


def _params(model, tokens: int | None):
    """(path, variable, weight) for every parameter; expert stacks weigh the share of them
    that `tokens` tokens read (all of them if tokens is None)."""
    from flax import nnx

    share = 1.0 if tokens is None else expert_fraction(model.config, tokens)
    for path, v in nnx.state(model, nnx.Param).flat_state():
        yield path, v, share if "experts" in path else 1.0


def weight_bytes(model, tokens: int | None = None) -> int:
    """Bytes of every parameter (4-bit kinds at half a byte, as packed on the device); with
    `tokens`, the bytes a step over that many tokens reads (MoE: only the experts hit)."""
    half = (jnp.dtype(jnp.int4), jnp.dtype(jnp.float4_e2m1fn))
    return int(sum((v.size // 2 if v.dtype in half else v.size * v.dtype.itemsize) * share
                   for _, v, share in _params(model, tokens)))


def weight_count(model, active: bool = False) -> int:
    """Number of weights, float or quantized (not counting quantization scales / offsets);
    `active`: the weights one token multiplies (MoE: k of the E experts)."""
    return int(sum(v.size * share for path, v, share in _params(model, 1 if active else None)
                   if path[-1] not in ("weight_scale", "weight_offset")))


def bench_latency(llm, input_len: int, output_len: int, batch: int, ceilings: Ceilings,
                  seed: int = 0, repeats: int = 3) -> tuple[dict, list[dict]]:
    """Time to first token and per-token decode time for `batch` prompts of input_len tokens:
    the medians of `repeats` timed runs (one run of 128 tokens varied by ~5% at batch-1
    decode on the H200: bench/RESULTS.md, fourteenth session)."""
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
    runs = [run() for _ in range(repeats)]
    ttft, itl = (statistics.median(x) for x in zip(*runs, strict=True))
    w_bytes = weight_bytes(llm.model, tokens=batch)  # MoE: the experts a step hits
    itemsize = llm.model.embed.embedding.dtype.itemsize
    kv_token = c.kv_bytes_per_token(itemsize)
    mid_ctx = input_len + output_len // 2
    step_bytes = w_bytes + batch * mid_ctx * kv_token
    attn_flops = 4 * batch * mid_ctx * c.num_heads * c.head_dim * c.num_layers
    step_flops = 2 * weight_count(llm.model, active=True) * batch + attn_flops
    summary = {"batch": batch, "input_len": input_len, "output_len": output_len,
               "ttft_ms": ttft * 1e3, "itl_ms": itl * 1e3, "tokens_per_s": batch / itl,
               "itl_ms_runs": [r[1] * 1e3 for r in runs], "weight_bytes": w_bytes}
    devices = llm.runner.mesh.size  # a sharded model streams from all its devices at once
    summary["devices"] = devices
    rows = [roofline(f"decode step B={batch} (ctx ~{mid_ctx}, {devices} device"
                     f"{'s' if devices > 1 else ''})", itl, step_bytes, step_flops,
                     ceilings.times(devices))]
    return summary, rows


def bench_throughput(llm, num_requests: int, input_len: int, output_len: int,
                     ceilings: Ceilings, seed: int = 0) -> tuple[dict, list[dict]]:
    """Offline: num_requests prompts, lengths uniform in [input_len/2, input_len], all at once.

    Each engine step is timed and given its own floor, the slower of its FLOPs (2 x active
    weights per token run, plus attention) at the matmul rate and its bytes (weights once per
    device iteration and dp replica, every live token's K/V once per iteration) at the copy
    bandwidth; a run's floor is the sum of its steps' floors. Two rows: the whole run
    (prefill included), and its decode-only steps (every running request decoding, nothing
    waiting), the batch's decode roofline."""
    rng = np.random.default_rng(seed)
    c, engine = llm.config, llm.engine
    lens = rng.integers(max(input_len // 2, 1), input_len + 1, num_requests)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    itemsize = llm.model.embed.embedding.dtype.itemsize
    kv_token = c.kv_bytes_per_token(itemsize)
    w_bytes = weight_bytes(llm.model, tokens=num_requests)  # MoE: ~the experts a step hits
    flops_token = 2 * weight_count(llm.model, active=True)
    head_flops = 2 * c.vocab_size * c.hidden_size  # logits: one row per sequence and step
    attn_flops = 4 * c.num_heads * c.head_dim * c.num_layers  # per (query, key) pair
    # Data parallel: every replica reads its own weights, on its own devices.
    replicas = len(getattr(engine, "engines", [engine]))
    devices = llm.runner.mesh.size * replicas
    cd = ceilings.times(devices)

    def run(prompts) -> dict:
        start = time.perf_counter()
        for p in prompts:
            engine.add_request(p, params)
        # totals over all steps ("all") and over the decode-only ones ("decode")
        tot = {k: dict(seconds=0.0, bytes=0.0, flops=0.0, floor=0.0, steps=0, tokens=0,
                       queries=0) for k in ("all", "decode")}
        while engine.has_unfinished():
            decode_only = not engine.waiting and all(
                r.num_cached == len(r.all_ids) - 1 for r in engine.running)
            t = time.perf_counter()
            deltas = engine.step()
            seconds = time.perf_counter() - t
            produced = {d.request: len(d.token_ids) for d in deltas}
            iterations, kv_tokens, flops, queries = 1, 0.0, 0.0, 0
            for r, chunk in engine.last_batch:  # what ran, admitted this step or before
                cached = chunk.num_cached
                n = r.num_cached - cached  # queries run: a chunk's tokens, or decode iterations
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
            step_bytes = iterations * w_bytes * replicas + kv_bytes
            floor = max(step_bytes / cd.copy_bytes_per_s, flops / cd.matmul_flops_per_s)
            for key in ("all", "decode") if decode_only else ("all",):
                k = tot[key]
                k["seconds"] += seconds
                k["bytes"] += step_bytes
                k["flops"] += flops
                k["floor"] += floor
                k["steps"] += 1
                k["tokens"] += sum(produced.values())
                k["queries"] += queries
        tot["all"]["seconds"] = time.perf_counter() - start  # the wall time, not only steps'
        return tot

    # A first pass with other prompts of the same lengths compiles every step shape the
    # workload touches; the same prompts again would hit the prefix cache and skip prefill.
    run([rng.integers(2, c.vocab_size, n).tolist() for n in lens])
    tot = run([rng.integers(2, c.vocab_size, n).tolist() for n in lens])
    a, d = tot["all"], tot["decode"]
    summary = {"num_requests": num_requests, "input_len": input_len, "output_len": output_len,
               "page_size": llm.runner.page_size,
               "seconds": a["seconds"], "steps": a["steps"], "output_tokens": a["tokens"],
               "decode_tokens": d["tokens"], "prompt_tokens": int(sum(lens)),
               "tokens_run": a["queries"],
               "output_tokens_per_s": a["tokens"] / a["seconds"],
               "requests_per_s": num_requests / a["seconds"], "devices": devices,
               "floor_seconds": a["floor"], "decode_steps_run": d["steps"],
               "decode_tokens_per_s": d["tokens"] / d["seconds"] if d["steps"] else 0.0,
               "decode_roofline_tokens_per_s": d["tokens"] / d["floor"] if d["steps"] else 0.0}
    rows = [roofline(f"whole run ({a['steps']} steps, {a['tokens']} output tokens, {devices} "
                     f"device{'s' if devices > 1 else ''})", a["seconds"], a["bytes"],
                     a["flops"], cd, floor=a["floor"])]
    if d["steps"]:
        rows.append(roofline(f"decode-only steps ({d['steps']}, {d['tokens']} tokens)",
                             d["seconds"], d["bytes"], d["flops"], cd, floor=d["floor"]))
    return summary, rows
