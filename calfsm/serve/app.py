"""The reference server: an OpenAI-compatible ASGI app over one executor.

:func:`create_app` is the factory: give it a running executor (you own it and close it)
or a coroutine function that builds one (the app starts it in its lifespan, answers 503
while it warms up, and closes it on shutdown). Mount the app in any ASGI server; ``calfsm
serve`` runs it under uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE with
``"stream": true``), ``GET /v1/models``, ``GET /health`` (liveness), ``GET /ready``
(readiness), ``GET /metrics`` (Prometheus text). The probes, and the bound on generation
requests at once, are answered by the app's first layer (:mod:`calfsm.serve.front`)
before any routing. Requests are checked by
:mod:`calfsm.serve.protocol`, text goes through the executor's tokenizer
(:mod:`calfsm.generate.tokenizer`; without one, the byte-level one), each choice is a library
stream (:mod:`calfsm.serve.generation`) and every failure is
answered by :mod:`calfsm.serve.httperrors`.

Status of a streaming answer: the headers go out once the executor has admitted the
request's choices, not after the first token: its refusals at the door (a full wait
queue, the admission estimate, a device that is recovering: 429/503) are synchronous
and stay proper statuses, while a client that times its response by the headers (locust)
does not see the time to the first token as the response time. What fails after the
headers (a deadline, a device fault that no resume hides) is a last
``data: {"error": ...}`` event and ``data: [DONE]``.
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

Shutdown (:func:`shutdown`, which the lifespan's shutdown runs, and which
:class:`calfsm.serve.graceful.GracefulServer` runs as soon as uvicorn is told to stop):
new generation requests are a 503 with Retry-After and ``/ready`` a 503 at once; running
streams may finish for ``ServerConfig.shutdown_grace_s``; then the rest are cut, each
ending in a retryable 503 (an SSE stream: a last ``data: {"error": ...}`` event and
``data: [DONE]``; a waiting non-streaming client: an OpenAI-format JSON 503 with
Retry-After). An executor the app owns is closed with that grace
(``DeviceExecutor.aclose(grace_s=...)``); one the caller owns is left running, and the
app cuts only its own streams.

Starlette, not FastAPI: the app is six routes whose bodies :mod:`calfsm.serve.protocol`
checks into our own error hierarchy (FastAPI's pydantic layer would answer 422 in its
own format, which OpenAI clients do not expect), and each streamed token costs less
without the extra layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from calfsm.errors import CalfsmError, ExecutorClosed, InvalidArgument
from calfsm.executor import DeviceExecutor
from calfsm.generate.arguments import ContextLimits
from calfsm.generate.constraint import constraints_available
from calfsm.generate.constraint import warm as warm_constraints
from calfsm.generate.stream import Stream
from calfsm.generate.tokenizer import Tokenizer
from calfsm.manifest import TaskKind
from calfsm.request import check_request_id
from calfsm.serve.auth import ApiKeys, BearerAuth, client_of
from calfsm.serve.bodies import UploadAbandoned, parse_json, read_body
from calfsm.serve.fairuse import ClientBooks, ClientUsage, default_client_limit
from calfsm.serve.fields import count, count_or_none, non_negative, positive_or_none
from calfsm.serve.front import ARRIVAL_KEY, GENERATION_PATHS, PROBE_PATHS, Front
from calfsm.serve.generation import Choice, Piece, merged
from calfsm.serve.httperrors import ApiError, clip, from_calfsm, invalid_argument
from calfsm.serve.probes import Liveness, ProbeAnswer, live_answer, liveness_of, ready_answer
from calfsm.serve.protocol import GenerationPlan, Limits, parse_chat, parse_completion
from calfsm.serve.responses import CHAT, COMPLETION, EventStream, Shape, sse, usage
from calfsm.serve.tokenizer import ByteTokenizer
from calfsm.serve.toolcalls import (
    DEFAULT_TOOL_PARSER,
    collect_tool_calls,
    tool_parser,
    with_tool_calls,
)
from calfsm.serve.tracecontext import TRACEPARENT, traced_start, traceparent_of
from calfsm.telemetry.metrics import ExecutorMetrics
from calfsm.util.lazy import bf16_dtype
from calfsm.util.lograte import RateLimitedLog

__all__ = ["ServerConfig", "client_usage", "create_app", "liveness", "shutdown"]

log = logging.getLogger("calfsm.serve")
_limited = RateLimitedLog(log)
#: every path the app answers (a 404's hint names the one a trailing slash missed)
_PATHS = frozenset({*GENERATION_PATHS, *PROBE_PATHS, "/v1/models", "/metrics"})
#: the header that names a request, in (optional: generated otherwise) and out
REQUEST_ID_HEADER = "x-request-id"

ExecutorFactory = Callable[[], Awaitable[DeviceExecutor]]
#: how often a shutdown that waits looks whether it was told to stop waiting
_FORCE_POLL_S = 0.1


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
    # ---- load and shutdown (calfsm/serve/front.py, shutdown()) ----
    #: generation requests handled at once; the next is a 429 with Retry-After at the
    #: app's front, before its body is read. None: the executor's max_sequences
    max_concurrent_requests: int | None = attrs.field(default=None,
                                                      validator=count_or_none)
    #: shutdown: seconds running streams may go on finishing before they are cut
    shutdown_grace_s: float = attrs.field(default=10.0, validator=non_negative)
    #: chats are rendered with this template (a calfsm.generate.chattemplate.ChatTemplate,
    #: ``--chat-template FILE``); None: the tokenizer's own (``chat_template``), else the
    #: built-in one (calfsm.serve.tokenizer.chat_prompt)
    chat_template: Any = None
    #: how a chat's answer is read for tool calls: a parser's name in
    #: calfsm.serve.toolcalls.TOOL_PARSERS (``--tool-call-parser``; default Hermes/Qwen's
    #: ``<tool_call>...</tool_call>``)
    tool_call_parser: str = attrs.field(default=DEFAULT_TOOL_PARSER)

    @tool_call_parser.validator
    def _known_parser(self, attribute: Any, value: Any) -> None:
        try:
            tool_parser(value)
        except InvalidArgument as e:
            raise InvalidArgument(f"ServerConfig.tool_call_parser: {e.message}",
                                  stage="config") from None

    def __attrs_post_init__(self) -> None:
        if self.default_max_tokens > self.max_tokens_cap:
            raise InvalidArgument(f"ServerConfig.default_max_tokens ({self.default_max_tokens}"
                                  f") must be <= max_tokens_cap ({self.max_tokens_cap})",
                                  stage="config")


class _Server:
    """The app's state: the executor (None while it starts), its metrics, the tokenizer
    and the limits of its model, and its shutdown."""

    def __init__(self, config: ServerConfig, registry: CollectorRegistry | None) -> None:
        self.config = config
        self.registry = registry
        self.executor: DeviceExecutor | None = None
        self.metrics: ExecutorMetrics | None = None
        self.refusals: Counter | None = None
        #: generation requests at once (front.py); None until there is an executor
        self.request_limit: int | None = None
        self.owned = False                   # the app started the executor and closes it
        self._starting: asyncio.Future[None] | None = None
        self._shutdown: asyncio.Future[None] | None = None
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        #: prompts' text -> ids: the executor's tokenizer, else the byte-level one
        self.tokenizer: Tokenizer | None = None
        #: the executor has a tokenizer: its streams match ``stop`` strings as text
        self.text_stops = False
        self.limits: Limits | None = None
        #: chats' template: the configured one, else the tokenizer's; None: built-in
        self.chat_template: Any = None
        self.books: ClientBooks | None = None
        self.start_error: str | None = None
        self.closing = False
        self.started = time.time()

    def attach(self, executor: DeviceExecutor) -> None:
        epoch = executor.epoch
        if epoch is None:
            raise InvalidArgument("the executor has no configured model", stage="serve")
        contract = epoch.contract(TaskKind.DECODE)
        self.text_stops = executor.tokenizer is not None
        self.tokenizer = executor.tokenizer if self.text_stops \
            else ByteTokenizer(contract.vocab)
        self.chat_template = self.config.chat_template \
            or getattr(executor.tokenizer, "chat_template", None)
        if constraints_available():
            # llguidance reads the tokenizer once (seconds at 151,936 ids): now, beside
            # the start-up, not in the first constrained request's parse
            threading.Thread(target=warm_constraints, args=(self.tokenizer, contract.vocab),
                             name="llguidance-warm", daemon=True).start()
        name = self.config.model_name or epoch.manifest.name or "calfsm"
        cfg = self.config
        context = ContextLimits.of(epoch.model)
        self.limits = Limits(name, context.vocab, context.max_seq,
                             cfg.default_max_tokens, cfg.max_choices, cfg.max_tokens_cap,
                             max_sequences=executor.max_sequences,
                             max_prompt=context.max_prompt)
        share = default_client_limit(executor.config.max_sequences)
        self.books = ClientBooks(cfg.max_client_streams or share,
                                 cfg.max_client_waiting or share)
        executor.add_observer(self.books)
        self.metrics = ExecutorMetrics(executor, registry=self.registry)
        self.refusals = Counter(
            "server_refusals", "Generation requests the server's front refused before "
            "they reached the executor, by reason: concurrency (ServerConfig."
            "max_concurrent_requests at once), shutdown.", ("reason",), namespace="calfsm",
            registry=self.metrics.registry)
        for reason in ("concurrency", "shutdown"):
            self.refusals.labels(reason)
        self.request_limit = self.config.max_concurrent_requests \
            or executor.config.max_sequences
        self.executor = executor

    def running(self) -> DeviceExecutor:
        ex = self.executor
        if ex is None or self.closing:
            why = self.start_error or ("shutting down" if self.closing else "starting")
            raise ApiError(503, f"the server is {why}", code="unavailable",
                           retry_after_s=None if self.start_error else 1.0)
        return ex

    # ---- probes and the front (front.py) ---------------------------------------------
    def probe(self, path: str) -> ProbeAnswer:
        """The answer of ``GET /health`` or ``GET /ready`` now."""
        if path == "/health":
            return live_answer(self.executor, self.start_error)
        return ready_answer(self.executor, self.start_error, closing=self.closing,
                            start_failed=self.start_error is not None)

    def now(self) -> float | None:
        """The executor's clock now (a request's arrival), None before there is one."""
        ex = self.executor
        return None if ex is None else ex.clock.now()

    def refused(self, reason: str) -> None:
        if self.refusals is not None:
            self.refusals.labels(reason).inc()

    # ---- start and shutdown --------------------------------------------------------
    def start(self, factory: ExecutorFactory) -> None:
        """Build the executor in the background (the lifespan's start-up). The device
        buffers' bfloat16 (ml_dtypes) is loaded here first, before the server listens:
        its extension's import holds the GIL throughout (~0.6 s of CPU, 4-5 s seen on a
        busy machine), and in the start-up thread it held every probe that long."""
        bf16_dtype()
        self.owned = True
        self._starting = asyncio.ensure_future(_start_owned(self, factory))

    def track(self, choices: list[Choice]) -> None:
        """The streams shutdown cuts if they outlast the grace."""
        self._streams.update(c.stream for c in choices)

    def cut(self) -> int:
        """End every stream of this app that is still running, each with a retryable
        ExecutorClosed (503); how many were cut."""
        n = 0
        for stream in list(self._streams):
            n += stream.abort(ExecutorClosed(
                "the server shut down before the stream finished", stage="shutdown",
                seq_id=stream.sequence.seq_id, retry_after_s=1.0))
        return n

    async def shutdown(self, grace_s: float | None = None,
                       force: Callable[[], bool] | None = None) -> None:
        """Stop admitting, let running streams finish for ``grace_s`` (default
        ``config.shutdown_grace_s``), cut the rest, close an owned executor; at once
        when ``force()`` turns True. Idempotent: a second call awaits the first."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._shut_down(
                self.config.shutdown_grace_s if grace_s is None else grace_s,
                force or (lambda: False)))
        await asyncio.shield(self._shutdown)

    async def _shut_down(self, grace: float, force: Callable[[], bool]) -> None:
        self.closing = True
        if self._starting is not None:
            self._starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, CalfsmError):
                await self._starting
        ex = self.executor
        if ex is None:
            return
        if self.owned:      # the executor gives its streams the grace, then cuts them
            work = asyncio.ensure_future(ex.aclose(grace_s=grace))
            await _until(work, math.inf, force)
        else:               # not ours to close: our own streams get the grace
            work = asyncio.gather(*(s.final() for s in list(self._streams)))
            await _until(work, grace, force)
        cut = self.cut()    # forced, or the grace passed (after aclose: none is left)
        try:
            await work
        except CalfsmError as e:
            log.error("shutdown: %s", e)
        if cut:
            log.info("shutdown: %d stream(s) cut after the grace (%g s)", cut, grace)

    def detach(self) -> None:
        """Take the metrics out of their registry and the client books off the executor
        (after shutdown)."""
        if self.books is not None and self.executor is not None:
            self.executor.remove_observer(self.books)
        if self.metrics is not None:
            if self.refusals is not None:
                self.metrics.registry.unregister(self.refusals)
            self.metrics.close()

    async def metrics_text(self, request: Request) -> Response:
        if self.metrics is None:
            raise ApiError(503, f"the server is {self.start_error or 'starting'}",
                           code="unavailable",
                           retry_after_s=None if self.start_error else 1.0)
        # Prometheus text, or OpenMetrics (with each histogram's request-id exemplars)
        # when the scraper asks for it
        encode, media = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(self.metrics.registry), media_type=media)

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
        return await self._generate(
            request, functools.partial(parse_chat, chat_template=self.chat_template,
                                       tool_parser=self.config.tool_call_parser), CHAT)

    async def _generate(self, request: Request, parse: Callable[..., GenerationPlan],
                        shape: Shape) -> Response:
        client = client_of(request.scope)
        given, rid = request.headers.get(REQUEST_ID_HEADER), None
        try:
            ex = self.running()
            assert self.limits is not None and self.tokenizer is not None
            assert self.books is not None
            try:
                rid = check_request_id(given, field=REQUEST_ID_HEADER) if given is not None \
                    else ex.live_requests.new_id()      # a bad one is never echoed
            except InvalidArgument as e:
                raise invalid_argument(e.message, REQUEST_ID_HEADER) from None
            arrival = request.scope.get(ARRIVAL_KEY)
            with self.books.waiting(client):
                body = parse_json(await read_body(request, self.config.max_body_bytes),
                                  self.config.max_json_depth)
                plan = parse(body, self.limits, self.tokenizer,
                             text_stops=self.text_stops)
                with traced_start(ex.request_tracer, request.headers):
                    choices = self._start(ex, plan, client, rid, arrival)
                tp = traceparent_of(ex.request_tracer,
                                    [c.stream.request_id for c in choices])
        except ApiError as e:
            return _with_id(_error_response(e, client), rid)
        except CalfsmError as e:
            return _with_id(_error_response(from_calfsm(e), client), rid)
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
                answer = await self._stream(request, plan, choices, shape, client)
            else:
                answer = await self._collect(request, plan, choices, shape, client)
        except Exception as e:
            answer = _internal(request, e)
        if tp is not None:
            answer.headers[TRACEPARENT] = tp
        return _with_id(answer, rid)

    def _start(self, ex: DeviceExecutor, plan: GenerationPlan, client: str,
               rid: str, arrival: float | None = None) -> list[Choice]:
        """A stream per choice, booked to ``client``, named ``rid`` (several choices:
        ``rid-i``, grouped under ``rid``); if one cannot start, those started are
        cancelled (a stream whose start failed half-way too)."""
        assert self.books is not None
        one = len(plan.prompts) == 1
        with self.books.opening(client, len(plan.prompts)) as started:
            choices: list[Choice] = []
            try:
                for i, (prompt, params) in enumerate(zip(plan.prompts, plan.params)):
                    choices.append(Choice(
                        ex, i, prompt, params, deadline_s=self.config.request_timeout_s,
                        request_id=rid if one else f"{rid}-{i}",
                        parent=None if one else rid, priority=plan.priority,
                        arrival=arrival))
            except BaseException:
                for stream in started:
                    stream.cancel()
                raise
        self.track(choices)
        return choices

    def _usage(self, plan: GenerationPlan, ends: list[Piece]) -> dict[str, Any]:
        # each prompt counted once, as prompt_tokens: by its first choice
        cached = sum(p.cached_tokens for p in ends if p.index % plan.n == 0)
        return usage(plan.prompt_tokens, sum(p.completion_tokens for p in ends), cached)

    async def _collect(self, request: Request, plan: GenerationPlan, choices: list[Choice],
                       shape: Shape, client: str) -> Response:
        """The whole answer at once; a client that leaves first cancels it."""
        texts = [[] for _ in choices]
        scored: list[list[Piece]] = [[] for _ in choices]     # token pieces, for logprobs
        ends: list[Piece | None] = [None] * len(choices)
        calls: list[list[dict[str, Any]]] = [[] for _ in choices]

        async def run() -> None:
            async for piece in _pieces(plan, choices):
                texts[piece.index].append(piece.text)
                calls[piece.index].extend(piece.tool_calls)
                if piece.event is not None:
                    scored[piece.index].append(piece)
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
            [p.finish_reason for p in done], self._usage(plan, done),
            scored if plan.logprobs is not None else None,
            [collect_tool_calls(c) for c in calls] if plan.tools is not None else None))

    async def _stream(self, request: Request, plan: GenerationPlan, choices: list[Choice],
                      shape: Shape, client: str) -> Response:
        """The headers go out once the executor has admitted every choice (its refusals
        at the door, 429/503, are synchronous and are proper statuses); the first event
        comes with the first token. What fails after the headers is an SSE error event."""
        refused = _refused_at_start(choices)
        pieces = _pieces(plan, choices)
        if refused is not None:
            await pieces.aclose()
            return _error_response(from_calfsm(refused), client)
        sent = [False]                  # a token's event has gone out (for the log line)
        assert self.limits is not None
        return EventStream(
            self._events(plan, shape, pieces, sent), close=pieces.aclose,
            on_disconnect=lambda: log.info(
                "%s left %s of %s", client, "in the middle of the stream" if sent[0]
                else "before the first token", request.url.path))

    async def _events(self, plan: GenerationPlan, shape: Shape,
                      pieces: AsyncIterator[Piece], sent: list[bool]) -> AsyncIterator[bytes]:
        assert self.limits is not None
        rid, model, created = shape.new_id(), self.limits.model, int(time.time())
        inc, lps = plan.include_usage, plan.logprobs is not None
        ends: list[Piece] = []
        # continuous_usage_stats: the usage so far on every chunk (tokens delivered)
        prompt_tokens, made = plan.prompt_tokens, 0

        def so_far() -> dict[str, Any] | None:
            return usage(prompt_tokens, made) if plan.continuous_usage else None

        try:
            # the chat's role chunks wait for the first piece: a client that times its
            # first token by its first chunk must not count them
            piece: Piece | None = await anext(pieces, None)
            sent[0] = True
            if shape.chat:
                for i in range(len(plan.prompts)):
                    yield sse(shape.chunk(rid, model, created, Piece(i, "", ()),
                                          include_usage=inc, role=True, used=so_far()))
            while piece is not None:
                if piece.error is not None:
                    yield sse(from_calfsm(piece.error).body())
                    yield sse("[DONE]")
                    return
                # with logprobs, a token whose text is not complete yet (a byte of a
                # character) still has its chunk: its logprobs are its own
                made += piece.event is not None
                if piece.text or piece.finish_reason or piece.tool_calls \
                        or (lps and piece.event is not None):
                    yield sse(shape.chunk(rid, model, created, piece, include_usage=inc,
                                          logprobs=lps, used=so_far()))
                if piece.finish_reason:
                    ends.append(piece)
                piece = await anext(pieces, None)
            if inc:
                yield sse(shape.usage_chunk(rid, model, created, self._usage(plan, ends)))
            yield sse("[DONE]")
        finally:
            await pieces.aclose()       # a client gone: its streams are cancelled


def _pieces(plan: GenerationPlan, choices: list[Choice]) -> AsyncIterator[Piece]:
    """The choices' pieces as they come; read for tool calls when the chat offered
    tools (calfsm.serve.toolcalls)."""
    if plan.tools is not None and plan.tools.parses:
        return with_tool_calls(merged(choices), plan.tools)
    return merged(choices)


def _refused_at_start(choices: list[Choice]) -> CalfsmError | None:
    """The error of a choice whose stream ended before it made anything (its first
    step refused at once: a full wait queue), else None."""
    for c in choices:
        result = c.stream.result(0) if c.stream.done() else None
        if result is not None and result.error is not None and not result.tokens:
            return result.error
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _internal(request: Request, exc: Exception) -> Response:
    """500 with an OpenAI body for an unexpected exception (logged with its traceback)."""
    log.error("unexpected %s on %s", type(exc).__name__, request.url.path, exc_info=exc)
    return _error_response(ApiError(500, f"internal error: {type(exc).__name__}",
                                    code="internal"))


def _with_id(answer: Response, rid: str | None) -> Response:
    """``answer`` carrying the request's id back (``X-Request-Id``)."""
    if rid is not None and REQUEST_ID_HEADER not in answer.headers:
        answer.headers[REQUEST_ID_HEADER] = rid
    return answer


def _error_response(err: ApiError, client: str | None = None) -> Response:
    if err.status >= 500:   # a storm (or a shutdown's cut) answers many: a burst a minute
        _limited.warning(f"answer_{err.status}", "answering %s: %s", err.status, err.message)
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
    (:class:`~calfsm.telemetry.metrics.ExecutorMetrics`) go to ``registry`` (default: one of the
    app's own) and ``GET /metrics`` serves that registry."""
    config = config or ServerConfig()
    server = _Server(config, registry)
    owned = not isinstance(executor, DeviceExecutor)
    if not owned:
        server.attach(executor)          # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if owned:
            server.start(executor)       # type: ignore[arg-type]
        try:
            yield
        finally:
            await server.shutdown()
            server.detach()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
    ]
    # the front first, so the probes are answered ahead of everything (no key needed)
    middleware = [Middleware(Front, server=server)]
    if config.api_keys:
        middleware.append(Middleware(BearerAuth, keys=ApiKeys(config.api_keys)))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={ApiError: _api_error, 404: _not_found,
                                        405: _not_allowed})
    # a path with a trailing slash is a 404 in OpenAI's format (OpenAI's own answer),
    # not Starlette's 307 with an empty body, which a POST client may follow without
    # its body or not at all
    app.router.redirect_slashes = False
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
    if server.executor is None:
        return Liveness(False, server.start_error or "starting", 0.0, 0)
    return liveness_of(server.executor.health())


async def shutdown(app: Starlette, *, grace_s: float | None = None,
                   force: Callable[[], bool] | None = None) -> None:
    """Shut ``app`` (made by :func:`create_app`) down gracefully, on its event loop: new
    generation requests are a 503 with Retry-After and ``/ready`` a 503 from now on;
    running streams may finish for ``grace_s`` (default
    ``ServerConfig.shutdown_grace_s``); then the rest are cut, each answered with a
    retryable 503, and an executor the app owns is closed. ``force()`` (polled every
    0.1 s) True: cut at once. Idempotent; the app's lifespan shutdown runs it too. Call
    it when your ASGI server is told to stop, before it waits for connections to close
    (:class:`calfsm.serve.graceful.GracefulServer` does so for uvicorn)."""
    server: _Server = app.state.calfsm
    await server.shutdown(grace_s, force)


async def _until(work: asyncio.Future[Any], timeout: float, force: Callable[[], bool]
                 ) -> None:
    """Wait for ``work`` for at most ``timeout`` seconds, or until ``force()``."""
    end = time.monotonic() + timeout
    while not work.done() and not force():
        left = end - time.monotonic()
        if left <= 0:
            return
        await asyncio.wait({work}, timeout=min(_FORCE_POLL_S, left))


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
    path = request.url.path
    hint = f" (did you mean {clip(path.rstrip('/'))}?)" \
        if path.endswith("/") and path.rstrip("/") in _PATHS else ""
    return _error_response(ApiError(404, f"no route {clip(path)}{hint}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error_response(ApiError(405, f"{clip(request.method)} is not allowed on "
                                         f"{clip(request.url.path)}"))
