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

Work is bounded before it is done: the API key is checked before the body is read
(:class:`coordinator.api.auth.ApiKeyMiddleware`), the body's size as it is read
(:mod:`coordinator.api.body_limit`), a connection's request header must arrive within
``http_header_timeout_s`` (:class:`HeaderTimeoutProtocol`), idle keep-alive connections close
after ``http_keep_alive_timeout_s``, and at most ``http_max_connections`` connections are served
(503 beyond, uvicorn's ``limit_concurrency``). JSON nested too deep to parse is a 400 (FastAPI's), in
OpenAI's error shape.
"""

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator.api.auth import ApiKeyMiddleware
from coordinator.api.body_limit import BodyLimit
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
from specdec.rpc.errors import SpecdecError
from specdec.rpc.server import SHUTDOWN_GRACE_S
from specdec.rpc.tls import ReloadingSSLContext
from specdec.v1 import coordinator_pb2, verify_pb2

tracer = trace.get_tracer(__name__)
T = TypeVar("T")
# FastAPI's detail when parsing a body fails other than as invalid JSON (nesting past the parser's depth)
UNPARSED = "There was an error parsing the body"


class ModelNames:
    """The names a request's ``model`` may take: the target's (from the verify service's GetInfo,
    which ``verify_info()`` gives, fetched again only when a request names an unknown model) and
    the configured aliases."""

    def __init__(
        self, verify_info: Callable[[], Awaitable[verify_pb2.VerifyServiceGetInfoResponse]], aliases: list[str]
    ):
        self.verify_info, self.aliases = verify_info, list(aliases)
        self.target: str | None = None

    async def names(self, refresh: bool = False) -> list[str]:
        """Raises Unavailable when no verify replica answers."""
        if self.target is None or refresh:
            self.target = (await self.verify_info()).model
        return [self.target, *self.aliases]

    async def check(self, name: str) -> None:
        if name in self.aliases or name == self.target or name in await self.names(refresh=True):
            return
        served = ", ".join(await self.names())
        raise ApiError(404, f"model {name!r} does not exist: this server serves {served}", "model", "model_not_found")


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
    ``keys`` it takes); request bodies over ``max_body_bytes`` get 413
    (:mod:`coordinator.api.body_limit`)."""
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(
        BodyLimit, max_bytes=max_body_bytes, answer=lambda err: _error(ApiError(413, err.detail, None, None))
    )
    # added last, so it runs first: a call without a key is answered before its body is read
    app.add_middleware(ApiKeyMiddleware, keys=servicer.keys, answer=lambda err: _error(ApiError.from_specdec(err)))
    models = ModelNames(servicer.replicas.info, served_model_names)
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
                events = _events(steps, first, shape, logprobs, options.include_usage, prompt_tokens)
                return _EventStream(events, headers, servicer.settings.stream_stall_timeout_s)
            completions = await disconnect.unless(_rest(steps, first))
        except SpecdecError as err:
            await steps.close()
            raise ApiError.from_specdec(err, body.params()) from None
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
    continuous_prompt_tokens: int | None = None,
) -> AsyncGenerator[str, None]:
    """The chunks of a streamed request, from its first message ``response`` on, its choices'
    interleaved as their messages come: a chat choice's first chunk carries the assistant role, a
    message's chunk its text and the ``logprobs`` object of the tokens whose text it completes
    (:mod:`coordinator.api.logprobs`), the choice's last message one more chunk its finish reason
    and metrics; with ``include_usage``, a last chunk the usage of every choice.
    ``continuous_prompt_tokens`` (``stream_options.continuous_usage_stats``): the prompt's token
    count, and every chunk carries the usage so far."""
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
        yield _sse(ApiError.from_specdec(err).to_json())
    finally:
        await steps.close()


def _error(err: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
    if err.retry_after is not None:
        headers["Retry-After"] = err.retry_after
    return JSONResponse(err.to_json(), status_code=err.status, headers=headers)


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
class HttpTimeouts:
    """The HTTP server's bounds on its clients: seconds for a request's header to arrive
    (``header_s``) and for an idle keep-alive connection to stay open (``keep_alive_s``); the most
    connections served at once (``max_connections``, 503 beyond)."""

    header_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 1024


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (its default) with a deadline on each request's header: a
    connection that has not sent a whole request header ``header_timeout_s`` seconds after it
    opened, or after its previous response ended, is closed, so a client sending its header
    slowly (slowloris) cannot hold connections. uvicorn has no such setting; its keep-alive
    timeout only covers a connection that sends nothing at all after a response."""

    header_timeout_s = 10.0  # set per server by :class:`HttpServer` (uvicorn builds the protocol itself)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_too_slow)

    def on_headers_complete(self) -> None:
        self._header_deadline.cancel()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_deadline.cancel()
        super().connection_lost(exc)

    def _header_too_slow(self) -> None:
        if not self.transport.is_closing():
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
        timeouts: HttpTimeouts = HttpTimeouts(),
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
        protocol = type("HeaderTimeout", (HeaderTimeoutProtocol,), {"header_timeout_s": timeouts.header_s})
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=protocol,
            timeout_keep_alive=timeouts.keep_alive_s,  # type: ignore[arg-type]  # seconds, a float works
            limit_concurrency=timeouts.max_connections,
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
