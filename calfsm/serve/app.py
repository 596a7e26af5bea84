"""The reference server: an OpenAI-compatible ASGI app over one executor.

:func:`create_app` is the factory: give it a running executor (you own it and close it)
or a coroutine function that builds one (the app starts it in its lifespan, answers 503
while it warms up, and closes it on shutdown). Mount the app in any ASGI server; ``calfsm
serve`` runs it under uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE with
``"stream": true``), ``GET /v1/models``, ``GET /health`` (liveness), ``GET /ready``
(readiness), ``GET /metrics`` (Prometheus text). Requests are checked by
:mod:`calfsm.serve.protocol`, text goes through :mod:`calfsm.serve.tokenizer`, each
choice is a library stream (:mod:`calfsm.serve.generation`) and every failure is
answered by :mod:`calfsm.serve.httperrors`.

Status of a streaming answer: the app waits for the first piece of text (or the end of
the request) before it sends the headers, so an error before the first token — a full
queue, a device that is recovering, a deadline — is a proper 429/503/504, not a 200 with
an error inside. An error after that is sent as a last ``data: {"error": ...}`` event.
A client that disconnects, streaming or not, cancels its own streams and no others.

The door: with API keys configured (``ServerConfig.api_keys``) every route but the
probes needs ``Authorization: Bearer KEY`` (:mod:`calfsm.serve.auth`); each client (its
key, else its address) holds at most its share of the streams and of the requests
waiting to start (:mod:`calfsm.serve.fairuse`); a body is read within
``max_body_bytes`` and parsed within ``max_json_depth`` (:mod:`calfsm.serve.bodies`).
Slow and idle connections are the HTTP server's to cut: ``calfsm serve`` runs uvicorn
with the limits of :mod:`calfsm.serve.connections`.

Logs: a client's mistake (4xx) at DEBUG; a client that leaves mid-upload, mid-stream or
while waiting for its answer, one INFO line; 5xx at WARNING; only a bug of ours (500
``internal``) with a traceback, at ERROR.

Starlette, not FastAPI: the app is six routes whose bodies :mod:`calfsm.serve.protocol`
checks into our own error hierarchy (FastAPI's pydantic layer would answer 422 in its
own format, which OpenAI clients do not expect), and each streamed token costs less
without the extra layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from calfsm.errors import CalfsmError, InvalidArgument
from calfsm.executor import DeviceExecutor
from calfsm.manifest import TaskKind
from calfsm.metrics import ExecutorMetrics
from calfsm.serve.auth import ApiKeys, BearerAuth, client_of
from calfsm.serve.bodies import UploadAbandoned, parse_json, read_body
from calfsm.serve.fairuse import ClientBooks, ClientUsage, default_client_limit
from calfsm.serve.fields import count, count_or_none, positive, positive_or_none
from calfsm.serve.generation import Choice, Piece, merged
from calfsm.serve.httperrors import ApiError, clip, from_calfsm
from calfsm.serve.probes import Liveness, LivenessMonitor, readiness
from calfsm.serve.protocol import GenerationPlan, Limits, parse_chat, parse_completion
from calfsm.serve.responses import CHAT, COMPLETION, EventStream, Shape, sse, usage
from calfsm.serve.tokenizer import ByteTokenizer

__all__ = ["ServerConfig", "client_usage", "create_app", "liveness"]

log = logging.getLogger("calfsm.serve")

ExecutorFactory = Callable[[], Awaitable[DeviceExecutor]]


def _keys(value: Any) -> tuple[str, ...]:
    if isinstance(value, str | bytes):
        raise InvalidArgument("ServerConfig.api_keys must be a sequence of keys (one key: "
                              "[key])", stage="config")
    keys = tuple(value)
    ApiKeys(keys, source="ServerConfig.api_keys")          # each key is checked
    return keys


@attrs.frozen
class ServerConfig:
    """Knobs of the reference server. Times are wall seconds."""

    #: the name clients give as ``model``; None: the manifest's name
    model_name: str | None = None
    #: tokens per choice when a request gives no max_tokens (OpenAI's is 16)
    default_max_tokens: int = attrs.field(default=16, validator=count)
    #: choices per request at most (prompts times n)
    max_choices: int = attrs.field(default=16, validator=count)
    #: each choice's deadline (its stream's), then 504; None: the executor's own
    request_timeout_s: float | None = attrs.field(default=60.0,
                                                  validator=positive_or_none)
    #: liveness: a job on the device this long means no progress (probes.py)
    hang_after_s: float = attrs.field(default=5.0, validator=positive)
    #: request bodies above this are refused (413)
    max_body_bytes: int = attrs.field(default=8 << 20, validator=count)
    #: arrays and objects of a body nested deeper than this are refused (400)
    max_json_depth: int = attrs.field(default=64, validator=count)
    #: a client's max_tokens (chat: max_completion_tokens) above this is a 400
    max_tokens_cap: int = attrs.field(default=4096, validator=count)
    #: accepted Bearer keys; empty: no authentication (calfsm.serve.auth)
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_keys,
                                            repr=lambda keys: f"<{len(keys)} keys>")
    #: streams (choices) one client may hold at once; None: half the executor's
    #: max_sequences, at least 1 (calfsm.serve.fairuse)
    max_client_streams: int | None = attrs.field(default=None, validator=count_or_none)
    #: requests of one client that may wait to start (being read or parsed) at once;
    #: None: as max_client_streams' default
    max_client_waiting: int | None = attrs.field(default=None, validator=count_or_none)

    def __attrs_post_init__(self) -> None:
        if self.default_max_tokens > self.max_tokens_cap:
            raise InvalidArgument(f"ServerConfig.default_max_tokens ({self.default_max_tokens}"
                                  f") must be <= max_tokens_cap ({self.max_tokens_cap})",
                                  stage="config")


class _Server:
    """The app's state: the executor (None while it starts), its liveness monitor, the
    tokenizer and the limits of its model."""

    def __init__(self, config: ServerConfig, registry: CollectorRegistry | None) -> None:
        self.config = config
        self.registry = registry
        self.executor: DeviceExecutor | None = None
        self.monitor: LivenessMonitor | None = None
        self.metrics: ExecutorMetrics | None = None
        self.tokenizer: ByteTokenizer | None = None
        self.limits: Limits | None = None
        self.books: ClientBooks | None = None
        self.start_error: str | None = None
        self.closing = False
        self.started = time.time()

    def attach(self, executor: DeviceExecutor) -> None:
        epoch = executor.epoch
        if epoch is None:
            raise InvalidArgument("the executor has no configured model", stage="serve")
        contract = epoch.contract(TaskKind.DECODE)
        self.tokenizer = ByteTokenizer(contract.vocab)
        name = self.config.model_name or epoch.manifest.name or "calfsm"
        cfg = self.config
        self.limits = Limits(name, contract.vocab, contract.max_seq,
                             cfg.default_max_tokens, cfg.max_choices, cfg.max_tokens_cap)
        share = default_client_limit(executor.config.max_sequences)
        self.books = ClientBooks(cfg.max_client_streams or share,
                                 cfg.max_client_waiting or share)
        executor.add_observer(self.books)
        self.monitor = LivenessMonitor(executor, hang_after_s=cfg.hang_after_s)
        self.metrics = ExecutorMetrics(executor, registry=self.registry)
        self.executor = executor

    def running(self) -> DeviceExecutor:
        ex = self.executor
        if ex is None or self.closing:
            why = self.start_error or ("shutting down" if self.closing else "starting")
            raise ApiError(503, f"the server is {why}", code="unavailable",
                           retry_after_s=None if self.start_error else 1.0)
        return ex

    # ---- probes --------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.executor is None or self.monitor is None:
            return JSONResponse({"live": False, "reason": self.start_error or "starting"},
                                status_code=503)
        live = self.monitor.check()
        return JSONResponse({"live": live.live, "reason": live.reason,
                             "jobs_on_device": live.jobs_on_device,
                             "oldest_job_s": round(live.oldest_job_s, 6),
                             "state": self.executor.lifecycle_state,
                             "generation": self.executor.generation},
                            status_code=200 if live.live else 503)

    async def ready(self, request: Request) -> Response:
        if self.executor is None or self.closing:
            return JSONResponse({"ready": False, "reason": self.start_error or (
                "shutting down" if self.closing else "starting")}, status_code=503,
                headers={} if self.start_error else {"retry-after": "1"})
        ok, shown = readiness(self.executor)
        headers = {} if ok or shown["state"] == "Failed" else {
            "retry-after": str(max(1, round(self.executor.lifecycle.retry_after_s)))}
        return JSONResponse({"ready": ok} | shown, status_code=200 if ok else 503,
                            headers=headers)

    async def metrics_text(self, request: Request) -> Response:
        if self.metrics is None:
            raise ApiError(503, f"the server is {self.start_error or 'starting'}",
                           code="unavailable",
                           retry_after_s=None if self.start_error else 1.0)
        return Response(generate_latest(self.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    # ---- models --------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        self.running()
        assert self.limits is not None
        return JSONResponse({"object": "list", "data": [{
            "id": self.limits.model, "object": "model", "created": int(self.started),
            "owned_by": "calfsm", "max_model_len": self.limits.max_seq}]})

    # ---- generation ----------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion, COMPLETION)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat, CHAT)

    async def _generate(self, request: Request, parse: Callable[..., GenerationPlan],
                        shape: Shape) -> Response:
        client = client_of(request.scope)
        try:
            ex = self.running()
            assert self.limits is not None and self.tokenizer is not None
            assert self.books is not None
            with self.books.waiting(client):
                body = parse_json(await read_body(request, self.config.max_body_bytes),
                                  self.config.max_json_depth)
                plan = parse(body, self.limits, self.tokenizer)
                choices = self._start(ex, plan, client)
        except ApiError as e:
            return _error_response(e, client)
        except CalfsmError as e:
            return _error_response(from_calfsm(e), client)
        except UploadAbandoned as e:
            if request.scope.get("calfsm.body_timeout"):
                log.info("%s did not send its body to %s in time (%s)", client,
                         request.url.path, e)
            else:
                log.info("%s left during its upload to %s (%s)", client, request.url.path, e)
            return Response(status_code=499)     # nobody reads it
        except Exception as e:          # a bug of ours: the traceback goes to the log
            return _internal(request, e)
        try:
            if plan.stream:
                return await self._stream(request, plan, choices, shape, client)
            return await self._collect(request, plan, choices, shape, client)
        except Exception as e:
            return _internal(request, e)

    def _start(self, ex: DeviceExecutor, plan: GenerationPlan, client: str) -> list[Choice]:
        """A stream per choice, booked to ``client``; if one cannot start, those started
        are cancelled (a stream whose start failed half-way too)."""
        assert self.books is not None
        with self.books.opening(client, len(plan.prompts)) as started:
            choices: list[Choice] = []
            try:
                for i, (prompt, params) in enumerate(zip(plan.prompts, plan.params)):
                    choices.append(Choice(ex, i, prompt, params, plan.stops,
                                          deadline_s=self.config.request_timeout_s))
            except BaseException:
                for stream in started:
                    stream.cancel()
                raise
        return choices

    def _usage(self, plan: GenerationPlan, ends: list[Piece]) -> dict[str, int]:
        prompt = sum(len(plan.prompts[i]) for i in range(0, len(plan.prompts), plan.n))
        return usage(prompt, sum(p.completion_tokens for p in ends))

    async def _collect(self, request: Request, plan: GenerationPlan, choices: list[Choice],
                       shape: Shape, client: str) -> Response:
        """The whole answer at once; a client that leaves first cancels it."""
        texts = [[] for _ in choices]
        ends: list[Piece | None] = [None] * len(choices)

        async def run() -> None:
            async for piece in merged(choices):
                texts[piece.index].append(piece.text)
                if piece.finish_reason or piece.error:
                    ends[piece.index] = piece
                    if piece.error:
                        return          # merged's finally cancels the others

        task = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if task.cancelled():
            log.info("%s left while waiting for the answer to %s", client,
                     request.url.path)
            return Response(status_code=499)     # nobody reads it
        task.result()
        failed = next((p for p in ends if p is not None and p.error), None)
        if failed is not None:
            return _error_response(from_calfsm(failed.error), client)
        done = [p for p in ends if p is not None]
        assert self.limits is not None
        return JSONResponse(shape.body(
            shape.new_id(), self.limits.model, ["".join(t) for t in texts],
            [p.finish_reason for p in done], self._usage(plan, done)))

    async def _stream(self, request: Request, plan: GenerationPlan, choices: list[Choice],
                      shape: Shape, client: str) -> Response:
        pieces = merged(choices)
        first_piece = asyncio.ensure_future(anext(pieces))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({first_piece, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not first_piece.done():  # the client left before the first token
                first_piece.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await first_piece
        try:
            first = first_piece.result()
        except BaseException:
            await pieces.aclose()
            if first_piece.cancelled():
                log.info("%s left before the first token of %s", client, request.url.path)
                return Response(status_code=499)     # nobody reads it
            raise
        if first.error is not None:
            await pieces.aclose()
            return _error_response(from_calfsm(first.error), client)
        assert self.limits is not None
        return EventStream(self._events(plan, shape, first, pieces), close=pieces.aclose,
                           on_disconnect=lambda: log.info(
                               "%s left in the middle of the stream of %s", client,
                               request.url.path))

    async def _events(self, plan: GenerationPlan, shape: Shape, first: Piece,
                      pieces: AsyncIterator[Piece]) -> AsyncIterator[bytes]:
        assert self.limits is not None
        rid, model, created = shape.new_id(), self.limits.model, int(time.time())
        inc = plan.include_usage
        ends: list[Piece] = []
        if shape.chat:
            for i in range(len(plan.prompts)):
                yield sse(shape.chunk(rid, model, created, Piece(i, "", ()),
                                      include_usage=inc, role=True))
        try:
            piece: Piece | None = first
            while piece is not None:
                if piece.error is not None:
                    yield sse(from_calfsm(piece.error).body())
                    yield sse("[DONE]")
                    return
                if piece.text or piece.finish_reason:
                    yield sse(shape.chunk(rid, model, created, piece, include_usage=inc))
                if piece.finish_reason:
                    ends.append(piece)
                piece = await anext(pieces, None)
            if inc:
                yield sse(shape.usage_chunk(rid, model, created, self._usage(plan, ends)))
            yield sse("[DONE]")
        finally:
            await pieces.aclose()       # a client gone: its streams are cancelled


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _internal(request: Request, exc: Exception) -> Response:
    """500 with an OpenAI body for an unexpected exception (logged with its traceback)."""
    log.error("unexpected %s on %s", type(exc).__name__, request.url.path, exc_info=exc)
    return _error_response(ApiError(500, f"internal error: {type(exc).__name__}",
                                    code="internal"))


def _error_response(err: ApiError, client: str | None = None) -> Response:
    if err.status >= 500:
        log.warning("answering %s: %s", err.status, err.message)
    else:
        log.debug("answering %s to %s: %s", err.status, client or "a client", err.message)
    return Response(err.json(), status_code=err.status, media_type="application/json",
                    headers=err.headers())


def create_app(executor: DeviceExecutor | ExecutorFactory,
               config: ServerConfig | None = None, *,
               registry: CollectorRegistry | None = None) -> Starlette:
    """The ASGI app serving ``executor``: a running :class:`DeviceExecutor` (the caller
    owns it), or an async factory of one (``lambda: DeviceExecutor.create(...)``; the
    app starts it in its lifespan and closes it on shutdown). The executor's metrics
    (:class:`~calfsm.metrics.ExecutorMetrics`) go to ``registry`` (default: one of the
    app's own) and ``GET /metrics`` serves that registry."""
    config = config or ServerConfig()
    server = _Server(config, registry)
    owned = not isinstance(executor, DeviceExecutor)
    if not owned:
        server.attach(executor)          # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        starting = asyncio.ensure_future(_start_owned(server, executor)) if owned else None
        try:
            yield
        finally:
            server.closing = True
            if starting is not None:
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, CalfsmError):
                    await starting
            if server.monitor is not None:
                server.monitor.close()
            if server.metrics is not None:
                server.metrics.close()
            if server.books is not None and server.executor is not None:
                server.executor.remove_observer(server.books)
            if owned and server.executor is not None:
                try:
                    await server.executor.aclose()
                except CalfsmError as e:
                    log.error("shutdown: %s", e)

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/ready", server.ready, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
    ]
    middleware = [Middleware(BearerAuth, keys=ApiKeys(config.api_keys))] \
        if config.api_keys else []
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={ApiError: _api_error, 404: _not_found,
                                        405: _not_allowed})
    app.state.calfsm = server
    return app


def client_usage(app: Starlette) -> dict[str, ClientUsage]:
    """What each client of ``app`` holds now (streams, requests waiting to start); a
    client that holds nothing is not listed. Clients are named as in
    :func:`calfsm.serve.auth.client_of` (a key's fingerprint, never the key)."""
    books: ClientBooks | None = app.state.calfsm.books
    return {} if books is None else books.usage()


def liveness(app: Starlette) -> Liveness:
    """The answer ``GET /health`` of ``app`` gives now (for a supervisor in the same
    process, such as Ray Serve's ``check_health``)."""
    server: _Server = app.state.calfsm
    if server.monitor is None:
        return Liveness(False, server.start_error or "starting", 0.0, 0)
    return server.monitor.check()


async def _start_owned(server: _Server, factory: Any) -> None:
    try:
        server.attach(await factory())
    except CalfsmError as e:
        server.start_error = f"start-up failed: {e.message}"
        log.error("%s", server.start_error)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error_response(ApiError(404, f"no route {clip(request.url.path)}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error_response(ApiError(405, f"{clip(request.method)} is not allowed on "
                                         f"{clip(request.url.path)}"))
