"""The OpenAI-compatible HTTP server (`jaxinfer serve`): a FastAPI app over one engine.

The engine is not thread-safe, so one background thread (`EngineBridge`) owns it:
request handlers (on the asyncio loop) send it "add" and "abort" commands through
a thread-safe queue, and it runs `engine.step()` while there is work, handing each
RequestDelta to its request's asyncio.Queue with `loop.call_soon_threadsafe`; when
idle it sleeps on an Event. A client that goes away aborts its request, so its KV
pages are freed: streaming responses are cancelled by starlette when the client
disconnects, and non-streaming handlers watch for the ASGI `http.disconnect` message
while they wait. If a step raises, the requests in flight fail with a 500 and the engine
thread carries on with the next ones.

Start-up: the HTTP side answers from the moment uvicorn runs, while the engine thread
first warms up (compiles or loads the step programs, `LLM.warmup`). Until it is done
`/health` answers 503 with the progress (`Readiness`) and `/v1/completions` and
`/v1/chat/completions` answer 503 with Retry-After, so that load balancers and OpenAI
clients (which retry a 503) wait instead of meeting a refused connection or a stall.

Errors are OpenAI-style bodies: 400 for invalid requests (including what FastAPI
would answer with 422, and JaxinferError from SamplingParams or the engine's
validation), 401 for a wrong API key, 404 for an unknown model or route, 500 for
anything unexpected (logged).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxinfer.engine.engine import heap_frozen
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.weights import active_weight_count, step_reads, weight_bytes, weight_count
from jaxinfer.serving.metrics import Metrics
from jaxinfer.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    chat_logprobs,
    error_body,
    new_id,
    now,
    usage,
)

if TYPE_CHECKING:
    from jaxinfer.engine.engine import EngineInterface

log = logging.getLogger("jaxinfer.serving.server")


class EngineFailure(Exception):
    """The engine raised while this request was in flight."""


# -- the engine thread -----------------------------------------------------------------------


class _Handle:
    """One request as the server sees it: its deltas arrive on `queue` (asyncio side)."""

    def __init__(self, prompt_ids: list[int], params, loop: asyncio.AbstractEventLoop):
        self.prompt_ids, self.params, self.loop = prompt_ids, params, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.request = None  # the engine's Request; set and used by the engine thread only
        self.last_delta: float | None = None  # engine thread only
        self.finished = False  # set on the asyncio side once the last delta is taken

    def put(self, item):
        """A RequestDelta, or an exception to raise in the handler (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed (shutting down): nobody is waiting
            pass

    async def get(self):
        """The next RequestDelta; raises the error put in its place (the request is then
        not `finished`: aborting it is the caller's job, and a no-op if the engine dropped it)."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self.finished = item.finished
        return item

    async def deltas(self) -> AsyncIterator:
        """The request's RequestDeltas until the finished one."""
        while not self.finished:
            yield await self.get()


class Readiness:
    """Where start-up is: "warming up" (programs done of total), "ready", or "failed"."""

    def __init__(self, warming_up: bool):
        self.state = "warming up" if warming_up else "ready"
        self.done = self.total = 0
        self.error: str | None = None

    def progress(self, done: int, total: int):
        self.done, self.total = done, total

    def body(self) -> dict:
        body = {"status": self.state}
        if self.state != "ready":
            body.update(programs_compiled=self.done, programs_total=self.total)
        if self.error:
            body["error"] = self.error
        return body


class EngineBridge:
    """Owns the engine on one thread; handlers talk to it with `new` + `submit`, and `abort`.

    warmup(on_progress) (e.g. `LLM.warmup`) runs on that thread before anything else;
    on_ready() is called once it is done."""

    def __init__(self, engine: EngineInterface, metrics: Metrics,
                 warmup: Callable[[Callable[[int, int], None]], object] | None = None,
                 on_ready: Callable[[], None] | None = None):
        self.engine, self.metrics = engine, metrics
        self.readiness = Readiness(warmup is not None)
        self._warmup, self._on_ready = warmup, on_ready
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, _Handle] = {}  # engine request id -> handle (engine thread)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)

    def start(self):
        self.metrics.snapshot = self.engine.stats()
        self._thread.start()

    def stop(self, timeout: float = 10.0):
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def new(self, prompt_ids: list[int], params) -> _Handle:
        """A handle for a (validated) request, arriving now; call from the asyncio loop."""
        return _Handle(prompt_ids, params, asyncio.get_running_loop())

    def submit(self, handle: _Handle):
        """Queues the request for the engine."""
        self._send(("add", handle))

    def abort(self, handle: _Handle):
        """Aborts the request (if still running) and frees its pages."""
        self._send(("abort", handle))

    def _send(self, command):
        self._commands.put(command)
        self._wake.set()

    # Everything below runs on the engine thread.

    def _start_up(self) -> bool:
        if self._warmup is not None:
            try:
                self._warmup(self.readiness.progress)
            except Exception as e:
                log.exception("warm-up failed")
                self.readiness.state, self.readiness.error = "failed", f"warm-up failed: {e}"
                return False
            self.readiness.state = "ready"
            self.metrics.snapshot = self.engine.stats()
        if self._on_ready is not None:
            self._on_ready()
        return True

    def _run(self):
        if not self._start_up():
            return
        with heap_frozen():  # the model and programs, made by now
            self._serve()
        self._fail_all(EngineFailure("the server is shutting down"))

    def _serve(self):
        while not self._stopping:
            self._wake.clear()  # before draining: a command sent after this sets it again
            try:
                self._drain_commands()
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                self.metrics.snapshot = self.engine.stats()
            except Exception as e:
                log.exception("the engine failed; failing the requests in flight")
                self._fail_all(e)
                continue
            if not self.engine.has_unfinished():
                self._wake.wait()

    def _drain_commands(self):
        while True:
            try:
                op, handle = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if op == "add":
                    self._add(handle)
                elif handle.request is not None and self._live.pop(handle.request.id, None):
                    self.engine.abort(handle.request)
                    self.metrics.on_finish("abort")
            except Exception as e:
                log.exception("engine %s failed", op)
                handle.put(e if isinstance(e, JaxinferError) else EngineFailure(str(e)))

    def _add(self, handle: _Handle):
        handle.request = self.engine.add_request(handle.prompt_ids, handle.params)
        self._live[handle.request.id] = handle
        self.metrics.on_request(len(handle.prompt_ids))

    def _deliver(self, deltas):
        t = time.monotonic()
        for delta in deltas:
            handle = self._live.get(delta.request.id)
            if handle is None:
                continue  # aborted in the meantime
            self.metrics.on_delta(handle.arrival, handle.last_delta, len(delta.token_ids), t)
            if delta.token_ids:
                handle.last_delta = t
            handle.put(delta)
            if delta.finished:
                del self._live[delta.request.id]
                self.metrics.on_finish(delta.request.finish_reason or "stop")

    def _fail_all(self, error: Exception):
        failure = error if isinstance(error, EngineFailure) else EngineFailure(
            f"the engine failed: {type(error).__name__}: {error}")
        for handle in self._live.values():
            handle.put(failure)
            self.metrics.on_finish("error")
        self._live.clear()
        # Drop whatever the engine still holds, so the next requests start clean.
        for req in [*self.engine.waiting, *self.engine.running]:
            try:
                self.engine.abort(req)
            except Exception:
                log.exception("aborting request %s after the failure", req.id)


# -- the app -----------------------------------------------------------------------------------


class _APIKeyMiddleware:
    """Bearer-token auth for /v1/*; /health and /metrics stay open. (A pure ASGI middleware,
    so auth is checked before the body is read, and streaming is untouched.)"""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                response = JSONResponse(error_body(
                    "invalid or missing API key (send the header 'Authorization: Bearer "
                    "<key>')", code="invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Server:
    """What the handlers share: the model, its name, the bridge and the metrics."""

    def __init__(self, llm, model_name: str, bridge: EngineBridge, metrics: Metrics):
        self.llm, self.model_name, self.bridge, self.metrics = llm, model_name, bridge, metrics
        self.tokenizer = llm.tokenizer
        self.created = now()

    def check_model(self, model: str | None):
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist (this server serves "
                           f"{self.model_name!r})", "model", "model_not_found")

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer; send token ids",
                           "prompt")
        return self.tokenizer.encode(prompt)

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (so no chat template); use "
                           "/v1/completions with token ids", "messages")
        return self.llm.chat_prompt(body.template_messages())

    def params(self, body, prompt_ids: list[int], max_tokens: int | None,
               logprobs: int | None):
        """SamplingParams for the request, checked against the engine (JaxinferError -> 400)."""
        context = self.llm.max_model_len
        room = context - len(prompt_ids)
        params = body.sampling_params(max_tokens if max_tokens is not None else max(room, 1),
                                      logprobs)
        if max_tokens is not None and max_tokens > room >= 1:  # room < 1: validate says why
            raise APIError(400, f"max_tokens={max_tokens}: the prompt's {len(prompt_ids)} "
                           f"tokens plus max_tokens exceed the model's context "
                           f"(max_model_len={context}); at most {room} new tokens fit",
                           "max_tokens")
        self.llm.engine.validate(prompt_ids, params)
        return params

    async def generate(self, handle: _Handle, request: Request) -> list:
        """All deltas of a non-streaming request; aborts it if the client goes away."""

        async def watch():
            # The body is read, so the next ASGI message is http.disconnect: it comes when
            # the client goes away (or once the response is sent).
            while (await request.receive())["type"] != "http.disconnect":
                pass
            handle.put(_ClientGone())

        watcher = asyncio.create_task(watch())
        try:
            return [d async for d in handle.deltas()]
        finally:
            watcher.cancel()
            if not handle.finished:
                self.bridge.abort(handle)


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _finish_fields(req) -> dict:
    return {"finish_reason": req.finish_reason, "stop_reason": req.stop_reason}


async def _event_stream(server: _Server, handle: _Handle, chunks) -> AsyncIterator[str]:
    """SSE text for a streaming request: `chunks` turns deltas into chunk dicts. The request
    is submitted here, once the response streams (starlette may cancel the response before
    it starts, when the client is already gone), and aborted if this is cancelled (starlette
    cancels it when the client disconnects)."""
    server.bridge.submit(handle)
    try:
        async for chunk in chunks:
            yield _sse(chunk)
    except EngineFailure as e:
        yield _sse(error_body(str(e), "server_error"))
    except JaxinferError as e:
        yield _sse(error_body(str(e)))
    finally:
        if not handle.finished:
            server.bridge.abort(handle)
    yield "data: [DONE]\n\n"


async def _completion_chunks(server: _Server, body: CompletionRequest, handle: _Handle,
                             rid: str):
    created, lp = now(), CompletionLogprobs(server.token_text)
    base = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}
    num_out = 0
    async for d in handle.deltas():
        num_out += len(d.token_ids)
        if not (d.text or d.finished or d.logprobs or body.return_token_ids):
            continue  # nothing to show for this delta (text held back or incomplete)
        choice = {"index": 0, "text": d.text,
                  "logprobs": lp.add(d.logprobs) if d.logprobs is not None else None,
                  "finish_reason": None}
        if body.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
        if d.finished:
            choice.update(_finish_fields(d.request))
        chunk = {**base, "choices": [choice]}
        if body.include_usage:
            chunk["usage"] = None
        yield chunk
    if body.include_usage:
        yield {**base, "choices": [], "usage": usage(len(handle.prompt_ids), num_out)}


async def _chat_chunks(server: _Server, body: ChatCompletionRequest, handle: _Handle, rid: str):
    created = now()
    base = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": server.model_name}
    extra = {"usage": None} if body.include_usage else {}
    yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}], **extra}
    num_out = 0
    async for d in handle.deltas():
        num_out += len(d.token_ids)
        if not (d.text or d.finished or d.logprobs or body.return_token_ids):
            continue  # nothing to show for this delta (text held back or incomplete)
        choice = {"index": 0, "delta": {"content": d.text} if d.text else {},
                  "logprobs": chat_logprobs(d.logprobs, server.token_text)
                  if d.logprobs is not None else None, "finish_reason": None}
        if body.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
        if d.finished:
            choice.update(_finish_fields(d.request))
        yield {**base, "choices": [choice], **extra}
    if body.include_usage:
        yield {**base, "choices": [], "usage": usage(len(handle.prompt_ids), num_out)}


def _stream_response(server, handle, chunks) -> StreamingResponse:
    return StreamingResponse(_event_stream(server, handle, chunks),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _collected(deltas, with_logprobs: bool) -> tuple[str, list[int], list | None, object]:
    """Text, token ids, TokenLogprobs (if asked for) and the engine Request of a request's
    deltas (the last one finished)."""
    text = "".join(d.text for d in deltas)
    ids = [t for d in deltas for t in d.token_ids]
    lps = [e for d in deltas for e in (d.logprobs or [])] if with_logprobs else None
    return text, ids, lps, deltas[-1].request


def _model_info(llm) -> dict[str, float]:
    """The model's sizes for /metrics; `jaxinfer bench serve` computes its decode floor from
    them (the step_reads_* fields: `jaxinfer.loading.weights.StepReads`)."""
    c, kv = llm.config, llm.runner.kv_avals[0][0]
    return {"weight_bytes": weight_bytes(llm.model), "weight_count": weight_count(llm.model),
            "active_weight_count": active_weight_count(llm.model),
            **step_reads(llm.model).as_info(),
            "vocab_size": c.vocab_size,
            "max_len": llm.max_model_len,
            "kv_bytes_per_token": c.kv_bytes_per_token(kv.dtype.itemsize)}


def create_app(llm, model_name: str, api_key: str | None = None,
               model_info: dict[str, float] | None = None, warmup: bool = False,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The app for an LLM; its lifespan starts and stops the engine thread, which warms up
    first if asked (the app answers 503 until then) and then calls on_ready(). model_info
    (the model's sizes) is published in /metrics."""
    metrics = Metrics(model_info)
    bridge = EngineBridge(
        llm.engine, metrics,
        (lambda progress: llm.warmup(progress=False, on_progress=progress)) if warmup else None,
        on_ready)
    server = _Server(llm, model_name, bridge, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        bridge.start()
        try:
            yield
        finally:
            bridge.stop()

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.server = server
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    def error(status: int, message: str, type: str = "invalid_request_error",
              param: str | None = None, code: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, type, param, code), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        headers = {"Retry-After": "2"} if e.code == "warming_up" else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(JaxinferError)
    async def _jaxinfer_error(request: Request, e: JaxinferError):
        return error(400, " ".join(str(e).split()))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error(400, _validation_message(e.errors()), param=_validation_param(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = str(e.detail)
        if isinstance(e.__cause__, UnicodeDecodeError):
            u = e.__cause__
            message = (f"the request body is not valid UTF-8 (byte 0x{u.object[u.start]:02x} "
                       f"at offset {u.start})")
        elif e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error(e.status_code, message, code=None if e.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        # Starlette re-raises the exception after this response, and uvicorn logs it.
        return error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    def check_ready():
        """A 503 (with Retry-After) for generation requests until warm-up is done."""
        r = bridge.readiness
        if r.state == "ready":
            return
        message = (f"the server is warming up ({r.done} of {r.total or '?'} step programs "
                   "compiled); retry shortly" if r.state == "warming up"
                   else f"the server cannot serve: {r.error}")
        raise APIError(503, message, code="warming_up" if r.state == "warming up"
                       else "server_error", type="server_error")

    @app.get("/health")
    async def health():
        r = bridge.readiness
        if r.state == "ready" and not bridge.is_alive():
            return error(503, "the engine thread is not running", "server_error")
        return JSONResponse(r.body(), status_code=200 if r.state == "ready" else 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        return PlainTextResponse(metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": server.created,
            "owned_by": "jaxinfer", "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_ready()
        body.check_supported()
        server.check_model(body.model)
        prompt_ids = server.prompt_ids(body.single_prompt())
        params = server.params(body, prompt_ids, body.max_tokens, body.logprobs)
        handle = bridge.new(prompt_ids, params)
        rid = new_id("cmpl")
        if body.stream:
            return _stream_response(server, handle, _completion_chunks(server, body, handle, rid))
        deltas = await _run(server, handle, request)
        if isinstance(deltas, Response):
            return deltas
        text, ids, lps, req = _collected(deltas, params.logprobs is not None)
        choice = {"index": 0, "text": text,
                  "logprobs": CompletionLogprobs(server.token_text).add(lps)
                  if lps is not None else None, **_finish_fields(req)}
        if body.return_token_ids:
            choice.update(prompt_token_ids=prompt_ids, token_ids=ids)
        return {"id": rid, "object": "text_completion", "created": now(), "model": model_name,
                "choices": [choice], "usage": usage(len(prompt_ids), len(ids))}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_ready()
        body.check_supported()
        server.check_model(body.model)
        prompt_ids = server.chat_ids(body)
        params = server.params(body, prompt_ids, body.requested_max_tokens, body.num_logprobs)
        handle = bridge.new(prompt_ids, params)
        rid = new_id("chatcmpl")
        if body.stream:
            return _stream_response(server, handle, _chat_chunks(server, body, handle, rid))
        deltas = await _run(server, handle, request)
        if isinstance(deltas, Response):
            return deltas
        text, ids, lps, req = _collected(deltas, params.logprobs is not None)
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": chat_logprobs(lps, server.token_text) if lps is not None else None,
                  **_finish_fields(req)}
        if body.return_token_ids:
            choice.update(prompt_token_ids=prompt_ids, token_ids=ids)
        return {"id": rid, "object": "chat.completion", "created": now(), "model": model_name,
                "choices": [choice], "usage": usage(len(prompt_ids), len(ids))}

    return app


async def _run(server: _Server, handle: _Handle, request: Request) -> list | Response:
    """Deltas of a non-streaming request, or the response for a failure / a client gone."""
    server.bridge.submit(handle)
    try:
        return await server.generate(handle, request)
    except EngineFailure as e:
        return JSONResponse(error_body(str(e), "server_error", code="server_error"),
                            status_code=500)
    except _ClientGone:
        return Response(status_code=499)  # nobody reads it


def _validation_param(errors) -> str | None:
    """The first error's field as a dotted path (None: the body as a whole)."""
    if not errors or errors[0].get("type") == "json_invalid":
        return None
    loc = [str(x) for x in errors[0].get("loc", ()) if x != "body"]
    return ".".join(loc) or None


def _validation_message(errors) -> str:
    """One line for pydantic/FastAPI errors: the first error's field, problem and value."""
    if not errors:
        return "invalid request"
    e = errors[0]
    if e.get("type") == "json_invalid":
        pos = e["loc"][-1] if e.get("loc") else "?"
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error')} at " \
               f"character {pos})"
    field = _validation_param(errors)
    if field is None:  # the body as a whole
        if e.get("type") == "missing":
            return "the request body is empty; send a JSON object"
        return (f"the request body must be a JSON object (Content-Type: application/json): "
                f"{e.get('msg')}")
    message = f"{field}: {e.get('msg')}"
    if e.get("type") != "missing" and "input" in e:
        shown = repr(e["input"])
        message += f" (got {shown[:80] + '...' if len(shown) > 80 else shown})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message


def run_server(llm, model_name: str, sock, api_key: str | None = None,
               log_level: str = "info", warmup: bool = False,
               on_ready: Callable[[], None] | None = None):
    """Serves the app on an already bound socket until interrupted (warming up first, in
    the background, if asked; on_ready() once ready)."""
    import uvicorn

    app = create_app(llm, model_name, api_key, _model_info(llm), warmup, on_ready)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
