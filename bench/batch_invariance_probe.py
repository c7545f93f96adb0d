"""Where a batch-invariant run still differs from solo runs: the serving soak's check, offline
and with logprobs, so that a difference shows even where it does not flip a token.

1. Prefill logits: `LLM.logits` of one prompt alone against the same prompt among others
   (other row counts and offsets in its program), float32 logits compared bitwise.
2. Generation: N prompts of random lengths together (`LLM.generate`, the engine's own
   batching, preemption where the KV pool runs short), then a sample of them alone three
   times: with whatever prefix-cache hits they find, again (the first solo run's pages
   cached), and with the prefix cache emptied (a whole prefill). For each that differs: the
   first output position whose token or logprob differs, and how each run chunked the
   prompt ((tokens cached, tokens computed) per step).
3. --chunk-probe (instead of 2): one prompt on fixed pages,
   - through the logits programs: whole; in two chunks; its last tokens after the pages hold
     the rest (a solo run's prefix-cache hit), alone and beside other sequences;
   - through the sample programs: its first token and logprob whole, split in two steps run
     one after the other, overlapped (the second launched before the first is read back),
     and beside another prompt; and the first layer and positions whose K/V differ
     between the whole and the split run.

    python3 bench/batch_invariance_probe.py --preset llama3-8b [--layers 4] [--no-overlap]
        [--num-requests 600] [--solo 50] [--chunk-probe] [--json F]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time

import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.scheduler import SeqChunk
from jaxinfer.loading.presets import preset_config, random_model


def first_difference(a, b) -> dict | None:
    """The first output position where tokens or logprobs of two RequestOutputs differ."""
    for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=False)):
        tx, ty = a.token_ids[i], b.token_ids[i]
        if tx != ty or x.logprob != y.logprob:
            return {"position": i, "tokens_differ": tx != ty,
                    "logprob_together": x.logprob, "logprob_alone": y.logprob}
    if a.token_ids != b.token_ids:
        return {"position": min(len(a.token_ids), len(b.token_ids)), "tokens_differ": True}
    return None


def logits_probe(llm: LLM, rng, vocab: int, lengths: list[int]) -> list[dict]:
    """One prompt's logits alone against among others of these lengths in all (prompts of
    up to 40 tokens, half before it and half after, so that some share its program): how
    many of its float32 logits differ."""
    prompt = rng.integers(0, vocab, 100).tolist()
    alone = np.asarray(llm.logits([prompt])[0])
    rows = []
    for n in lengths:
        sizes = [min(40, n - k) for k in range(0, n, 40)]
        others = [rng.integers(0, vocab, k).tolist() for k in sizes]
        half = len(others) // 2
        out = llm.logits(others[:half] + [prompt] + others[half:])
        together = np.asarray(out[half])
        differ = together != alone
        rows.append({"other_tokens": n, "logits_differ": int(differ.sum()),
                     "rows_differ": int(differ.any(axis=1).sum())})
        print(f"logits: prompt of 100 among {n} other tokens: {rows[-1]['rows_differ']} of 100 "
              f"rows differ ({rows[-1]['logits_differ']} logits)", flush=True)
    return rows


def chunk_probe(llm: LLM, rng, vocab: int, length: int = 780, split: int = 488,
                cached: int = 768) -> list[dict]:
    """One prompt's logits on fixed pages: whole, then split at `split`, then its tokens from
    `cached` on alone (the pages hold the rest from the run before), alone and beside other
    sequences; how many rows of the later runs differ from the earlier ones."""
    engine = llm.engine
    pool, page_size = engine.scheduler.pool, engine.runner.page_size
    prompt = rng.integers(0, vocab, length).tolist()
    others = [rng.integers(0, vocab, n).tolist() for n in (300, 1, 1, 1)]
    pages = pool.allocate(-(-length // page_size))
    other_pages = [pool.allocate(-(-len(o) // page_size)) for o in others]

    def chunk(start, n):
        return SeqChunk(new_tokens=prompt[start:start + n], num_cached=start, pages=pages)

    def run(*chunks, beside=False):
        extra = [SeqChunk(new_tokens=o, num_cached=0, pages=p)
                 for o, p in zip(others, other_pages, strict=True)] if beside else []
        return np.asarray(engine.runner.logits(extra + list(chunks))[len(extra):][-1])

    rows = []

    def compare(name, got, ref):
        differ = (got != ref).any(axis=-1)
        rows.append({"case": name, "rows": int(got.shape[0]), "rows_differ": int(differ.sum()),
                     "first": int(np.flatnonzero(differ)[0]) if differ.any() else None})
        print(f"chunks: {name}: {rows[-1]['rows_differ']} of {got.shape[0]} rows differ "
              f"(first {rows[-1]['first']})", flush=True)

    try:
        whole = run(chunk(0, length))
        run(chunk(0, split))
        second = run(chunk(split, length - split))
        compare(f"[{split}, {length}) after [0, {split}) vs whole", second, whole[split:])
        tail = run(chunk(cached, length - cached))
        compare(f"[{cached}, {length}) alone vs in [{split}, {length})", tail,
                second[cached - split:])
        tail_beside = run(chunk(cached, length - cached), beside=True)
        compare(f"[{cached}, {length}) beside others vs alone", tail_beside, tail)
        run(chunk(0, length))
        tail_after_whole = run(chunk(cached, length - cached))
        compare(f"[{cached}, {length}) after whole vs whole", tail_after_whole,
                whole[cached:])
    finally:
        for p in [pages, *other_pages]:
            pool.release(p)
    return rows


def split_probe(llm: LLM, rng, vocab: int, length: int = 740, split: int = 229) -> list[dict]:
    """One prompt's first sampled token and its logprob through the sample programs: whole,
    split in two steps run one after the other, split with the second step launched before
    the first is read back (the engine's overlap), and split beside another prompt's chunks."""
    runner, pool = llm.engine.runner, llm.engine.scheduler.pool
    page_size = runner.page_size
    prompt = rng.integers(0, vocab, length).tolist()
    other = rng.integers(0, vocab, 900).tolist()
    pages = pool.allocate(-(-length // page_size))
    other_pages = pool.allocate(-(-len(other) // page_size))

    def chunk(start, n, ids=prompt, where=pages):
        return SeqChunk(new_tokens=ids[start:start + n], num_cached=start, pages=where,
                        num_prompt=len(ids))

    logits = {}
    run_program = runner.steps.run

    def keeping_logits(shape, *args):  # a one-step sample program also returns its logits
        result = run_program(shape, *args)
        if shape.kind == "sample":
            logits["last"] = result[0][5]
        return result

    runner.steps.run = keeping_logits

    def first(out, row=-1):
        row_logits = np.asarray(logits["last"][row % len(out.tokens)])
        return int(out.tokens[row][0]), float(out.logprobs[row][0]), row_logits

    def kv():  # [layers, positions, Hkv, D] for k and v: what each layer wrote
        return [np.stack([np.asarray(layer[i][jnp.asarray(pages)]).reshape(
            -1, *layer[i].shape[2:])[:length] for layer in runner.kv_cache]) for i in (0, 1)]

    rows = []
    try:
        whole = first(runner.step([chunk(0, length)], with_logprobs=True))
        # A pool per layer unless the layers are scanned (then a pool holds several).
        per_layer = runner.layers_per_pool == 1
        kv_whole = kv() if per_layer else []
        runner.step([chunk(0, split)], with_logprobs=True)
        sync = first(runner.step([chunk(split, length - split)], with_logprobs=True))
        for name, a, b in zip("kv", kv() if per_layer else [], kv_whole, strict=True):
            differ = (a != b).any(axis=(2, 3))  # [layers, positions]
            layers = np.flatnonzero(differ.any(axis=1))
            if layers.size:
                first_layer = int(layers[0])
                pos = np.flatnonzero(differ[first_layer])
                print(f"split: {name} differs from layer {first_layer} on ({layers.size} "
                      f"layers); there at {pos.size} positions: {pos[:12].tolist()}; "
                      f"positions per layer {differ.sum(axis=1).tolist()}", flush=True)
            else:
                print(f"split: every layer's {name} the same", flush=True)
        a = runner.launch([chunk(0, split)], with_logprobs=True)
        b = runner.launch([chunk(split, length - split)], with_logprobs=True)
        runner.collect(a)
        overlapped = first(runner.collect(b))
        runner.step([chunk(0, 400, other, other_pages), chunk(0, split)], with_logprobs=True)
        beside = first(runner.step([chunk(400, 500, other, other_pages),
                                    chunk(split, length - split)], with_logprobs=True))
        for name, got in [("split, one step after the other", sync),
                          ("split, overlapped", overlapped), ("split, beside another", beside)]:
            differ = int((got[2] != whole[2]).sum())
            rows.append({"case": name, "whole": whole[:2], "got": got[:2],
                         "logits_differ": differ})
            print(f"split: {name}: {got[:2]} against whole {whole[:2]}: {differ} of "
                  f"{got[2].size} logits differ", flush=True)
    finally:
        runner.steps.run = run_program
        pool.release(pages)
        pool.release(other_pages)
    return rows


def record_prefill_chunks(llm: LLM) -> dict:
    """Wraps the engine's step to note each prompt's prefill chunks: {first 16 prompt ids:
    [(tokens cached, tokens computed), ...]} (the runs here keep prompts apart by them)."""
    chunks = collections.defaultdict(list)
    step = llm.engine.step

    def noting():
        deltas = step()
        for req, chunk in llm.engine.last_batch:
            if chunk.num_cached < len(req.prompt_ids):
                chunks[tuple(req.prompt_ids[:16])].append((chunk.num_cached,
                                                           len(chunk.new_tokens)))
        return deltas

    llm.engine.step = noting
    return chunks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--range-ratio", type=float, default=0.75)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--solo", type=int, default=50, help="requests run again alone")
    ap.add_argument("--no-overlap", action="store_true", help="synchronous engine steps")
    ap.add_argument("--no-logits-probe", action="store_true")
    ap.add_argument("--chunk-probe", action="store_true", help="then stop")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="else planned")
    ap.add_argument("--default-mode", action="store_true", help="the control: mode off")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    config = preset_config(args.preset)
    if args.layers:
        config = dataclasses.replace(config, num_layers=args.layers)
    t0 = time.perf_counter()
    llm = LLM(random_model(config, jnp.bfloat16, seed=1), batch_invariant=not args.default_mode,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_bytes=int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else None)
    if args.no_overlap:
        llm.engine.overlap = False
    print(f"LLM ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    result = {"args": vars(args)}
    if not args.no_logits_probe:
        result["logits"] = logits_probe(llm, rng, config.vocab_size, [20, 600, 1200])
    if args.chunk_probe:
        result["chunks"] = chunk_probe(llm, rng, config.vocab_size)
        result["split"] = split_probe(llm, rng, config.vocab_size)
        args.num_requests = 0

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not args.num_requests:
        return
    low = int(args.input_len * (1 - args.range_ratio))
    high = int(args.input_len * (1 + args.range_ratio))
    prompts = [rng.integers(0, config.vocab_size, int(n)).tolist()
               for n in rng.integers(low, high + 1, args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    chunks = record_prefill_chunks(llm)
    t0 = time.perf_counter()
    together = llm.generate(prompts, params)
    stats = llm.engine.stats()
    print(f"{args.num_requests} together in {time.perf_counter() - t0:.1f} s; "
          f"{stats.num_preemptions} preemptions, {stats.num_steps} steps", flush=True)
    sample = rng.choice(args.num_requests, min(args.solo, args.num_requests), replace=False)
    diffs = []
    for i in sample.tolist():
        key = tuple(prompts[i][:16])
        seen = {"together": list(chunks[key])}
        chunks[key].clear()
        alone = llm.generate([prompts[i]], params)[0]
        seen["alone"] = list(chunks[key])
        chunks[key].clear()
        again = llm.generate([prompts[i]], params)[0]
        seen["again"] = list(chunks[key])
        chunks[key].clear()
        pool = llm.engine.scheduler.pool  # forget every cached prefix (the pool's own maps)
        pool.page_of.clear()
        pool.hash_of.clear()
        fresh = llm.generate([prompts[i]], params)[0]
        seen["fresh"] = list(chunks[key])
        d = first_difference(together[i], alone)
        d_again = first_difference(alone, again)
        d_fresh = first_difference(together[i], fresh)
        if d is not None or d_again is not None or d_fresh is not None:
            d = {"request": i, "prompt_len": len(prompts[i]), "together_vs_alone": d,
                 "alone_vs_again": d_again, "together_vs_fresh": d_fresh, "chunks": seen}
            diffs.append(d)
            print(f"request {i}: {d}", flush=True)
    differ = [d for d in diffs if d["together_vs_alone"]]
    print(f"{len(differ)} of {len(sample)} solo runs differ "
          f"({sum(d['together_vs_alone']['tokens_differ'] for d in differ)} in tokens); "
          f"{sum(bool(d['alone_vs_again']) for d in diffs)} second solo runs differ from "
          f"the first; {sum(bool(d['together_vs_fresh']) for d in diffs)} runs without "
          "prefix hits differ from together", flush=True)
    result |= {"preemptions": stats.num_preemptions, "solo": len(sample), "differ": diffs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
