"""`jaxinfer serve`: the official openai client (and raw httpx) against real server processes.

Two servers on the tiny converted qwen3 (float32): `server`, with a pool large enough
that nothing is preempted, and `small`, with 12 KV pages and an API key, so that
concurrent load forces preemption. Outputs are compared under greedy decoding (or a
fixed seed) with the same requests sent one at a time, by token ids (vLLM's
`return_token_ids` extension). After every test both servers must hold no KV pages.
The engine-failure path runs in-process, on a fake engine that raises.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer import LLM
from jaxinfer.cli.main import cli
from jaxinfer.engine.engine import EngineInterface, EngineStats
from jaxinfer.engine.request import RequestDelta
from jaxinfer.serving.server import create_app

from .conftest import VOCAB

PAGE = 16
API_KEY = "test-key-123"
SMALL_PAGES = 12


class Server:
    def __init__(self, proc: subprocess.Popen, log: Path, url: str, api_key: str | None):
        self.proc, self.log, self.url, self.api_key = proc, log, url, api_key
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "unused",
                                    max_retries=0, timeout=120)
        self.name = None

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, by name (labels folded into the name as name{k=v})."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Polls /metrics until no request runs or waits and no KV page is in use."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = (m["jaxinfer_num_requests_running"], m["jaxinfer_num_requests_waiting"],
                    m["jaxinfer_kv_pages_in_use"])
            if busy == (0, 0, 0):
                return m
            assert time.monotonic() < deadline, f"server still busy (running, waiting, " \
                                                 f"pages in use) = {busy}"
            time.sleep(0.05)


def _page_bytes(model_dir: Path) -> int:
    c = json.loads((model_dir / "model_config.json").read_text())
    return 2 * c["num_layers"] * PAGE * c["num_kv_heads"] * c["head_dim"] * 4  # float32


def _start(model_dir: Path, log: Path, pages: int, *args: str,
           env: dict | None = None, warmup: bool = False) -> subprocess.Popen:
    # Half a page more than `pages`, so that float rounding cannot lose one.
    gb = (pages + 0.5) * _page_bytes(model_dir) / 2**30
    cmd = [sys.executable, "-m", "jaxinfer.cli.main", "serve", "--model", str(model_dir),
           "--port", "0", "--kv-cache-gb", repr(gb), *args, *([] if warmup else ["--no-warmup"])]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})


def _wait_ready(proc: subprocess.Popen, log: Path, api_key: str | None,
                timeout: float = 300) -> Server:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}):\n{log.read_text()}")
        if m := re.search(r"ready in [\d.]+ s on (http://\S+)", log.read_text()):
            url = m.group(1)
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return Server(proc, log, url, api_key)
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"server not ready in {timeout} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def servers(qwen3_converted, tmp_path_factory):
    """Both servers, started together (each compiles its own steps)."""
    logs = tmp_path_factory.mktemp("server_logs")
    procs = [
        _start(qwen3_converted, logs / "server.log", 512, "--max-num-seqs", "32",
               "--max-num-batched-tokens", "256", "--served-model-name", "tiny-qwen3"),
        _start(qwen3_converted, logs / "small.log", SMALL_PAGES, "--max-num-seqs", "8",
               "--max-num-batched-tokens", "64", env={"JAXINFER_API_KEY": API_KEY}),
    ]
    try:
        big = _wait_ready(procs[0], logs / "server.log", None)
        small = _wait_ready(procs[1], logs / "small.log", API_KEY)
        big.name, small.name = "tiny-qwen3", str(qwen3_converted)
        yield big, small
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def small(servers):
    return servers[1]


@pytest.fixture(autouse=True)
def no_leaks(request):
    """After every server test: both servers idle with 0 KV pages in use."""
    yield
    if "servers" in request.fixturenames:
        for s in request.getfixturevalue("servers"):
            s.wait_idle()
            assert s.proc.poll() is None, s.log.read_text()


def _complete(s: Server, prompt, **kw):
    kw.setdefault("temperature", 0)
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    return s.client.completions.create(model=s.name, prompt=prompt, extra_body=extra, **kw)


def _ids(resp) -> list[int]:
    return resp.choices[0].model_extra["token_ids"]


def _rand_prompt(rng, n: int) -> list[int]:
    return rng.integers(2, VOCAB, n).tolist()


# -- generation ------------------------------------------------------------------------------


def test_completions_stream_matches_non_stream(server):
    resp = _complete(server, "The history of printing", max_tokens=12,
                     extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and len(_ids(resp)) == 12
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert choice.text

    chunks = list(server.client.completions.create(
        model=server.name, prompt="The history of printing", max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == resp.usage.model_dump()
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == choice.text
    assert [t for c in body for t in c.choices[0].model_extra["token_ids"]] == _ids(resp)
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


def test_chat_uses_the_template_and_streams(server):
    messages = [{"role": "user", "content": "hello"}]
    kw = dict(model=server.name, messages=messages, temperature=0, max_tokens=10,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    resp = server.client.chat.completions.create(**kw)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    # The fixture's template: <role>content</s> per message, then <assistant>.
    same = _complete(server, "<user>hello</s><assistant>", max_tokens=10,
                     extra_body={"ignore_eos": True})
    assert choice.model_extra["prompt_token_ids"] == same.choices[0].model_extra[
        "prompt_token_ids"]
    assert choice.model_extra["token_ids"] == _ids(same)
    assert choice.message.content == same.choices[0].text
    assert resp.usage.prompt_tokens == len(choice.model_extra["prompt_token_ids"])

    chunks = list(server.client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10

    # Content parts are joined with newlines.
    two_parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    parts = server.client.chat.completions.create(
        **{**kw, "messages": [{"role": "user", "content": two_parts}]})
    joined = server.client.chat.completions.create(**{**kw, "messages": [
        {"role": "user", "content": "hel\nlo"}]})
    assert parts.choices[0].model_extra["token_ids"] == joined.choices[0].model_extra["token_ids"]


def test_stop_strings_and_stop_token_ids(server):
    prompt = "Once upon a time"
    # Seeded sampling: varied text (the tiny model's greedy text repeats), and deterministic.
    kw = dict(max_tokens=24, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    full = _complete(server, prompt, **kw)
    text, ids = full.choices[0].text, _ids(full)
    # A stop string from the middle of the output, at its first occurrence.
    starts = [i for i in range(len(text) // 3, len(text) - 3) if text.find(text[i:i + 3]) == i]
    assert starts, text
    start = starts[0]
    stop = text[start:start + 3]
    cut = _complete(server, prompt, stop=[stop], **kw)
    assert cut.choices[0].text == text[:start]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    chunks = list(server.client.completions.create(model=server.name, prompt=prompt, stop=stop,
                                                   stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == text[:start]
    assert chunks[-1].choices[0].finish_reason == "stop"

    messages = [{"role": "user", "content": prompt}]
    chat_text = server.client.chat.completions.create(
        model=server.name, messages=messages, **kw).choices[0].message.content
    chat_stop = chat_text[len(chat_text) // 2:][:2]
    assert chat_stop, chat_text
    again = server.client.chat.completions.create(model=server.name, messages=messages,
                                                  stop=chat_stop, **kw)
    assert again.choices[0].message.content == chat_text[:chat_text.find(chat_stop)]
    assert again.choices[0].finish_reason == "stop"

    # A stop token id ends the output at its first occurrence (kept in token_ids).
    stop_id = ids[5]
    first = ids.index(stop_id)
    by_id = _complete(server, prompt, **{**kw, "extra_body": {"ignore_eos": True,
                                                              "stop_token_ids": [stop_id]}})
    assert _ids(by_id) == ids[:first + 1]
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.choices[0].model_extra["stop_reason"] == stop_id


def test_logprobs(server, qwen3_converted):
    resp = _complete(server, "The printing press", max_tokens=8, logprobs=5,
                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # Oracle: the model's own float64 log-softmax (same checkpoint, in this process); the API
    # keys top_logprobs by token text, the likeliest id keeping a text shared by several.

    llm = LLM(qwen3_converted, kv_cache_bytes=1 << 22)
    prompt_ids = resp.choices[0].model_extra["prompt_token_ids"]
    out_ids = _ids(resp)
    logits = llm.logits([prompt_ids + out_ids[:-1]])[0][len(prompt_ids) - 1:]
    logp = logits.astype(np.float64)
    logp -= logp.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))

    def text(t):
        return llm.tokenizer.decode([int(t)], skip_special_tokens=False)

    for j, (token, logprob, top) in enumerate(
            zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert token == text(out_ids[j])
        assert logprob == pytest.approx(logp[j, out_ids[j]], abs=1e-4)
        expected: dict[str, float] = {}
        for t in np.argsort(-logp[j])[:5]:
            expected.setdefault(text(t), logp[j, t])
        assert top.keys() == expected.keys()
        for key, value in expected.items():
            assert top[key] == pytest.approx(value, abs=1e-4)

    chat = server.client.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.bytes == list(entry.token.encode())

    # logprobs=0: the sampled token's only; streamed, one entry per token.
    chunks = list(server.client.completions.create(
        model=server.name, prompt="The printing press", max_tokens=8, temperature=0,
        logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    streamed = [x for c in chunks if c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert all(top == {} for c in chunks if c.choices[0].logprobs
               for top in c.choices[0].logprobs.top_logprobs)


def test_seeds(server):
    def run(seed):
        return _ids(_complete(server, "A seed", max_tokens=16, temperature=1.0, seed=seed,
                              extra_body={"ignore_eos": True}))

    a = run(1234)
    assert run(1234) == a
    assert run(4321) != a


def test_concurrent_requests_match_sequential(server):
    rng = np.random.default_rng()
    prompts = [_rand_prompt(rng, n) for n in rng.integers(3, 120, 32)]
    max_tokens = rng.integers(4, 16, 32).tolist()

    def run(i):
        return _ids(_complete(server, prompts[i], max_tokens=max_tokens[i],
                              extra_body={"ignore_eos": True}))

    alone = [run(i) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(run, range(32)))
    assert together == alone
    assert [len(x) for x in together] == max_tokens


def test_prefix_cache_hit(server, small):
    rng = np.random.default_rng()
    shared = _rand_prompt(rng, 3 * PAGE + 5)
    a, b = shared + _rand_prompt(rng, 7), shared + _rand_prompt(rng, 11)

    def hits(s):
        return s.metrics()["jaxinfer_prefix_cache_hits_total"]

    h0 = hits(server)
    first_b = _ids(_complete(server, b, max_tokens=10, extra_body={"ignore_eos": True}))
    h1 = hits(server)
    assert h1 == h0  # a fresh random prefix
    got_a = _ids(_complete(server, a, max_tokens=10, extra_body={"ignore_eos": True}))
    h2 = hits(server)
    assert h2 - h1 == 3 * PAGE  # the shared prefix, rounded down to full pages
    # The same request on the other server (which has never seen this prefix).
    assert got_a == _ids(_complete(small, a, max_tokens=10, extra_body={"ignore_eos": True}))
    again_b = _ids(_complete(server, b, max_tokens=10, extra_body={"ignore_eos": True}))
    assert again_b == first_b
    assert hits(server) - h2 == (len(b) - 1) // PAGE * PAGE
    m = server.metrics()
    assert 0 < m["jaxinfer_prefix_cache_hit_rate"] < 1
    assert m["jaxinfer_prefix_cache_queries_total"] >= m["jaxinfer_prefix_cache_hits_total"]


def test_small_pool_preempts_and_outputs_match(server, small):
    rng = np.random.default_rng()
    n = 16
    prompts = [_rand_prompt(rng, k) for k in rng.integers(10, 40, n)]
    kws = [dict(max_tokens=int(rng.integers(20, 32)), temperature=0.8 if i % 4 == 0 else 0,
                seed=i, extra_body={"ignore_eos": True}) for i in range(n)]
    alone = [_ids(_complete(server, p, **kw)) for p, kw in zip(prompts, kws, strict=True)]
    before = small.metrics()["jaxinfer_num_preemptions_total"]
    with ThreadPoolExecutor(n) as pool:
        together = list(pool.map(lambda i: _ids(_complete(small, prompts[i], **kws[i])),
                                 range(n)))
    assert small.metrics()["jaxinfer_num_preemptions_total"] > before
    assert together == alone
    m = small.metrics()
    assert m["jaxinfer_kv_pages_total"] == SMALL_PAGES
    assert m["jaxinfer_requests_total{finish_reason=length}"] >= n


def test_metrics_after_load(server):
    _complete(server, [5, 6, 7], max_tokens=5, extra_body={"ignore_eos": True})
    m = server.metrics()
    assert m["jaxinfer_time_to_first_token_seconds_count"] > 0
    assert m["jaxinfer_inter_token_latency_seconds_count"] > 0
    assert m["jaxinfer_generation_tokens_total"] >= 5
    assert m["jaxinfer_generation_tokens_per_second"] > 0
    assert m["jaxinfer_kv_pages_total"] == 512
    assert m["jaxinfer_requests_total{finish_reason=length}"] > 0
    assert "jaxinfer_num_preemptions_total" in m


# -- disconnects -----------------------------------------------------------------------------


LONG_PROMPT, LONG_MAX_TOKENS = [7, 8, 9], 250


def _long_body(server: Server, stream: bool) -> dict:
    return {"model": server.name, "prompt": LONG_PROMPT, "max_tokens": LONG_MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def _check_aborted(server: Server, before: dict):
    """The request was aborted (not run to its end) and its pages are free again."""
    m = server.wait_idle()
    key = "jaxinfer_requests_total{finish_reason=abort}"
    assert m[key] == before.get(key, 0) + 1
    computed = m["jaxinfer_computed_tokens_total"] - before["jaxinfer_computed_tokens_total"]
    assert computed < len(LONG_PROMPT) + LONG_MAX_TOKENS - 1  # what running to the end takes


def test_client_disconnect_mid_stream_frees_pages(server):
    before = server.metrics()
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions",
                         json=_long_body(server, True)) as resp:
            assert resp.status_code == 200
            chunks = 0
            for line in resp.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    m = server.metrics()
                    assert m["jaxinfer_num_requests_running"] == 1
                    assert m["jaxinfer_kv_pages_in_use"] > 0
                    break  # closes the connection mid-stream (httpcore drops it)
    _check_aborted(server, before)


def test_client_disconnect_while_waiting_frees_pages(server):
    before = server.metrics()
    # The client gives up long before 250 tokens can be generated.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=_long_body(server, False), timeout=0.1)
    _check_aborted(server, before)


# -- bad requests ----------------------------------------------------------------------------


def _bad_cases(server: Server) -> list[tuple[str, dict, int, str]]:
    """(path, httpx.post kwargs, status, a piece of the expected message)."""
    m = server.name

    def body(**kw):
        return {"json": {"model": m, "prompt": "hi", "max_tokens": 4, **kw}}

    chat = "/v1/chat/completions"
    return [
        ("/v1/completions", {"content": b'{"prompt": "hi", ', "headers": {
            "content-type": "application/json"}}, 400, "not valid JSON"),
        ("/v1/completions", {"content": b'{"prompt": "\xff\xfe"}', "headers": {
            "content-type": "application/json"}}, 400, "not valid UTF-8"),
        ("/v1/completions", {"content": b"", "headers": {"content-type": "application/json"}},
         400, "body"),
        ("/v1/completions", {"content": b"[1, 2]", "headers": {
            "content-type": "application/json"}}, 400, "JSON object"),
        ("/v1/completions", body(model="no-such-model"), 404, "'no-such-model' does not exist"),
        ("/v1/completions", body(max_tokens=-1), 400, "max_tokens=-1"),
        ("/v1/completions", body(max_tokens=0), 400, "max_tokens=0"),
        ("/v1/completions", body(max_tokens=10**12), 400, "max_tokens=1000000000000"),
        ("/v1/completions", body(prompt=[5] * 300), 400, "max_model_len"),
        ("/v1/completions", body(prompt="printing " * 400), 400, "max_model_len"),
        ("/v1/completions", body(prompt=[5, VOCAB + 7]), 400, f"token id {VOCAB + 7}"),
        ("/v1/completions", body(prompt=[]), 400, "empty"),
        ("/v1/completions", body(prompt=["a", "b"]), 400, "prompt"),
        ("/v1/completions", body(temperature="hot"), 400, "temperature"),
        ("/v1/completions", body(temperature=-1), 400, "temperature=-1"),
        ("/v1/completions", body(top_p=0), 400, "top_p=0"),
        ("/v1/completions", body(logprobs=21), 400, "logprobs=21"),
        ("/v1/completions", body(n=2), 400, "n=2"),
        ("/v1/completions", body(echo=True), 400, "echo"),
        ("/v1/completions", body(stop=[""]), 400, "stop"),
        ("/v1/completions", body(stream_options={"include_usage": True}), 400,
         "stream_options"),
        ("/v1/completions", {"json": {"model": m}}, 400, "prompt: Field required"),
        (chat, {"json": {"model": m, "messages": []}}, 400, "messages"),
        (chat, {"json": {"model": m}}, 400, "messages: Field required"),
        (chat, {"json": {"model": m, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}}, 400, "image_url"),
        (chat, {"json": {"model": m, "messages": [{"role": "user", "content": "hi"}],
                         "top_logprobs": 2}}, 400, "top_logprobs"),
        (chat, {"json": {"model": m, "messages": [{"role": "user", "content": "hi"}],
                         "max_completion_tokens": -3}}, 400, "max_completion_tokens=-3"),
        ("/v1/nope", body(), 404, "/v1/nope"),
    ]


def test_bad_requests_get_4xx_and_the_server_goes_on(server):
    for path, kwargs, status, piece in _bad_cases(server):
        resp = httpx.post(f"{server.url}{path}", timeout=30, **kwargs)
        assert resp.status_code == status, (path, kwargs, resp.text)
        err = resp.json()["error"]
        assert piece in err["message"], (piece, err)
        assert "\n" not in err["message"] and err["type"] == "invalid_request_error"
        # The next valid request is answered.
        ok = _complete(server, [5, 6], max_tokens=2)
        assert len(_ids(ok)) >= 1
    assert httpx.post(f"{server.url}/v1/completions", timeout=30,
                      **_bad_cases(server)[4][1]).json()["error"]["code"] == "model_not_found"
    # The openai client sees them as its typed errors.
    with pytest.raises(openai.BadRequestError, match="max_tokens=-1"):
        server.client.completions.create(model=server.name, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="other", prompt="hi", max_tokens=2)


def test_api_key(small):
    url = f"{small.url}/v1/models"
    assert httpx.get(url, timeout=30).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=30).json()["data"][0]["id"] == small.name
    assert httpx.get(f"{small.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{small.url}/metrics", timeout=30).status_code == 200
    bad = openai.OpenAI(base_url=f"{small.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=small.name, prompt=[5, 6], max_tokens=2)
    assert small.client.models.list().data[0].id == small.name


def test_models_endpoint(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == ["tiny-qwen3"]
    assert models[0].model_extra["max_model_len"] == 256


# -- in-process: the engine thread failing, and the CLI ---------------------------------------


class _FakeRequest:
    def __init__(self, rid, prompt_ids, params):
        self.id, self.prompt_ids, self.params = rid, prompt_ids, params
        self.output_ids, self.finish_reason, self.stop_reason = [], None, None

    @property
    def finished(self):
        return self.finish_reason is not None


class _FakeEngine(EngineInterface):
    """Counts up from the prompt's last token; a prompt containing 13 makes step() raise."""

    max_model_len, max_num_seqs, max_num_batched_tokens, decode_steps = 64, 8, 64, 1

    def __init__(self):
        self._running: list[_FakeRequest] = []
        self._next = 0

    @property
    def runners(self):
        return []

    @property
    def waiting(self):
        return []

    @property
    def running(self):
        return self._running

    @property
    def last_batch(self):
        return []

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), num_pages=8, num_free_pages=8)

    def logits(self, prompts):
        raise NotImplementedError("the server does not call it")

    def validate(self, prompt_ids, params):
        pass

    def add_request(self, prompt_ids, params):
        req = _FakeRequest(self._next, prompt_ids, params)
        self._next += 1
        self._running.append(req)
        return req

    def has_unfinished(self):
        return bool(self._running)

    def step(self):
        if any(13 in r.prompt_ids for r in self._running):
            raise RuntimeError("boom")
        deltas = []
        for r in list(self._running):
            r.output_ids.append((r.prompt_ids + r.output_ids)[-1] + 1)
            if len(r.output_ids) >= r.params.max_tokens:
                r.finish_reason = "length"
                self._running.remove(r)
            deltas.append(RequestDelta(r, r.output_ids[-1:], "", None, r.finished))
        return deltas

    def abort(self, req):
        if req in self._running:
            self._running.remove(req)
        req.finish_reason = req.finish_reason or "abort"


def test_engine_failure_is_a_500_and_the_server_goes_on():
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    llm = SimpleNamespace(engine=_FakeEngine(), tokenizer=None, max_model_len=64)
    with TestClient(create_app(llm, "fake")) as http:
        ok = http.post("/v1/completions", json={"prompt": [3], "max_tokens": 3,
                                                "return_token_ids": True})
        assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == [4, 5, 6]
        bad = http.post("/v1/completions", json={"prompt": [13], "max_tokens": 3})
        assert bad.status_code == 500, bad.text
        assert bad.json()["error"]["type"] == "server_error"
        assert "boom" in bad.json()["error"]["message"]
        with http.stream("POST", "/v1/completions",
                         json={"prompt": [13], "max_tokens": 3, "stream": True}) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: {")]
        assert "boom" in events[-1]["error"]["message"]
        again = http.post("/v1/completions", json={"prompt": [3], "max_tokens": 2,
                                                   "return_token_ids": True})
        assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == [4, 5]
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics").text
        assert 'jaxinfer_requests_total{finish_reason="error"} 2.0' in metrics
        # Chat needs a tokenizer: a clear 400, not a crash.
        chat = http.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "no tokenizer" in chat.json()["error"]["message"]


def test_serve_cli_errors(qwen3_converted):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["serve", "--model", str(qwen3_converted), "--port",
                                          str(port), "--no-warmup"])
    assert result.exit_code == 1
    assert "cannot listen there" in result.output and str(port) in result.output
    result = CliRunner().invoke(cli, ["serve", "--model", "x", "--preset", "tiny"])
    assert result.exit_code == 1 and "give one, not both" in result.output


def test_health_answers_during_warmup_and_nothing_compiles_after_ready(qwen3_converted,
                                                                         tmp_path):
    """A warming-up server answers /health (503, with progress) and generation requests (503,
    Retry-After) instead of refusing connections; once ready, a request whose context grows
    from 20 to 1100 tokens (across what were page-table buckets at 512 and 1024 tokens),
    then prompts sent together (batched prefills, prompts beside decodes, chunked) run on
    programs the warm-up made: no step program is compiled after ready, on demand or
    otherwise."""
    log = tmp_path / "warm.log"
    proc = _start(qwen3_converted, log, 128, "--max-num-seqs", "4", "--max-num-batched-tokens",
                  "64", "--max-model-len", "2048", warmup=True,
                  env={"JAXINFER_EXECUTABLE_CACHE": str(tmp_path / "executables")})
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"warming up on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        url = m.group(1)
        health = httpx.get(f"{url}/health", timeout=60)  # waits in the backlog if need be
        assert health.status_code == 503, health.text
        body = health.json()
        assert body["status"] == "warming up" and body["programs_compiled"] < 7
        early = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert early.status_code == 503 and early.headers["retry-after"]
        assert early.json()["error"]["code"] == "warming_up"
        server = _wait_ready(proc, log, None)
        assert httpx.get(f"{url}/health").json() == {"status": "ready"}
        before = server.metrics()
        # Token buckets 1, 2, 4, ..., 64, at the one page table of 2048 tokens, and the
        # draws of 1, 2 and 4 sequence slots (the batches that sample, below), with and
        # without the filters.
        assert before["jaxinfer_step_programs_compiled_total"] == 7 + 2 * 3
        rng = np.random.default_rng()
        prompt = rng.integers(2, VOCAB, 20).tolist()
        out = server.client.completions.create(model=str(qwen3_converted), prompt=prompt,
                                               max_tokens=1080, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 1080  # context 20 -> 1100

        def complete(n):
            return server.client.completions.create(
                model=str(qwen3_converted), prompt=rng.integers(2, VOCAB, n).tolist(),
                max_tokens=24, temperature=0.7, extra_body={"ignore_eos": True})

        # 85 prompt tokens against a 64-token budget: prefills batched, chunked, and beside
        # the others' decodes.
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(complete, [25, 50, 10]))
        assert [o.usage.completion_tokens for o in outs] == [24, 24, 24]
        after = server.wait_idle()
        assert after["jaxinfer_step_programs_compiled_on_demand_total"] == 0
        assert after["jaxinfer_step_programs_compiled_total"] == 7 + 2 * 3
    finally:
        proc.terminate()
        proc.wait(30)
