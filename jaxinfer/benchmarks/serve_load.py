"""`jaxinfer bench serve`: a load generator for the OpenAI-compatible server, on loopback.

Sends `num_requests` streaming /v1/completions requests of random token-id prompts
(lengths uniform in [input_len * (1 - range_ratio), input_len]), at most
`concurrency` in flight, each generating exactly output_len tokens (ignore_eos),
and reports what a user of the server sees:

  - request throughput and output tokens/s over the whole run;
  - TTFT (request sent -> first token received) and inter-token latency (the gap
    between streamed chunks, divided over the tokens a chunk carries) p50/p90/p99;

and, from the model's sizes (published by the server in /metrics) and the copy
bandwidth measured on the device in the same run, the decode roofline: a decode
step of C sequences reads the weights a step of C tokens needs (W(C),
`jaxinfer.loading.weights.StepReads.step_bytes`: every parameter once, the MoE
experts C tokens hit, C input embedding rows) plus the K/V of every live
sequence, so at concurrency C and mean context L the output rate cannot exceed
C * bandwidth / (W(C) + C * L * kv_bytes_per_token).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time

import httpx
import numpy as np

from jaxinfer.loading.weights import StepReads


@dataclasses.dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


async def _one(client: httpx.AsyncClient, payload: dict) -> RequestResult:
    start = time.perf_counter()
    result, last = RequestResult(ok=False), None
    async with client.stream("POST", "/v1/completions", json=payload) as resp:
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return result
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if (data := line[len("data: "):]) == "[DONE]":
                break
            choices = json.loads(data).get("choices") or []
            n = len(choices[0].get("token_ids") or []) if choices else 0
            if n == 0:
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - start
            else:
                result.itls += [(now - last) / n] * n
            last = now
            result.output_tokens += n
    result.latency = time.perf_counter() - start
    result.ok = result.output_tokens == payload["max_tokens"]
    if not result.ok:
        result.error = f"got {result.output_tokens} of {payload['max_tokens']} tokens"
    return result


async def _run(url: str, model: str, prompts: list[list[int]], output_len: int,
               concurrency: int, api_key: str | None) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(None, connect=10.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def limited(prompt):
            async with limit:
                return await _one(client, {
                    "model": model, "prompt": prompt, "max_tokens": output_len,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "return_token_ids": True})

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return list(results), time.perf_counter() - start


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float]:
    """{'p50': ..., ...} in milliseconds (NaN when there are no values)."""
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) * 1e3 for q in qs}


def random_prompts(num: int, input_len: int, range_ratio: float, vocab: int,
                   seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(int(input_len * (1 - range_ratio)), 1), input_len + 1, num)
    return [rng.integers(2, vocab, n).tolist() for n in lens]


def run_load(url: str, model: str, prompts: list[list[int]], output_len: int,
             concurrency: int, api_key: str | None = None) -> dict:
    """Runs the load; returns the summary (times in ms). Raises if any request failed."""
    results, seconds = asyncio.run(_run(url, model, prompts, output_len, concurrency,
                                        api_key))
    if failed := [r for r in results if not r.ok]:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed; first: "
                           f"{failed[0].error}")
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "num_requests": len(results), "concurrency": concurrency, "seconds": seconds,
        "mean_input_len": statistics.mean(len(p) for p in prompts), "output_len": output_len,
        "requests_per_s": len(results) / seconds, "output_tokens_per_s": output_tokens / seconds,
        "ttft_ms": percentiles([r.ttft for r in results]),
        "itl_ms": percentiles([x for r in results for x in r.itls]),
        "latency_ms": percentiles([r.latency for r in results]),
    }


def decode_roofline(summary: dict, reads: StepReads, kv_bytes_per_token: float,
                    copy_bytes_per_s: float) -> dict:
    """The decode-bound output rate at this concurrency and mean context, and the run's
    fraction of it (prefill is not counted: the bound is optimistic)."""
    c = summary["concurrency"]
    mean_ctx = summary["mean_input_len"] + summary["output_len"] / 2
    step_bytes = reads.step_bytes(c) + c * mean_ctx * kv_bytes_per_token
    roof = c * copy_bytes_per_s / step_bytes
    batch1_itl_ms = (reads.step_bytes(1) + mean_ctx * kv_bytes_per_token) / copy_bytes_per_s * 1e3
    return {"roofline_output_tokens_per_s": roof,
            "fraction_of_roofline": summary["output_tokens_per_s"] / roof,
            "batch1_itl_floor_ms": batch1_itl_ms,
            "itl_p50_over_floor": batch1_itl_ms / summary["itl_ms"]["p50"]}


def format_summary(s: dict) -> str:
    def row(name, d):
        return f"| {name} | {d['p50']:.2f} | {d['p90']:.2f} | {d['p99']:.2f} |"

    lines = [f"{s['num_requests']} requests, concurrency {s['concurrency']}, "
             f"mean input {s['mean_input_len']:.0f}, output {s['output_len']}: "
             f"{s['requests_per_s']:.2f} requests/s, {s['output_tokens_per_s']:.1f} output "
             f"tokens/s in {s['seconds']:.1f} s",
             "", "| ms | p50 | p90 | p99 |", "| --- | --- | --- | --- |",
             row("TTFT", s["ttft_ms"]), row("inter-token latency", s["itl_ms"]),
             row("request latency", s["latency_ms"])]
    if "fraction_of_roofline" in s:
        lines += ["", f"decode roofline at this concurrency: "
                  f"{s['roofline_output_tokens_per_s']:.1f} output tokens/s; reached "
                  f"{100 * s['fraction_of_roofline']:.1f}%. Batch-1 token floor "
                  f"{s['batch1_itl_floor_ms']:.2f} ms; ITL p50 is "
                  f"{100 * s['itl_p50_over_floor']:.1f}% of that speed."]
    return "\n".join(lines)
