"""The coordinator's OpenAI-compatible HTTP API (FastAPI, served by uvicorn in the coordinator's event
loop beside the gRPC server).

``POST /v1/chat/completions`` and ``POST /v1/completions`` build the GenerateRequest a gRPC client
would send (:mod:`coordinator.api.openai_schema`) and run it through
:meth:`CoordinatorServicer.responses`, the path of the gRPC ``Generate`` call: the same validation,
round loop, request store, metrics and traces, and the same error messages. Streamed responses are
server-sent events ending in ``data: [DONE]``. A client that disconnects cancels its request, streamed
or not (both sessions released, as for a cancelled gRPC stream), and so does one that reads nothing of its
stream for ``stream_stall_timeout_s``. ``GET /v1/models`` lists the target and its
``--served-model-name`` aliases; ``GET /health`` is open even with API keys set, as is the OpenAPI
document, ``GET /openapi.json`` (what schema fuzzers and client generators read).

Work is bounded before it is done: a connection's request header must arrive within
``http_header_timeout_s`` and stay within ``http_max_header_bytes`` and ``http_max_headers`` (431),
its body within ``http_body_timeout_s`` of it (408) (:class:`BoundedHttpProtocol`); the API key is
checked before the body is read (:class:`coordinator.api.auth.ApiKeyMiddleware`), a client may have
at most ``http_max_pending_bodies_per_client`` bodies still arriving (429), a body's size is
counted as it is read (413) and a chat's messages before its JSON is decoded (``max_chat_messages``,
400) (:mod:`coordinator.api.body_limit`); a request naming an unknown model is
answered from the names known (:class:`ModelNames`, 404). Idle keep-alive connections close after
``http_keep_alive_timeout_s``, and at most ``http_max_connections`` connections are served (503
beyond, uvicorn's ``limit_concurrency``). JSON nested too deep to parse is a 400 (FastAPI's), in
OpenAI's error shape.
"""

import asyncio
import contextlib
import json
import math
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator.api.auth import ApiKeyMiddleware, ApiKeys, Unauthenticated
from coordinator.api.body_limit import BodyLimit, ChatMessagesLimit, PendingBodies
from coordinator.api.client import FINISH_REASONS, Completion
from coordinator.api.logprobs import RequestLogprobs
from coordinator.api.openai_schema import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    StreamOptions,
    specdec_metrics,
    usage,
)
from coordinator.api.output import StreamStalled, written
from coordinator.api.request import prompt_ids
from coordinator.settings import CoordinatorSettings
from specdec.rpc.errors import SpecdecError
from specdec.rpc.server import SHUTDOWN_GRACE_S
from specdec.rpc.tls import ReloadingSSLContext
from specdec.v1 import coordinator_pb2, verify_pb2

tracer = trace.get_tracer(__name__)
T = TypeVar("T")
# FastAPI's detail when parsing a body fails other than as invalid JSON (nesting past the parser's depth)
UNPARSED = "There was an error parsing the body"
# Seconds between GetInfo calls that learn the target's name when requests name unknown models
MODEL_NAMES_REFRESH_S = 5.0


class ModelNames:
    """The names a request's ``model`` may take: the target's (from the verify service's GetInfo,
    which ``verify_info()`` gives) and the configured aliases. A name outside them is answered
    from this set: the target's name is fetched again at most every ``refresh_s`` seconds (it
    changes only when the verify replicas are replaced by another model's), so a flood of unknown
    names costs no call upstream."""

    def __init__(
        self,
        verify_info: Callable[[], Awaitable[verify_pb2.VerifyServiceGetInfoResponse]],
        aliases: list[str],
        refresh_s: float = MODEL_NAMES_REFRESH_S,
    ):
        self.verify_info, self.aliases, self.refresh_s = verify_info, list(aliases), refresh_s
        self.target: str | None = None
        self.fetched = -math.inf  # time.monotonic() of the last GetInfo, answered or not
        self.error: SpecdecError | None = None  # the last GetInfo's, when it failed
        self.fetching = asyncio.Lock()  # concurrent misses share one GetInfo

    async def names(self) -> list[str]:
        """Raises Unavailable when the target's name is not known yet and no verify replica answers."""
        if self.target is None:
            await self._fetch()
        assert self.target is not None  # _fetch raised otherwise
        return [self.target, *self.aliases]

    async def _fetch(self) -> None:
        """Learns the target's name, unless a GetInfo was made in the last ``refresh_s`` seconds:
        a failed one keeps the name known before. Raises what GetInfo raised (that one's error, for
        that long) while no name is known."""
        async with self.fetching:
            if time.monotonic() - self.fetched < self.refresh_s:
                if self.target is None and self.error is not None:
                    raise self.error.with_traceback(None)
                return
            self.fetched = time.monotonic()
            try:
                self.target, self.error = (await self.verify_info()).model, None
            except SpecdecError as err:
                self.error = err
                if self.target is None:
                    raise

    async def check(self, name: str) -> None:
        """Raises ApiError (404, OpenAI's model_not_found) naming the served models for a name
        outside them, and Unavailable (see :meth:`names`)."""
        if name in self.aliases or name == self.target:
            return
        await self._fetch()
        served = await self.names()
        if name not in served:
            message = f"model {name!r} does not exist: this server serves {', '.join(served)}"
            raise ApiError(404, message, "model", "model_not_found")


class _Steps:
    """A request's GenerateResponse stream, each step run under the request's span (the HTTP
    twin of the gRPC call's span): a stream's steps run in more than one task, so the span is made
    current per step rather than for the whole stream."""

    def __init__(self, responses: AsyncGenerator[coordinator_pb2.GenerateResponse, None], span: trace.Span):
        self.responses, self.span = responses, span

    async def next(self) -> coordinator_pb2.GenerateResponse | None:
        """The next message, None after the last. Raises SpecdecError."""
        with trace.use_span(self.span):
            try:
                return await anext(self.responses)
            except StopAsyncIteration:
                return None

    async def close(self) -> None:
        """Ends the request (cancels it if unfinished) and its span."""
        with trace.use_span(self.span, end_on_exit=True):
            await self.responses.aclose()


class _EventStream(StreamingResponse):
    """Server-sent events that close their source when the response ends, however it ends: when
    the client disconnects mid-stream, or reads nothing for ``stall_timeout_s`` seconds, the
    request is cancelled and its sessions released."""

    media_type = "text/event-stream"
    body_iterator: AsyncGenerator[str, None]  # the events of :func:`_events`

    def __init__(self, events: AsyncGenerator[str, None], headers: dict[str, str], stall_timeout_s: float):
        super().__init__(events, headers=headers)
        self.stall_timeout_s = stall_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        async def bounded(message) -> None:
            await written(send(message), self.stall_timeout_s)

        try:
            await super().__call__(scope, receive, bounded)
        except StreamStalled:
            pass  # the response stays unfinished: uvicorn closes the connection
        finally:
            await self.body_iterator.aclose()


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before its response was ready."""


class _Disconnect:
    """Watches a request's connection from the moment its body has been read: ``unless`` awaits a
    step of the request, or cancels it and raises ClientDisconnected when the client leaves first
    (uvicorn's ``receive`` answers ``http.disconnect`` once the body is consumed and the
    connection is closed)."""

    def __init__(self, http: Request):
        self.task: asyncio.Future | None = asyncio.ensure_future(self._left(http))

    @staticmethod
    async def _left(http: Request) -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    async def unless(self, step: Awaitable[T]) -> T:
        """The result of ``step``. Raises ClientDisconnected (``step`` cancelled) when the client
        disconnects first, and what ``step`` raises."""
        work = asyncio.ensure_future(step)
        if self.task is not None:
            try:
                await asyncio.wait({work, self.task}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                work.cancel()
                raise
            if not work.done() and (self.task.cancelled() or self.task.exception() is not None):
                self.task = None  # the watch itself failed: the step goes on unwatched
            elif not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, SpecdecError):
                    await work
                raise ClientDisconnected()
        return await work

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def create_app(servicer, served_model_names: list[str], max_body_bytes: int) -> FastAPI:
    """The HTTP API of ``servicer`` (a :class:`coordinator.service.CoordinatorServicer`, whose
    ``keys`` and ``settings`` it takes); request bodies over ``max_body_bytes`` get 413, and a
    client's bodies still arriving past ``http_max_pending_bodies_per_client`` 429, and chat
    requests over ``max_chat_messages`` messages 400 before their JSON is decoded
    (:mod:`coordinator.api.body_limit`)."""
    settings = servicer.settings
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(
        ChatMessagesLimit, path="/v1/chat/completions", max_messages=settings.max_chat_messages, answer=_refused_body
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, answer=_refused_body)
    app.add_middleware(
        PendingBodies,
        max_per_client=settings.http_max_pending_bodies_per_client,
        client=lambda scope: _client(servicer.keys, scope),
        # its body is left unread: the connection closes rather than read it to the end
        answer=lambda err: _error(ApiError(429, err.detail, None, "too_many_pending_bodies", "1"), close=True),
    )
    # added last, so it runs first: a call without a key is answered before its body is read
    app.add_middleware(ApiKeyMiddleware, keys=servicer.keys, answer=lambda err: _error(ApiError.from_specdec(err)))
    models = ModelNames(servicer.verify_client.info, served_model_names)
    started = int(time.time())

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict:
        names = await models.names()
        data = [
            {"id": name, "object": "model", "created": started, "owned_by": "specdec", "root": names[0]}
            for name in names
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        return await _complete(body, http, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await _complete(body, http, chat=False)

    async def _complete(body: ChatCompletionRequest | CompletionRequest, http: Request, chat: bool):
        await models.check(body.model)
        request = body.generate_request()
        request.request_id = uuid.uuid4().hex  # the response's id (with n > 1 the choices' ids add ":<i>")
        caller = servicer.keys.caller(http.headers.get("authorization"), http.client.host if http.client else "")
        steps = _Steps(servicer.serve(request, caller), _server_span(http))
        shape = ResponseShape(chat, request.request_id, body.model)
        logprobs = RequestLogprobs(request, servicer.tokenizer, chat) if request.logprobs else None
        disconnect = _Disconnect(http)
        try:
            # validation and prefill: their errors get their own status
            first = await disconnect.unless(steps.next())
            assert first is not None  # a request's stream has at least its last message
            if body.stream:
                disconnect.stop()  # from here on the event stream sees the client leave
                options = body.stream_options or StreamOptions()
                prompt_tokens = None
                if options.include_usage and options.continuous_usage_stats:
                    prompt_tokens = len(await asyncio.to_thread(prompt_ids, request, servicer.tokenizer))
                headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
                events = _events(
                    steps, first, shape, logprobs, options.include_usage, body.field_names(), prompt_tokens
                )
                return _EventStream(events, headers, servicer.settings.stream_stall_timeout_s)
            completions = await disconnect.unless(_rest(steps, first))
        except SpecdecError as err:
            await steps.close()
            raise ApiError.from_specdec(err, body.field_names()) from None
        except ClientDisconnected:
            await steps.close()  # cancels the request: its sessions released
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        except BaseException:
            await steps.close()
            raise
        finally:
            disconnect.stop()
        await steps.close()
        choice_logprobs = [
            logprobs.choice(i).add(c.token_ids, c.logprobs, c.text, final=True) if logprobs else None
            for i, c in enumerate(completions)
        ]
        return shape.completion(completions, choice_logprobs)

    _add_error_handlers(app)
    return app


def _client(keys: ApiKeys, scope: Scope) -> str:
    """Who sends a request, for the limits per client: its API key's owner, or its IP address
    when the coordinator has no keys (or the request none, on a path open without one)."""
    host = scope["client"][0] if scope.get("client") else ""
    try:
        return keys.caller(Headers(scope=scope).get("authorization"), host).client
    except Unauthenticated:
        return f"host {host}"


def _server_span(http: Request) -> trace.Span:
    """The span of an HTTP call's request, its parent the caller's trace."""
    return tracer.start_span(
        f"POST {http.url.path}", context=propagate.extract(http.headers), kind=trace.SpanKind.SERVER
    )


async def _rest(steps: _Steps, first: coordinator_pb2.GenerateResponse) -> list[Completion]:
    """Each choice's completion, by index: ``first`` and the messages after it."""
    completions: dict[int, Completion] = {}
    response: coordinator_pb2.GenerateResponse | None = first
    while response is not None:
        completions.setdefault(response.index, Completion()).add(response)
        response = await steps.next()
    return [completions[index] for index in sorted(completions)]


async def _events(
    steps: _Steps,
    response,
    shape: ResponseShape,
    logprobs: RequestLogprobs | None,
    include_usage: bool,
    names: dict[str, str],
    continuous_prompt_tokens: int | None = None,
) -> AsyncGenerator[str, None]:
    """The chunks of a streamed request, from its first message ``response`` on, its choices'
    interleaved as their messages come: a chat choice's first chunk carries the assistant role, a
    message's chunk its text and the ``logprobs`` object of the tokens whose text it completes
    (:mod:`coordinator.api.logprobs`), the choice's last message one more chunk its finish reason
    and metrics; with ``include_usage``, a last chunk the usage of every choice; an error, the
    body's ``names`` for its fields (:meth:`ApiError.from_specdec`). ``continuous_prompt_tokens``
    (``stream_options.continuous_usage_stats``): the prompt's token count, and every chunk carries
    the usage so far."""
    num_prompt_tokens = num_completion_tokens = 0
    started: set[int] = set()

    def so_far() -> dict[str, int] | None:
        if continuous_prompt_tokens is None:
            return None
        return usage(continuous_prompt_tokens, num_completion_tokens)

    try:
        while response is not None:
            index, final = response.index, bool(response.finish_reason)
            if shape.chat and index not in started:
                started.add(index)
                yield _sse(shape.chunk(index, "", role=True, usage_so_far=so_far()))
            num_completion_tokens += len(response.token_ids)
            entries = None
            if logprobs is not None:
                entries = logprobs.choice(index).add(response.token_ids, response.logprobs, response.text, final)
            if response.text or entries:
                yield _sse(shape.chunk(index, response.text, usage_so_far=so_far(), logprobs=entries))
            if final:
                finish = shape.chunk(index, None, FINISH_REASONS[response.finish_reason], usage_so_far=so_far())
                yield _sse(finish | {"specdec": specdec_metrics(response.metrics)})
                num_prompt_tokens = response.metrics.num_prompt_tokens
            response = await steps.next()
        if include_usage:
            yield _sse(shape.usage_chunk(num_prompt_tokens, num_completion_tokens))
        yield "data: [DONE]\n\n"
    except SpecdecError as err:  # after the 200: the error as an event, as OpenAI sends it
        yield _sse(ApiError.from_specdec(err, names).to_json())
    finally:
        await steps.close()


def _error(err: ApiError, close: bool = False) -> JSONResponse:
    """``err`` as a response; ``close``: the connection closes after it."""
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
    if err.retry_after is not None:
        headers["Retry-After"] = err.retry_after
    if close:
        headers["Connection"] = "close"
    return JSONResponse(err.to_json(), status_code=err.status, headers=headers)


def _refused_body(err: HTTPException) -> JSONResponse:
    """A body refused by :mod:`coordinator.api.body_limit`: 413, or 400 for a chat's messages."""
    if err.status_code == 400:
        return _error(ApiError(400, err.detail, "messages", "invalid_value"))
    return _error(ApiError(err.status_code, err.detail, None, None))


def _validation_message(err: RequestValidationError) -> ApiError:
    """A 400 for the first field pydantic refused, naming it: ``messages[0].role: Field required``."""
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(
            400, f"the request body is not valid JSON ({detail}): send one JSON object", None, "invalid_json"
        )
    path = ""
    for part in first.get("loc", ())[1:]:  # after "body"
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    message = first.get("msg", "invalid request")
    if "input" in first and first.get("type") not in ("missing", "json_invalid"):
        message += f" (got {first['input']!r})"
    return ApiError(400, f"{path}: {message}" if path else f"request body: {message}", path or None, "invalid_value")


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``)."""

    @app.exception_handler(ApiError)
    async def api_error(_request, err: ApiError):
        return _error(err)

    @app.exception_handler(SpecdecError)
    async def specdec_error(_request, err: SpecdecError):
        return _error(ApiError.from_specdec(err))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, err: RequestValidationError):
        return _error(_validation_message(err))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        message = str(err.detail)
        if err.status_code == 400 and message == UNPARSED:  # FastAPI's answer to any other parse failure
            message = "the request body could not be parsed (JSON nested too deeply?): send one flat JSON object"
            return _error(ApiError(400, message, None, "invalid_json"))
        if err.status_code in (404, 405):
            message = (
                f"{message}: {request.method} {request.url.path}; this server serves POST /v1/chat/completions, "
                "POST /v1/completions, GET /v1/models and GET /health"
            )
        return _error(ApiError(err.status_code, message, None, None))


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP server's bounds on its clients, each a coordinator setting: seconds for a request's
    header to arrive (``header_s``), for its body to arrive after it (``body_s``) and for an idle
    keep-alive connection to stay open (``keep_alive_s``); the largest header in bytes
    (``max_header_bytes``) and in fields (``max_headers``); the most connections served at once
    (``max_connections``, 503 beyond)."""

    header_s: float = 10.0
    body_s: float = 30.0
    keep_alive_s: float = 5.0
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    max_connections: int = 1024

    @classmethod
    def of(cls, settings: CoordinatorSettings) -> "HttpLimits":
        return cls(
            header_s=settings.http_header_timeout_s,
            body_s=settings.http_body_timeout_s,
            keep_alive_s=settings.http_keep_alive_timeout_s,
            max_header_bytes=settings.http_max_header_bytes,
            max_headers=settings.http_max_headers,
            max_connections=settings.http_max_connections,
        )


class _HeaderTooLarge(Exception):
    """Stops the parser at a header over the limits (:meth:`BoundedHttpProtocol._count`)."""


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (its default) with bounds on what a client sends before the
    app answers; uvicorn has none of them, nor has httptools (it takes headers of any size and
    number), and h11's size limit (``h11_max_incomplete_event_size``) answers a bare 400.

    - A deadline on each request's header: a connection that has not sent a whole request header
      ``header_s`` seconds after it opened, or after its previous response ended, is closed, so a
      client sending its header slowly (slowloris) cannot hold connections (uvicorn's keep-alive
      timeout only covers a connection that sends nothing at all after a response).
    - A deadline on its body: the whole body must arrive within ``body_s`` seconds of the header,
      else 408 (the connection then closes; the app sees the client leave).
    - A header over ``max_header_bytes`` bytes or ``max_headers`` fields gets 431, as soon as the
      bytes received show it, before it is parsed to the end.

    The refusals are in OpenAI's error shape and name their setting."""

    limits = HttpLimits()  # set per server by :class:`HttpServer` (uvicorn builds the protocol itself)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._body_complete = True  # no request in progress
        self._next_header()
        self._arm(self.limits.header_s, self._header_too_slow)

    def _arm(self, delay_s: float, expired: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _next_header(self) -> None:
        """From here on the bytes received are the next request's header."""
        self._header_bytes = self._header_received = self._num_headers = 0
        self._in_header = True
        self._header_refusal: ApiError | None = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_header:
            self._header_received += len(data)
        super().data_received(data)
        # a header still unfinished after more bytes than the limit: refused before it ends
        if self._in_header and self._header_received > self.limits.max_header_bytes and not self._refused:
            self._refuse_header(self._too_large())

    def on_url(self, url: bytes) -> None:
        self._count(len(url), 0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4, 1)  # "name: value\r\n"
        super().on_header(name, value)

    def _count(self, num_bytes: int, num_headers: int) -> None:
        self._header_bytes += num_bytes
        self._num_headers += num_headers
        if self._header_bytes > self.limits.max_header_bytes:
            self._header_refusal = self._too_large()
        elif self._num_headers > self.limits.max_headers:
            self._header_refusal = ApiError(
                431,
                f"the request has more than {self.limits.max_headers} header fields, the coordinator's limit "
                "(http_max_headers): send fewer, or raise --http-max-headers",
                None,
                "header_too_large",
            )
        if self._header_refusal is not None:
            raise _HeaderTooLarge()  # the parser stops; uvicorn answers through send_400_response

    def _too_large(self) -> ApiError:
        return ApiError(
            431,
            f"the request header exceeds the coordinator's limit of {self.limits.max_header_bytes} bytes "
            "(http_max_header_bytes): send fewer or shorter header fields, or raise --http-max-header-bytes",
            None,
            "header_too_large",
        )

    def send_400_response(self, msg: str) -> None:
        if self._header_refusal is None:
            super().send_400_response(msg)
        else:  # the parser stopped at a header over the limits
            self._refuse_header(self._header_refusal)

    def on_headers_complete(self) -> None:
        self._in_header, self._body_complete = False, False
        self._arm(self.limits.body_s, self._body_too_slow)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._body_complete = True
        self._disarm()
        super().on_message_complete()
        self._next_header()
        if self.cycle is not None and self.cycle.response_complete:  # answered before its body arrived (401, 429)
            self._arm(self.limits.header_s, self._header_too_slow)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # the next header's deadline, once the request is done both ways (a body still arriving
        # keeps its own; a pipelined request started by super() gets one when it is answered)
        if not self.transport.is_closing() and self._body_complete and self.cycle.response_complete:
            self._arm(self.limits.header_s, self._header_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _header_too_slow(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _body_too_slow(self) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_started:  # answered already: nothing to say
            self.transport.close()
            return
        self.cycle.disconnected = True  # the app reading the body sees the client leave
        self.cycle.message_event.set()
        self._refuse(
            ApiError(
                408,
                f"the request body did not arrive within {self.limits.body_s:g} s of its header, the coordinator's "
                "limit (http_body_timeout_s): send the body at once, or raise --http-body-timeout-s",
                None,
                "request_timeout",
            )
        )

    def _refuse_header(self, err: ApiError) -> None:
        """Refuses a header over the limits: answers ``err`` unless a response to an earlier
        request on the connection is still due (the client would take it for that one's)."""
        if self.cycle is None or self.cycle.response_complete:
            self._refuse(err)
        else:
            self._refused = True
            self.transport.close()

    def _refuse(self, err: ApiError) -> None:
        """Answers ``err`` and closes the connection."""
        self._refused = True
        body = json.dumps(err.to_json()).encode()
        head = (
            f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the coordinator handles SIGTERM and SIGINT (coordinator.service.serve)


class HttpServer:
    """uvicorn serving ``app`` on ``host``:``port`` in the running event loop; over TLS with
    ``ssl_context`` (its ``.context``, handed to uvicorn's ``ssl_context_factory``, switches new
    connections to new certificate files), else plaintext. The port is bound at construction, so a
    taken port fails the coordinator's start with OSError."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        ssl_context: ReloadingSSLContext | None = None,
        limits: HttpLimits = HttpLimits(),
    ):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, port), family=family)
        except OSError as err:
            raise OSError(
                err.errno,
                f"cannot serve HTTP on {host}:{port} ({err.strerror}): choose another "
                "--http-port, or 0 to turn the HTTP API off",
            ) from None
        protocol = type("Bounded", (BoundedHttpProtocol,), {"limits": limits})
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=protocol,
            timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # seconds, a float works
            limit_concurrency=limits.max_connections,
            log_config=None,
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
            ssl_context_factory=(lambda _config, _default: ssl_context.context) if ssl_context else None,
        )
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    def stop_accepting(self) -> None:
        """Starts a graceful shutdown: no new connections; streams in flight get
        SHUTDOWN_GRACE_S seconds to finish."""
        self.server.should_exit = True

    async def stop(self) -> None:
        self.stop_accepting()
        if self.task is not None:
            await self.task
