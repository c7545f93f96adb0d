"""`jaxinfer bench serve`: a load generator for the OpenAI-compatible server, on loopback.

Sends `num_requests` streaming /v1/completions requests of random token-id prompts
(lengths uniform in [input_len * (1 - range_ratio), input_len]), at most
`concurrency` in flight, each generating exactly output_len tokens (ignore_eos),
and reports what a user of the server sees (a soak mixes in clients that disconnect
mid-stream and malformed requests: `soak_roles`; `solo_mismatches` sends completed
requests again one at a time):

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
    role: str = "complete"  # "complete", "disconnect" (closes its stream early), "malformed"
    token_ids: list[int] = dataclasses.field(default_factory=list)


# Malformed requests of a soak (each must get a 4xx, and the server go on): a body that is
# not JSON, a prompt holding a negative token id, a negative max_tokens, a string where a
# number goes.
MALFORMED = (b"{not json", {"prompt": [5, -3, 7], "max_tokens": 4},
             {"prompt": [5, 6], "max_tokens": -1}, {"prompt": [5, 6], "temperature": "hot"})


async def _one(client: httpx.AsyncClient, payload: dict,
               disconnect_after: int | None = None) -> RequestResult:
    """Streams one completion; disconnect_after: close the stream once that many tokens
    came (a client that goes away mid-stream)."""
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
            ids = (choices[0].get("token_ids") or []) if choices else []
            if not ids:
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - start
            else:
                result.itls += [(now - last) / len(ids)] * len(ids)
            last = now
            result.output_tokens += len(ids)
            result.token_ids += ids
            if disconnect_after is not None and result.output_tokens >= disconnect_after:
                result.role, result.ok = "disconnect", True
                return result  # leaving the stream closes the connection
    result.latency = time.perf_counter() - start
    result.ok = result.output_tokens == payload["max_tokens"]
    if not result.ok:
        result.error = f"got {result.output_tokens} of {payload['max_tokens']} tokens"
    return result


async def _malformed(client: httpx.AsyncClient, model: str, index: int) -> RequestResult:
    """One of MALFORMED; ok when the server answers it with a 4xx."""
    body = MALFORMED[index % len(MALFORMED)]
    if isinstance(body, bytes):
        resp = await client.post("/v1/completions", content=body,
                                 headers={"Content-Type": "application/json"})
    else:
        resp = await client.post("/v1/completions", json={"model": model, **body})
    ok = 400 <= resp.status_code < 500
    return RequestResult(ok=ok, role="malformed",
                         error="" if ok else f"malformed request {index % len(MALFORMED)}: "
                                            f"HTTP {resp.status_code}")


def _client(url: str, api_key: str | None, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url, headers=headers,
                             timeout=httpx.Timeout(None, connect=10.0),
                             limits=httpx.Limits(max_connections=connections))


def _payload(model: str, prompt: list[int], output_len: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


async def _run(url: str, model: str, prompts: list[list[int]], output_len: int,
               concurrency: int, api_key: str | None, roles: list[str], seed: int
               ) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(seed)
    cut = rng.integers(1, max(output_len, 2), len(prompts))  # where disconnects leave
    async with _client(url, api_key, concurrency + 4) as client:
        async def limited(i, prompt):
            async with limit:
                if roles[i] == "malformed":
                    return await _malformed(client, model, i)
                return await _one(client, _payload(model, prompt, output_len),
                                  int(cut[i]) if roles[i] == "disconnect" else None)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
        return list(results), time.perf_counter() - start


def solo_mismatches(url: str, model: str, prompts: list[list[int]], results: list,
                    output_len: int, sample: int, api_key: str | None = None) -> dict:
    """Sends up to `sample` of the completed requests again, one at a time, and counts those
    whose greedy tokens differ from what they got under load."""
    done = [i for i, r in enumerate(results) if r.role == "complete" and r.ok][:sample]

    async def solo():
        async with _client(url, api_key, 2) as client:
            return [await _one(client, _payload(model, prompts[i], output_len)) for i in done]

    again = asyncio.run(solo())
    differ = [i for i, r in zip(done, again, strict=True)
              if r.token_ids != results[i].token_ids]
    return {"solo_compared": len(done), "solo_mismatches": len(differ)}


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


def soak_roles(num: int, disconnect_fraction: float, malformed_fraction: float,
               seed: int) -> list[str]:
    """Each request's role: round(num * fraction) of them disconnect mid-stream or are
    malformed, the others complete (chosen by seed)."""
    roles = ["complete"] * num
    order = np.random.default_rng(seed).permutation(num)
    n_disconnect = round(num * disconnect_fraction)
    n_malformed = round(num * malformed_fraction)
    for i in order[:n_disconnect]:
        roles[i] = "disconnect"
    for i in order[n_disconnect:n_disconnect + n_malformed]:
        roles[i] = "malformed"
    return roles


def run_load(url: str, model: str, prompts: list[list[int]], output_len: int,
             concurrency: int, api_key: str | None = None, roles: list[str] | None = None,
             seed: int = 0, keep: list | None = None) -> dict:
    """Runs the load; returns the summary (times in ms, over the completed requests).
    roles: each request's (`soak_roles`; default: all complete). keep: a list the
    RequestResults are appended to. Raises if any request failed (a malformed one fails
    when it gets no 4xx)."""
    roles = roles or ["complete"] * len(prompts)
    results, seconds = asyncio.run(_run(url, model, prompts, output_len, concurrency,
                                        api_key, roles, seed))
    if keep is not None:
        keep.extend(results)
    if failed := [r for r in results if not r.ok]:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed; first: "
                           f"{failed[0].error}")
    complete = [r for r in results if r.role == "complete"]
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "num_requests": len(results), "concurrency": concurrency, "seconds": seconds,
        "num_disconnected": roles.count("disconnect"), "num_malformed": roles.count("malformed"),
        "mean_input_len": statistics.mean(len(p) for p in prompts), "output_len": output_len,
        "requests_per_s": len(results) / seconds, "output_tokens_per_s": output_tokens / seconds,
        "ttft_ms": percentiles([r.ttft for r in complete]),
        "itl_ms": percentiles([x for r in complete for x in r.itls]),
        "latency_ms": percentiles([r.latency for r in complete]),
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
    if s.get("num_disconnected") or s.get("num_malformed") or "kv_pages_left" in s:
        lines += ["", f"soak: {s.get('num_disconnected', 0)} clients disconnected mid-stream, "
                  f"{s.get('num_malformed', 0)} malformed requests answered 4xx, "
                  f"{s.get('requests_aborted', 0)} requests aborted; after the "
                  f"load the server held {s.get('requests_left', 0)} requests and "
                  f"{s.get('kv_pages_left', 0)} KV pages"]
    if "solo_compared" in s:
        lines.append(f"{s['solo_mismatches']} of {s['solo_compared']} completed requests sent "
                     "again one at a time gave other greedy tokens")
    if "fraction_of_roofline" in s:
        lines += ["", f"decode roofline at this concurrency: "
                  f"{s['roofline_output_tokens_per_s']:.1f} output tokens/s; reached "
                  f"{100 * s['fraction_of_roofline']:.1f}%. Batch-1 token floor "
                  f"{s['batch1_itl_floor_ms']:.2f} ms; ITL p50 is "
                  f"{100 * s['itl_p50_over_floor']:.1f}% of that speed."]
    return "\n".join(lines)
