"""Ray Serve replicas that keep their prompt caches: a request goes to the replica whose
prompt cache holds the longest prefix of its prompt, else to the least loaded one.

Ray's HTTP proxy hands a replica a request's headers, not its body, so a router behind
the proxy cannot see the prompt. :func:`routed_deployment` therefore binds two
deployments:

- ``CalfsmFront``, the ingress (no device): reads the body, derives its routing key
  (:func:`routing_key`) and passes the request whole to a backend through a
  ``DeploymentHandle``; it streams the backend's answer back as it comes.
- ``CalfsmBackend``, one replica per device: runs the reference app
  (:func:`~calfsm.serve.create_app`) over its own executor on the forwarded request, and
  reports what its prompt cache holds through Ray's ``record_routing_stats``.

The choice is Ray's own machinery: :class:`PromptCacheRouter` is a Ray Serve request
router (``RequestRouterConfig(request_router_class=...)``), the front's handle to the
backends runs it, and Ray probes the replicas' queue lengths, backs off while they are
full and retries. Nothing here balances load on its own.

What a replica holds
--------------------
A routing key is a chain of block hashes of the prompt (:func:`routing_key`): hash ``i``
covers the prompt's first ``i`` blocks, so two prompts share their first ``n`` hashes
exactly when they share their first ``n`` blocks. A backend records the key of each
request it serves as one prompt-cache entry (a turn that extends an earlier one takes
that entry's place, as the cache's own ``take``/``keep`` do), forgets its oldest ones as
its cache reports evictions (the cache evicts the least recently used first), and all of
them when a reset empties the cache. Every ``request_routing_stats_period_s`` Ray's
controller collects their block hashes and passes them to every router; until the next report a
router adds the keys it routed itself (as Ray's ``PrefixCacheAffinityRouter`` keeps a
tree of routed prompts), so the second turn of a conversation follows the first at once.
The keys are a mirror of the cache, not the cache: a request that failed before its
sequence was kept still counts until it ages out.

``/metrics`` through the front adds, to the answering replica's own metrics, the counters
``calfsm_replica_prompt_cache_hits_total`` and
``calfsm_replica_prompt_cache_reused_tokens_total`` labelled ``replica`` (Ray's replica
tag): every replica's own totals as it last reported them to this front, so a scrape says
which replica served from its cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Container, Iterable
from typing import Any

import attrs
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from calfsm.executor import DeviceExecutor
from calfsm.serve.app import ServerConfig
from calfsm.serve.httperrors import ApiError
from calfsm.serve.ray_serve import ExecutorReplica, device_deployment

__all__ = ["BLOCK_BYTES", "BLOCK_TOKENS", "CalfsmBackend", "CalfsmFront", "Candidate",
           "ForwardedRequest", "HeldPrefixes", "PromptCacheRouter", "ReplicaCounters",
           "ReplicaPrefixes", "rank", "replica_families", "routed_deployment", "routing_key",
           "with_replica_counters"]

log = logging.getLogger("calfsm.serve.ray_route")

#: a routing key's block: this many bytes of a text prompt (UTF-8; about 16 tokens) ...
BLOCK_BYTES = 64
#: ... or this many token ids of a prompt given as ids
BLOCK_TOKENS = 16
#: keys a router remembers per replica between its reports, at most
_MAX_ROUTED = 4096
#: paths whose body holds a prompt
_PROMPT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


# ---- routing keys -------------------------------------------------------------------
def _chain(kind: bytes, data: bytes, block: int) -> tuple[int, ...]:
    """The hash of each whole block of ``data`` and every block before it."""
    out = []
    h = hashlib.blake2b(kind, digest_size=8).digest()
    for i in range(len(data) // block):
        h = hashlib.blake2b(h + data[i * block:(i + 1) * block], digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return tuple(out)


def _text(content: Any) -> str:
    """A chat message's content as text (a string, or the text of its parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (p.get("text") for p in content if isinstance(p, dict))
        return "".join(t for t in texts if isinstance(t, str))
    return ""


def routing_key(path: str, body: bytes) -> tuple[int, ...]:
    """The routing key of a request to ``path`` with ``body``: the block hashes of its
    prompt (the first prompt of a batch; a chat's messages, role and text, in order).
    Empty when the body names no prompt or is not JSON (the backend answers it; a key
    only steers where it goes) or the prompt is shorter than one block."""
    if path not in _PROMPT_PATHS:
        return ()
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return ()
    if not isinstance(doc, dict):
        return ()
    if path == "/v1/chat/completions":
        messages = doc.get("messages")
        if not isinstance(messages, list):
            return ()
        text = "".join(f"{m.get('role')}\x1f{_text(m.get('content'))}\x1e"
                       for m in messages if isinstance(m, dict))
        return _chain(b"chat", text.encode("utf-8", "replace"), BLOCK_BYTES)
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]                  # a batch: its first prompt
    if isinstance(prompt, str):
        return _chain(b"text", prompt.encode("utf-8", "replace"), BLOCK_BYTES)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        and 0 <= t < 1 << 32 for t in prompt):
        data = b"".join(t.to_bytes(4, "little") for t in prompt)
        return _chain(b"ids", data, 4 * BLOCK_TOKENS)
    return ()


class HeldPrefixes:
    """Routing keys standing for prompt-cache entries, least recently used first: how
    many leading blocks of a key one of them holds (:meth:`match`)."""

    def __init__(self, chains: Iterable[Iterable[int]] = ()) -> None:
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()    # by last hash
        self._owners: dict[int, set[int]] = {}      # hash -> the entries holding it
        self._stamp: dict[int, int] = {}            # entry -> when it was last added
        self._clock = 0
        for c in chains:
            self.add(tuple(c))

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, key: tuple[int, ...]) -> int:
        """Leading blocks of ``key`` some entry holds (hash ``i`` covers blocks 0..i)."""
        return _match(self._owners, key)

    def hashes(self) -> list[int]:
        """Every block hash the entries hold, each once (a prefix the entries share,
        such as a system prompt, is one run of hashes)."""
        return list(self._owners)

    def add(self, key: tuple[int, ...]) -> None:
        """``key`` was served: the entry sharing its longest prefix (the one the cache
        would take; the most recently used of equals) is replaced by ``key``, now the
        most recently used."""
        if not key:
            return
        n = self.match(key)
        if n:
            owners = self._owners[key[n - 1]]
            self._remove(max(owners, key=self._stamp.__getitem__))
        if key[-1] in self._entries:        # the same key again (n was all of it)
            self._remove(key[-1])
        self._entries[key[-1]] = key
        self._clock += 1
        self._stamp[key[-1]] = self._clock
        for h in key:
            self._owners.setdefault(h, set()).add(key[-1])

    def _remove(self, last: int) -> None:
        del self._stamp[last]
        for h in self._entries.pop(last):
            owners = self._owners[h]
            owners.discard(last)
            if not owners:
                del self._owners[h]

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` least recently used entries (the cache evicted as many)."""
        for _ in range(min(n, len(self._entries))):
            self._remove(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._owners.clear()
        self._stamp.clear()

    def chains(self) -> list[tuple[int, ...]]:
        return list(self._entries.values())


# ---- what crosses between the deployments ---------------------------------------------
@attrs.frozen
class ForwardedRequest:
    """An HTTP request the front read whole, for a backend: its ASGI scope's fields,
    its body and its routing key."""

    scope: dict[str, Any]
    body: bytes
    key: tuple[int, ...]


@attrs.frozen
class ReplicaCounters:
    """A backend's prompt-cache totals, the last item of each answer it streams."""

    replica: str
    hits: int
    reused_tokens: int


#: the ASGI scope keys a backend needs (the rest are the proxy's own, or unpicklable)
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path",
               "query_string", "root_path", "headers", "client", "server")


# ---- the router ---------------------------------------------------------------------
def _match(hashes: Container[int], key: tuple[int, ...]) -> int:
    n = 0
    while n < len(key) and key[n] in hashes:
        n += 1
    return n


class ReplicaPrefixes:
    """One router's view of one replica's prompt cache: the block hashes of the
    replica's last report (:meth:`CalfsmBackend.record_routing_stats`), and the keys
    this router sent it since (a key routed more than ``margin_s`` before a report is in
    it, or evicted)."""

    def __init__(self, margin_s: float = 2.0) -> None:
        self.margin_s = margin_s
        self.reported: frozenset[int] = frozenset()
        self.reported_entries = 0
        self.report_at = -math.inf
        self._routed = HeldPrefixes()
        self._routed_at: list[tuple[float, tuple[int, ...]]] = []
        self._held: int | None = None       # held(), until a key or a report comes

    def routed(self, key: tuple[int, ...], now: float) -> None:
        if not key:
            return
        self._held = None
        self._routed.add(key)
        self._routed_at.append((now, key))
        if len(self._routed_at) > _MAX_ROUTED:      # no report for long: the newest
            self._keep_routed(self._routed_at[-_MAX_ROUTED:])

    def report(self, stats: dict[str, Any] | None) -> None:
        """The replica's routing stats as Ray last passed them (a report seen before,
        or none, changes nothing)."""
        stats = stats or {}
        at = stats.get("at")
        if not isinstance(at, int | float) or at <= self.report_at:
            return
        self.report_at = at
        self._held = None
        self.reported = frozenset(stats.get("hashes") or ())
        self.reported_entries = int(stats.get("entries") or 0)
        cutoff = at - self.margin_s
        if self._routed_at and self._routed_at[0][0] < cutoff:
            self._keep_routed([(t, k) for t, k in self._routed_at if t >= cutoff])

    def _keep_routed(self, routed: list[tuple[float, tuple[int, ...]]]) -> None:
        self._routed_at = routed
        self._routed = HeldPrefixes(k for _, k in routed)

    def match(self, key: tuple[int, ...]) -> int:
        return max(_match(self.reported, key), self._routed.match(key))

    def held(self) -> int:
        """Prefixes held: the reported ones and the routed ones not among them."""
        if self._held is None:
            self._held = self.reported_entries + sum(
                1 for k in self._routed.chains() if _match(self.reported, k) < len(k))
        return self._held


@attrs.frozen
class Candidate:
    """A replica as the router weighs it for one request."""

    replica: Any
    match: int      #: leading blocks of the request's key its prompt cache holds
    held: int       #: prefixes its prompt cache holds
    queue: int      #: requests it has ongoing (0 when unknown)


def rank(candidates: list[Candidate], *, imbalanced_threshold: float = 8,
         min_match_blocks: int = 1) -> list[list[Any]]:
    """The replicas in Ray's ranks (Ray takes, rank by rank, the least loaded replica
    that is not full): those holding the longest prefix first, the rest after, the
    longer prefix first; when no replica holds ``min_match_blocks``, or the holder has
    ``imbalanced_threshold`` more requests than the least loaded, one rank, those
    holding the fewest prefixes first (on a tie of load, so new conversations spread)."""
    if not candidates:
        return []
    by_room = [c.replica for c in sorted(candidates, key=lambda c: c.held)]
    best = max(c.match for c in candidates)
    if best < max(1, min_match_blocks):
        return [by_room]
    preferred = [c for c in candidates if c.match == best]
    if min(c.queue for c in preferred) - min(c.queue for c in candidates) \
            > imbalanced_threshold:
        return [by_room]
    rest = sorted((c for c in candidates if c.match < best),
                  key=lambda c: (-c.match, c.held))
    first = [c.replica for c in preferred]
    return [first, [c.replica for c in rest]] if rest else [first]


class PromptCacheRouter(RequestRouter):
    """A Ray Serve request router: the replica whose prompt cache holds the longest
    prefix of the request's prompt (:func:`routing_key`; what the replicas report in
    their routing stats, and what this router sent them since), unless its queue is
    ``imbalanced_threshold`` requests longer than the shortest; otherwise the least
    loaded replica (Ray's queue lengths), the one holding the fewest prefixes on a tie,
    so new conversations spread out (:func:`rank`)."""

    def initialize_state(self, imbalanced_threshold: float = 8, min_match_blocks: int = 1,
                         report_margin_s: float = 2.0) -> None:
        """``request_router_kwargs``: ``imbalanced_threshold`` (ongoing requests above
        the least loaded replica at which a cached prefix no longer draws a request),
        ``min_match_blocks`` (blocks a prefix must share to count), ``report_margin_s``
        (how long after routing a request its key is taken to be in the replica's
        next report: delivery and the clocks' skew)."""
        self._imbalanced = imbalanced_threshold
        self._min_match = min_match_blocks
        self._margin = report_margin_s
        self._views: dict[ReplicaID, ReplicaPrefixes] = {}

    # -- Ray's hooks
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # back off between rounds when every chosen replica is full (Ray's mixins
            # set this; without it the routing task would spin)
            pending_request.routing_context.should_backoff = True
        key = _key_of(pending_request)
        candidates = []
        for r in candidate_replicas:
            view = self._view(r.replica_id)
            view.report(r.routing_stats)
            q = self.replica_queue_len_cache.get(r.replica_id)
            candidates.append(Candidate(r, view.match(key) if key else 0, view.held(),
                                        0 if q is None else q))
        return rank(candidates, imbalanced_threshold=self._imbalanced,
                    min_match_blocks=self._min_match)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self._view(replica_id).routed(_key_of(pending_request), time.time())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self._views if rid not in live]:
            del self._views[gone]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._views.pop(replica_id, None)

    def _view(self, replica_id: ReplicaID) -> ReplicaPrefixes:
        view = self._views.get(replica_id)
        if view is None:
            view = self._views[replica_id] = ReplicaPrefixes(self._margin)
        return view


def _key_of(pending: PendingRequest | None) -> tuple[int, ...]:
    if pending is None or not pending.args:
        return ()
    # by its attribute, not its class: Ray may unpickle the router's module and the
    # front's separately, so one class can be two objects in the router's process
    key = getattr(pending.args[0], "key", ())
    return key if isinstance(key, tuple) else ()


# ---- the deployments ----------------------------------------------------------------
class CalfsmBackend(ExecutorReplica):
    """One device's replica behind the front: its executor, the reference app over it
    (called in process for each forwarded request), its liveness as the health check,
    and the routing keys its prompt cache holds as its routing stats."""

    def __init__(self, build: Callable[[], DeviceExecutor],
                 config: ServerConfig | None = None) -> None:
        super().__init__(build, config)
        self.held = HeldPrefixes()
        self._evicted = self._resets = 0
        self._report: dict[str, Any] = {}
        try:
            self.replica = serve.get_replica_context().replica_tag
        except RayServeException:   # outside a replica (a test's direct call)
            self.replica = "local"

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[Any]:
        """Run ``request`` through the app: its ASGI messages out as they are sent,
        then this replica's :class:`ReplicaCounters`."""
        self._refresh()
        if request.key:
            self.held.add(request.key)
        out: asyncio.Queue[Any] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await out.put(message)

        done = object()
        app = asyncio.ensure_future(self.asgi(dict(request.scope), receive, send))
        app.add_done_callback(lambda _: out.put_nowait(done))
        try:
            while (message := await out.get()) is not done:
                yield message
            app.result()                        # the app's own exception, if any
        finally:
            gone.set()                          # the client left (or the answer ended)
            if not app.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(app), 5.0)
        yield self.counters()

    def counters(self) -> ReplicaCounters:
        st = self.executor.prompt_cache_stats()
        return ReplicaCounters(self.replica, st.hits if st else 0,
                               st.reused_tokens if st else 0)

    def _refresh(self) -> None:
        """Mirror the cache's evictions: the oldest keys go as its entries went; all of
        them after a reset emptied it."""
        st = self.executor.prompt_cache_stats()
        if st is None:
            self.held.clear()
            return
        resets = st.evictions["reset"]
        evicted = st.evictions["budget"] + st.evictions["room"]
        if resets > self._resets:
            self.held.clear()
        else:
            self.held.drop_oldest(evicted - self._evicted)
        self._resets, self._evicted = resets, evicted
        self.held.drop_oldest(len(self.held) - st.max_sequences)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray's hook: the block hashes this replica's prompt cache holds (each once)
        and its entries, with the time they were last seen to change (the same answer
        while they do not: Ray passes a replica's stats to the routers only when they
        change)."""
        self._refresh()
        hashes, entries = self.held.hashes(), len(self.held)
        if hashes != self._report.get("hashes") or entries != self._report.get("entries"):
            self._report = {"at": time.time(), "hashes": hashes, "entries": entries}
        return self._report


class CalfsmFront:
    """The ingress: each HTTP request read whole, keyed and handed to a backend through
    the handle (whose router picks the replica), its answer streamed back; ``/metrics``
    gains the per-replica prompt-cache counters."""

    def __init__(self, backend: Any, config: ServerConfig | None = None) -> None:
        self.backend = backend.options(method_name="handle", stream=True)
        self.max_body = (config or ServerConfig()).max_body_bytes
        self.replicas: dict[str, ReplicaCounters] = {}

    def __serve_build_asgi_app__(self) -> Any:
        return _Asgi(self.asgi)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body:
                await _answer(send, ApiError(413, f"the request body is over "
                                                  f"{self.max_body} bytes"))
                return
            if not message.get("more_body"):
                break
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):      # under a route prefix
            path = path[len(root):]
        fwd = ForwardedRequest({k: scope[k] for k in _SCOPE_KEYS if k in scope},
                               bytes(body), routing_key(path, bytes(body)))
        metrics = path == "/metrics" and scope.get("method") == "GET"
        started = False
        held: list[dict[str, Any]] = []
        try:
            async for item in self.backend.remote(fwd):
                if isinstance(item, ReplicaCounters):
                    self.replicas[item.replica] = item
                elif metrics:
                    held.append(item)
                else:
                    started = True
                    await send(item)
        except Exception as e:      # the replica died or Ray could not reach one
            if started:
                raise
            log.warning("no calfsm replica answered %s: %s", path, e)
            await _answer(send, ApiError(503, "no replica could answer the request",
                                         code="unavailable", retry_after_s=1.0))
            return
        if metrics:
            for message in with_replica_counters(held, self.replicas.values()):
                await send(message)


class _Asgi:
    """An ASGI 3 app of a coroutine function (uvicorn, which runs Ray's lifespan, takes
    a bound method for an ASGI 2 app)."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self._call(scope, receive, send)


async def _answer(send: Any, err: ApiError) -> None:
    body = err.json()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers().items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def replica_families(replicas: Iterable[ReplicaCounters], openmetrics: bool) -> bytes:
    """The per-replica counters in Prometheus' text format (OpenMetrics' without its
    ``# EOF``)."""
    out = []
    for name, doc, attr in (
            ("calfsm_replica_prompt_cache_hits", "Generates that took a cached sequence, "
             "by the Ray Serve replica that served them.", "hits"),
            ("calfsm_replica_prompt_cache_reused_tokens", "Prompt tokens the hits did not "
             "prefill, by the Ray Serve replica that served them.", "reused_tokens")):
        out.append(f"# HELP {name}{'' if openmetrics else '_total'} {doc}")
        out.append(f"# TYPE {name}{'' if openmetrics else '_total'} counter")
        for r in sorted(replicas, key=lambda r: r.replica):
            label = r.replica.replace("\\", "\\\\").replace('"', '\\"')
            out.append(f'{name}_total{{replica="{label}"}} {getattr(r, attr)}')
    return ("\n".join(out) + "\n").encode()


def with_replica_counters(messages: list[dict[str, Any]],
                           replicas: Iterable[ReplicaCounters]) -> list[dict[str, Any]]:
    """A backend's buffered ``/metrics`` answer with the per-replica counters added
    (before OpenMetrics' ``# EOF``), its content-length set again."""
    start = next((m for m in messages if m["type"] == "http.response.start"), None)
    if start is None or start.get("status") != 200:
        return messages
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
    openmetrics = ctype.startswith(b"application/openmetrics-text")
    extra = replica_families(list(replicas), openmetrics)
    if openmetrics and body.endswith(b"# EOF\n"):
        body = body[:-len(b"# EOF\n")] + extra + b"# EOF\n"
    else:
        body += extra
    headers.append((b"content-length", str(len(body)).encode()))
    return [{**start, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False}]


def routed_deployment(build: Callable[[], DeviceExecutor], *,
                      config: ServerConfig | None = None, resource: str = "calculet_npu",
                      num_replicas: int = 1, name: str = "calfsm",
                      health_check_period_s: float = 2.0,
                      health_check_timeout_s: float = 10.0, num_cpus: float = 1.0,
                      max_ongoing_requests: int = 64, routing_stats_period_s: float = 2.0,
                      router_kwargs: dict[str, Any] | None = None,
                      front_options: dict[str, Any] | None = None,
                      **options: Any) -> Any:
    """The bound Ray Serve application: a front (``{name}-front``, the HTTP ingress)
    before ``num_replicas`` backends (``name``), each on one unit of ``resource``,
    routed by :class:`PromptCacheRouter` (``router_kwargs``: its
    ``initialize_state``'s); ``serve.run(routed_deployment(build, num_replicas=2))``.
    ``max_ongoing_requests``: requests one backend takes at once (Ray routes elsewhere,
    or waits, past it). Other keyword arguments go to the backends'
    ``serve.deployment``; ``front_options`` to the front's."""
    backend = device_deployment(
        CalfsmBackend, name=name, resource=resource, num_replicas=num_replicas,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=health_check_timeout_s, num_cpus=num_cpus,
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=PromptCacheRouter,
            request_router_kwargs=dict(router_kwargs or {}),
            request_routing_stats_period_s=routing_stats_period_s),
        **options)
    front = serve.deployment(serve.ingress()(CalfsmFront), name=f"{name}-front",
                             **({"ray_actor_options": {"num_cpus": 0},
                                 "max_ongoing_requests": 1024} | (front_options or {})))
    return front.bind(backend.bind(build, config), config)
