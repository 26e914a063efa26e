"""OpenAI-compatible HTTP server over the SSSD engine (FastAPI).

Endpoints: POST /v1/completions and /v1/chat/completions (streaming as
server-sent events in OpenAI's chunk format, or one JSON response),
GET /v1/models, GET|HEAD /health, GET /metrics (Prometheus text format, with
vLLM-compatible speculative-decoding counter names). With `admin` (`sssd serve
--enable-admin`), the datastores drafting can change while the server runs:
GET /v1/admin/datastores lists them, POST /v1/admin/datastores {"path", "name"?}
opens, checks and adds one (a server-side path), DELETE
/v1/admin/datastores/{name} removes an added one.

Every error is OpenAI's body {"error": {"message", "type", "param", "code"}}
with its status: 400 invalid request (bad parameters, malformed JSON, a
prompt or max_tokens that does not fit the context), 401 missing or wrong
API key, 404 unknown model, path or datastore, 405 wrong method, 409 a
datastore change that conflicts (name taken, the primary datastore, no
speculation), 413 request body too large, 429 queue full and 503 shutting down (both with Retry-After), 500 the
request failed inside the engine, 504 request timeout. A streamed request
that fails after its first chunk ends with an error event, then [DONE].

With an API key, every endpoint requires it except /health (for load
balancers' probes) and, when asked (`public_metrics`), /metrics. The key is
compared in constant time. Both middlewares are plain ASGI, so a client's
disconnect reaches the handlers (a non-streaming request whose client went
away is aborted and frees its batch slot).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from sssd.serving.engine import ContextLengthExceeded
from sssd.serving.engine.params import SamplingParams
from sssd.serving.frontends.async_engine import AsyncEngine, ShuttingDown
from sssd.serving.frontends.prometheus import render_metrics

log = logging.getLogger("sssd.serving")

#: Request bodies above this are refused with 413 (a 10 MB prompt still fits).
MAX_BODY_BYTES = 32 * 2**20


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = (
            status,
            message,
            type_,
            param,
            code,
            headers,
        )


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


# -- ASGI middleware -------------------------------------------------------------------


async def _send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    hdrs += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})


class AuthMiddleware:
    """Requires 'Authorization: Bearer KEY' on every path but the public ones (constant-time compare)."""

    def __init__(self, app, api_key: str, public: frozenset[str]):
        self.app, self.public = app, public
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.public:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await _send_json(
                    send,
                    401,
                    error_body(
                        "invalid or missing API key (Authorization: Bearer ...)",
                        "authentication_error",
                        code="invalid_api_key",
                    ),
                    {"www-authenticate": "Bearer"},
                )
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses request bodies above `limit` bytes with 413, whether announced or streamed.

    The body is read here (bounded) and handed on whole; after it, the app reads the
    client's own messages, so disconnects still reach it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = error_body(
            f"the request body exceeds {self.limit:,} bytes", "invalid_request_error", code="request_too_large"
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _send_json(send, 413, too_large)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                return await _send_json(send, 413, too_large)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# -- request bodies ---------------------------------------------------------------------


class _Common(BaseModel):
    # Fields OpenAI clients send that we accept and ignore (user, ...) are allowed;
    # options we cannot honour are refused explicitly below. NaN and infinities are refused.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    ignore_eos: bool = False
    stream_options: dict | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class DatastoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096)  # on the server's disk
    name: str | None = None


def _reason(e: BaseException) -> str:
    """An error's message for a client: an OSError without its "[Errno N]"."""
    if isinstance(e, OSError) and type(e).__str__ is OSError.__str__ and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename is not None else e.strerror
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return str(e) or type(e).__name__


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'malformed')})", None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if not loc:
        return f"invalid request body: {first.get('msg', 'malformed body')} (expected a JSON object)", None
    # OpenAI's param is the top-level field; pydantic's path below it names union members
    return f"invalid request: {loc[0]}: {first.get('msg', 'invalid value')}", loc[0]


def create_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    request_timeout: float = 600.0,
    max_tokens_default: int = 256,
    public_metrics: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
    drain_timeout: float = 10.0,
    admin: bool = False,
) -> FastAPI:
    """The server's ASGI app.

    Args:
        api_key: require it as a Bearer token (None: open).
        public_metrics: with an API key, still serve /metrics without it (for a Prometheus scraper).
        drain_timeout: on shutdown, seconds running requests may take to finish before they
            are cut off (with an error event for streams, 503 for the others).
        admin: serve /v1/admin/datastores (list, add, remove datastores at run time); they open
            paths on the server's disk, so they exist only when asked for (SECURITY.md).
    """
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()
        engine.start()
        yield
        await engine.shutdown(grace=drain_timeout)

    app = FastAPI(title="SSSD", version="1", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine = engine
    created = int(time.time())

    def begin_drain() -> None:
        """Called from a signal handler: stop admitting now, drain in the background."""
        loop = getattr(app.state, "loop", None)
        if loop is not None and engine.accepting:
            engine.accepting = False
            loop.call_soon_threadsafe(lambda: loop.create_task(engine.shutdown(grace=drain_timeout)))

    app.state.begin_drain = begin_drain

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        message, param = _validation_message(e)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        message = {
            404: f"no such endpoint: {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, message, kind, headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
        return error_response(APIError(500, "internal server error (see the server log)", "server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request):
        if not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {
            "status": "ok",
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            **engine.machine_status(),
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "sssd"}],
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    def check_common(req: _Common, max_tokens: int | None) -> SamplingParams:
        if req.model not in (None, model_name):
            raise APIError(
                404,
                f"The model `{req.model}` does not exist; this server serves `{model_name}`",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        if req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        if req.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if req.presence_penalty or req.frequency_penalty:
            raise APIError(400, "presence and frequency penalties are not supported", param="presence_penalty")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            return SamplingParams(
                max_tokens=max_tokens or max_tokens_default,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop=stop,
                ignore_eos=req.ignore_eos,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def start(prompt, params: SamplingParams, explicit_max_tokens: bool):
        try:
            return await engine.add(prompt, params, clip_max_tokens=not explicit_max_tokens)
        except OverflowError as e:
            raise APIError(
                429, f"{e}; retry later", "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
            ) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": "5"}) from None
        except ContextLengthExceeded as e:
            raise APIError(400, str(e), param="prompt", code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def collect(rid: int, queue: asyncio.Queue, request: Request):
        """Waits for the whole output; aborts on client disconnect or timeout."""
        last = None

        async def consume():
            nonlocal last
            async for out in engine.stream(rid, queue):
                last = out

        task = asyncio.create_task(consume())
        deadline = time.monotonic() + request_timeout
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
            if time.monotonic() > deadline:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(504, f"the request timed out after {request_timeout:g} s", "timeout", code="timeout")
            await asyncio.wait({task}, timeout=0.1)
        task.result()
        check_failed(last)
        return last

    def check_failed(out) -> None:
        """A non-streaming request that ended in an error or a shutdown is an error response."""
        if out is None or out.finish_reason not in ("error", "shutdown"):
            return
        if out.finish_reason == "shutdown":
            raise APIError(
                503,
                "the server shut down before the request finished",
                "service_unavailable",
                headers={"Retry-After": "5"},
            )
        raise APIError(500, f"the request failed in the engine: {out.error or 'unknown error'}", "server_error")

    def stream_error(out) -> dict | None:
        if out.finish_reason == "error":
            return error_body(f"the request failed in the engine: {out.error or 'unknown error'}", "server_error")
        if out.finish_reason == "shutdown":
            return error_body("the server shut down before the request finished", "service_unavailable")
        return None

    def usage(out) -> dict:
        return {
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(out.token_ids),
            "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
        }

    def finish(out) -> str | None:
        if not out.finished:
            return None
        return "abort" if out.finish_reason in ("abort", "error", "shutdown") else out.finish_reason

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream_response(rid, queue, make_chunk, first_chunk=None, include_usage=False):
        async def events():
            last = None
            deadline = time.monotonic() + request_timeout
            if first_chunk is not None:
                yield sse(first_chunk)
            async for out in engine.stream(rid, queue):
                last = out
                if out.new_text or out.finished:
                    yield sse(make_chunk(out))
                if out.finished and (err := stream_error(out)) is not None:
                    yield sse(err)
                if time.monotonic() > deadline:
                    yield sse(
                        error_body(f"the request timed out after {request_timeout:g} s", "timeout", code="timeout")
                    )
                    break  # leaving the stream aborts the request
            if include_usage and last is not None:
                chunk = make_chunk(last)
                chunk["choices"], chunk["usage"] = [], usage(last)
                yield sse(chunk)
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        params = check_common(req, req.max_tokens)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        rid, queue = await start(prompt, params, "max_tokens" in req.model_fields_set)
        cid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(out):
            return {
                "id": cid,
                "object": "text_completion",
                "created": now,
                "model": model_name,
                "choices": [{"index": 0, "text": out.new_text, "logprobs": None, "finish_reason": finish(out)}],
            }

        if req.stream:
            return stream_response(
                rid, queue, chunk, include_usage=bool((req.stream_options or {}).get("include_usage"))
            )
        out = await collect(rid, queue, request)
        if out is None:
            return Response(status_code=499)  # the client went away (nginx's code); nobody reads it
        return {
            "id": cid,
            "object": "text_completion",
            "created": now,
            "model": model_name,
            "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": finish(out)}],
            "usage": usage(out),
            "sssd": out.stats,
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        params = check_common(req, req.max_completion_tokens or req.max_tokens)
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # OpenAI content parts: text only
                content = "".join(
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                )
            messages.append({"role": m.role, "content": content or ""})
        explicit = bool({"max_tokens", "max_completion_tokens"} & req.model_fields_set)
        rid, queue = await start(messages, params, explicit)
        cid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(out):
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": now,
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": out.new_text} if out.new_text else {},
                        "finish_reason": finish(out),
                    }
                ],
            }

        if req.stream:
            first = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": now,
                "model": model_name,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
            return stream_response(
                rid, queue, chunk, first, include_usage=bool((req.stream_options or {}).get("include_usage"))
            )
        out = await collect(rid, queue, request)
        if out is None:
            return Response(status_code=499)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": now,
            "model": model_name,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": out.text}, "finish_reason": finish(out)}
            ],
            "usage": usage(out),
            "sssd": out.stats,
        }

    if admin:
        _admin_routes(app, engine)
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if api_key:
        public = {"/health"} | ({"/metrics"} if public_metrics else set())
        app.add_middleware(AuthMiddleware, api_key=api_key, public=frozenset(public))
    return app


def _admin_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """The datastore admin endpoints. Adding opens and checks the datastore on a thread while the
    running requests keep stepping; the change itself happens between two steps."""
    from sssd import SSSDError
    from sssd.datastore_source import SourceConflict, check_name

    def conflict(e: SourceConflict) -> APIError:
        return APIError(409, str(e), code="datastore_conflict")

    @app.get("/v1/admin/datastores")
    async def list_datastores():
        return {"object": "list", "data": [dict(d, object="datastore") for d in engine.datastores()]}

    @app.post("/v1/admin/datastores", status_code=201)
    async def add_datastore(req: DatastoreRequest):
        if req.name is not None:
            try:
                check_name(req.name)
            except ValueError as e:
                raise APIError(400, str(e), param="name", code="invalid_name") from None
        try:
            added = await engine.add_datastore(req.path, req.name)
        except SourceConflict as e:
            raise conflict(e) from None
        except (OSError, ValueError, SSSDError) as e:  # missing, corrupt, another tokenizer: refused, nothing changed
            log.warning("datastore %s refused: %s", req.path, _reason(e))
            raise APIError(
                400, f"datastore {req.path} refused: {_reason(e)}", param="path", code="invalid_datastore"
            ) from None
        return dict(added, object="datastore")

    @app.delete("/v1/admin/datastores/{name}")
    async def remove_datastore(name: str):
        try:
            removed = await engine.remove_datastore(name)
        except SourceConflict as e:
            raise conflict(e) from None
        except KeyError:
            raise APIError(
                404,
                f"no added datastore named {name!r} (GET /v1/admin/datastores lists them)",
                "not_found_error",
                code="datastore_not_found",
            ) from None
        return dict(removed, object="datastore", deleted=True)
