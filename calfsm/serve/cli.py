"""``calfsm serve``: the reference server under uvicorn, on the real-time simulated device.

``calfsm.tools.cli`` adds this subcommand with :func:`add_parser` and runs it with :func:`run`;
nothing here imports the server's dependencies until it runs, so ``calfsm --help`` works
without the ``server`` extra. The executor is built inside the app's lifespan: the port
answers at once, ``/health`` and ``/ready`` say 503 while the device warms up (what a
startup probe waits for), and a start-up that fails stops the server with exit status 3.

The socket is bound here, before uvicorn starts: a bad ``--host``/``--port``, or an
address in use, is a usage error (exit 2, one line), and ``calfsm: listening on
http://HOST:PORT`` on stderr gives the port really bound (``--port 0``: any free one)
once uvicorn accepts connections. Every bad option is exit 2 with one line on stderr.

SIGTERM or Ctrl-C stops it gracefully (:class:`calfsm.serve.graceful.GracefulServer`):
no new work, running streams get ``--shutdown-grace`` seconds, the rest are cut with a
retryable 503 each, and the process exits 0 about half a second after that.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import attrs

from calfsm.drivers import driver_names, load_driver
from calfsm.errors import CalfsmError, InvalidArgument
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.promptcache import PromptCacheConfig
from calfsm.generate.tokenizer import ByteTokenizer
from calfsm.manifest import (
    Manifest,
    StepTiming,
    TaskKind,
    builtin_manifest_names,
    manifest_from_option,
)
from calfsm.serve.toolcalls import DEFAULT_TOOL_PARSER, TOOL_PARSERS

__all__ = ["add_parser", "configs", "run", "warn_if_open"]

EXIT_OK, EXIT_USAGE, EXIT_DEVICE_FAILED = 0, 2, 3
#: uvicorn's own wait for connections, after the app's graceful shutdown has ended or
#: cut every stream (only an answer a client does not read can still be open then)
_AFTER_GRACE_S = 0.5

log = logging.getLogger("calfsm.serve")

_DESCRIPTION = """\
Serve the OpenAI-compatible API (completions, chat, SSE streaming), /health, /ready and
/metrics over one executor, by default on the simulated device in real time. It binds
127.0.0.1 (this machine only) unless --host says otherwise; to serve a network, give it
an API key (--api-key or CALFSM_API_KEY). Needs the server extra: pip install -e
".[server]". See docs/serving.md."""

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _host(value: str) -> str:
    """An IP address or a host name (syntax only; it is resolved when bound)."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(value))
    labels = value.rstrip(".").split(".")
    if len(value) <= 253 and all(_LABEL.fullmatch(label) for label in labels) \
            and not labels[-1].isdigit():
        return value
    raise argparse.ArgumentTypeError(f"not an IP address or a host name: {value!r}")


def _number(convert: Callable[[str], float], ok: Callable[[float], bool],
            what: str) -> Callable[[str], Any]:
    """An argparse type: ``convert(value)`` if ``ok`` of it, else a usage error."""
    def parse(value: str) -> Any:
        try:
            number = convert(value)
        except ValueError:
            number = None
        if number is None or not ok(number):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}")
        return number
    return parse


_port = _number(int, lambda n: 0 <= n <= 65535, "a port number in 0..65535 (0: any free "
                                                 "port)")
_at_least_one = _number(int, lambda n: n >= 1, "an integer >= 1")
_seconds = _number(float, lambda s: 0 < s < float("inf"), "a number of seconds > 0")

#: ``--prompt-cache SEQS`` without TOKENS: this many tokens of KV per cached sequence
CACHE_TOKENS_PER_SEQUENCE = 4096


def _cache_budget(value: str) -> tuple[int, int | None]:
    """``SEQS[,TOKENS]``: both integers >= 1."""
    parts = value.split(",")
    numbers = [_at_least_one(part.strip()) for part in parts] if len(parts) <= 2 else []
    if not numbers:
        raise argparse.ArgumentTypeError(f"must be SEQS or SEQS,TOKENS, got {value!r}")
    return numbers[0], numbers[1] if len(numbers) == 2 else None


def _one_line_error(prog: str) -> Callable[[str], NoReturn]:
    """argparse's usage error as one line (exit 2), not the usage text and the error."""
    def error(message: str) -> NoReturn:
        print(f"calfsm: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    return error


def add_parser(sub: Any, **kw: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to ``calfsm``'s subcommands."""
    from calfsm.serve.connection_limits import ConnectionLimits
    limits = ConnectionLimits()
    p = sub.add_parser("serve", help="run the OpenAI-compatible reference server",
                       description=_DESCRIPTION, **kw)
    p.error = _one_line_error(p.prog)      # type: ignore[method-assign]
    p.add_argument("--host", type=_host, default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only); an "
                        "address others can reach needs --api-key, else the server "
                        "warns at start that anyone who reaches it can use it")
    p.add_argument("--port", type=_port, default=8000,
                   help="port to bind, 0..65535 (0: any free port; the 'listening on' "
                        "line on stderr says which)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="accept requests with 'Authorization: Bearer KEY' only (every "
                        "route but /health and /ready); repeat for several keys. "
                        "Default: the comma-separated keys of $CALFSM_API_KEY, else none")
    p.add_argument("--driver", default="sim", choices=driver_names(),
                   help="sim: the simulated device in real time (--decode-ms, "
                        "--prefill-token-us); calrt: the C ABI through cffi")
    p.add_argument("--manifest", default="qwen3-b1", metavar="NAME|PATH",
                   help=f"a built-in name ({', '.join(builtin_manifest_names())}) or a "
                        "manifest file")
    p.add_argument("--evidence-dir", default=None, metavar="DIR",
                   help="where the vendor runners' evidence files are (default: the "
                        "executor's own default)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the model's Hugging Face tokenizer, as save_pretrained writes it "
                        "(tokenizer.json, and tokenizer_config.json's chat template and "
                        "special tokens); needs the hf extra. Default: the byte-level "
                        "tokenizer and the built-in chat template")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="render chats with the Jinja2 template in FILE (as a "
                        "tokenizer_config.json's chat_template; needs the hf extra) "
                        "instead of the tokenizer's own or the built-in one")
    p.add_argument("--tool-call-parser", default=DEFAULT_TOOL_PARSER, metavar="NAME",
                   choices=sorted(TOOL_PARSERS),
                   help="how a chat's answer is read for tool calls: "
                        f"{', '.join(sorted(TOOL_PARSERS))} (hermes: <tool_call>{{\"name\": "
                        "..., \"arguments\": ...}</tool_call>, as Hermes and Qwen write "
                        "it)")
    p.add_argument("--model-name", default=None,
                   help="the name clients send as 'model' (default: the manifest's name)")
    p.add_argument("--decode-ms", type=float, default=10.0,
                   help="sim: wall milliseconds per decode step")
    p.add_argument("--prefill-token-us", type=float, default=50.0,
                   help="sim: wall microseconds per prefilled token")
    p.add_argument("--batch-row-share", type=float, default=0.0, metavar="S",
                   help="sim, batch calbin: what each row past the first adds to a batch "
                        "decode step, as a share of --decode-ms (0 <= S < 1; a model)")
    p.add_argument("--shape-cost", default="graph", choices=("graph", "rows"),
                   help="sim: what a step costs: graph, a static calbin's (its graph's "
                        "whole batch, padded rows included; the default), or rows, a "
                        "dynamic-shape device's (the rows it carries); both are models")
    p.add_argument("--faults", default="none", metavar="none|swarm|PLAN.json",
                   help="sim: a fault plan (swarm: a random one drawn from --seed)")
    p.add_argument("--seed", type=int, default=0, help="seeds the driver and swarm plan")
    p.add_argument("--max-sequences", type=_at_least_one, default=64,
                   help="choices (streams) at once; a request past them is answered 429")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--prompt-cache", type=_cache_budget, default=None,
                       metavar="SEQS[,TOKENS]",
                       help="keep up to SEQS finished requests' sequences warm, holding "
                            f"TOKENS of KV in all (default {CACHE_TOKENS_PER_SEQUENCE} a "
                            "sequence), so a prompt that repeats one's start (a chat's "
                            "history) prefills only the rest (default: half of "
                            "--max-sequences, at least 1)")
    cache.add_argument("--no-prompt-cache", action="store_true",
                       help="release every request's sequence when it ends")
    p.add_argument("--max-waiting", type=_at_least_one, default=None,
                   help="jobs that may wait for the device, else 429 (default: twice "
                        "--max-sequences: a stream has at most one step queued and one "
                        "prepared ahead, so a running stream's next step is never refused)")
    p.add_argument("--max-client-streams", type=_at_least_one, default=None,
                   help="streams one client (its API key, else its address) may hold at "
                        "once, else 429 (default: half of --max-sequences, at least 1)")
    p.add_argument("--max-client-waiting", type=_at_least_one, default=None,
                   help="requests of one client that may wait to start (being uploaded "
                        "or parsed) at once, else 429 (default: as --max-client-streams' "
                        "default)")
    p.add_argument("--request-timeout", type=_seconds, default=60.0,
                   help="seconds a choice may take, then 504")
    p.add_argument("--hang-after", type=_seconds, default=5.0,
                   help="liveness: seconds a job may stay on the device (and past its "
                        "execution timeout) before /health answers 503")
    p.add_argument("--default-max-tokens", type=_at_least_one, default=16,
                   help="tokens per choice when a request gives no max_tokens (clipped to "
                        "what the context leaves after the prompt)")
    p.add_argument("--max-tokens-cap", type=_at_least_one, default=4096,
                   help="a request's max_tokens (chat: max_completion_tokens) above this "
                        "is a 400, and so is one that does not fit the context after the "
                        "prompt")
    p.add_argument("--header-timeout", type=_seconds, default=limits.header_timeout_s,
                   help="seconds a connection has to send complete request headers, from "
                        "its start or a request's first byte, else 408 and close")
    p.add_argument("--body-timeout", type=_seconds, default=limits.body_timeout_s,
                   help="seconds a request body has to arrive after its headers, else 408 "
                        "and close")
    p.add_argument("--keep-alive", type=_seconds, default=limits.keep_alive_s,
                   help="seconds an idle connection stays open between requests (longer "
                        "than the clients' pool expiry, 5 s for httpx and openai)")
    p.add_argument("--max-header-bytes", type=_at_least_one,
                   default=limits.max_header_bytes,
                   help="request line and headers larger than this are a 431")
    p.add_argument("--max-connections", type=_at_least_one,
                   default=limits.max_connections,
                   help="open connections at most; a new one past them is closed at once")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export a span tree per request to this OTLP/HTTP collector "
                        "(e.g. http://127.0.0.1:4318/v1/traces; needs calfsm[tracing]); "
                        "W3C traceparent in and out")
    # ---- shutdown ----
    p.add_argument("--shutdown-grace", type=float, default=10.0, metavar="S",
                   help="on SIGTERM/Ctrl-C: seconds running streams may go on finishing "
                        "before they are cut (503); new requests get 503 at once")
    return p


def _tracer_provider(endpoint: str | None) -> Any:
    """The OTLP tracer provider of ``--otlp-traces-endpoint`` (None: no tracing)."""
    if endpoint is None:
        return None
    from calfsm.telemetry.tracing import otlp_tracer_provider
    return otlp_tracer_provider(endpoint)


def _driver(args: argparse.Namespace, manifest: Manifest) -> Any:
    from calfsm.drivers.faults import FaultPlan
    from calfsm.serve.realtime import realtime_sim
    if args.faults == "none":
        faults = FaultPlan.none()
    elif args.faults == "swarm":
        faults = FaultPlan.swarm(args.seed)
    else:
        faults = FaultPlan.load(args.faults)
    if args.driver == "sim":
        return realtime_sim(manifest, decode_ms=args.decode_ms,
                            prefill_token_us=args.prefill_token_us, seed=args.seed,
                            faults=faults, batch_row_share=args.batch_row_share,
                            shape_cost=args.shape_cost)
    return load_driver(args.driver, manifest_or_calbin=manifest, seed=args.seed,
                       faults=faults)


def _timed(args: argparse.Namespace, manifest: Manifest) -> Manifest:
    """The simulated device's step times are known exactly: they are what the executor
    expects (its hang detection and its first admission estimates, before anything was
    measured), instead of the manifest's figures for a real device."""
    if args.driver != "sim" or not (args.decode_ms > 0 and args.prefill_token_us > 0):
        return manifest
    return attrs.evolve(manifest, timing=StepTiming(decode_ms=args.decode_ms,
                                                    prefill_token_us=args.prefill_token_us))


@contextlib.contextmanager
def _stop_signals_handled() -> Iterator[None]:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the
    handler that was there before: make that one a no-op, so a clean stop exits 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT,
                                                                  signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def configs(args: argparse.Namespace) -> tuple[ExecutorConfig, Any, Any]:
    """The executor's, the app's and the connections' configuration from the options."""
    from calfsm.serve.app import ServerConfig
    from calfsm.serve.auth import ENV_VAR, ApiKeys, keys_from_env
    from calfsm.serve.connection_limits import ConnectionLimits
    if args.api_key is not None:
        keys, source = args.api_key, "--api-key"
    else:
        keys, source = keys_from_env(), ENV_VAR
    ApiKeys(keys, source=source)
    if args.default_max_tokens > args.max_tokens_cap:
        raise InvalidArgument(f"--default-max-tokens {args.default_max_tokens} is over "
                              f"--max-tokens-cap {args.max_tokens_cap}", stage="cli")
    exconfig = ExecutorConfig(max_waiting=args.max_waiting or 2 * args.max_sequences,
                              max_sequences=args.max_sequences,
                              evidence_dir=args.evidence_dir,
                              hang_after_s=args.hang_after,
                              prompt_cache=_prompt_cache(args))
    config = ServerConfig(model_name=args.model_name,
                          chat_template=_chat_template(args),
                          tool_call_parser=args.tool_call_parser,
                          request_timeout_s=args.request_timeout,
                          shutdown_grace_s=args.shutdown_grace,
                          default_max_tokens=args.default_max_tokens,
                          max_tokens_cap=args.max_tokens_cap,
                          api_keys=tuple(keys),
                          max_client_streams=args.max_client_streams,
                          max_client_waiting=args.max_client_waiting)
    limits = ConnectionLimits(header_timeout_s=args.header_timeout,
                              body_timeout_s=args.body_timeout,
                              keep_alive_s=args.keep_alive,
                              max_header_bytes=args.max_header_bytes,
                              max_connections=args.max_connections)
    return exconfig, config, limits


def _tokenizer(args: argparse.Namespace, vocab: int) -> Any:
    """``--tokenizer DIR`` (its ids must fit the model's ``vocab``), else the byte-level
    tokenizer of the model's vocabulary."""
    if getattr(args, "tokenizer", None) is None:
        return ByteTokenizer(vocab)
    from calfsm.generate.tokenizer import HFTokenizer
    try:
        tok = HFTokenizer.from_dir(args.tokenizer)
    except CalfsmError as e:
        raise type(e)(f"--tokenizer {args.tokenizer}: {e.message}", stage="cli") from None
    if tok.vocab_size > vocab:
        raise InvalidArgument(f"--tokenizer {args.tokenizer}: {tok.vocab_size} ids, more "
                              f"than the model's vocabulary of {vocab}", stage="cli")
    return tok


def _chat_template(args: argparse.Namespace) -> Any:
    """``--chat-template FILE``, with the special tokens of ``--tokenizer DIR`` if given;
    None: the tokenizer's own template, else the built-in one."""
    path = getattr(args, "chat_template", None)
    if path is None:
        return None
    from calfsm.generate.chattemplate import ChatTemplate, special_tokens_of, tokenizer_config
    directory = getattr(args, "tokenizer", None)
    try:
        special = special_tokens_of(tokenizer_config(directory)) if directory else {}
        return ChatTemplate.from_file(path, special_tokens=special)
    except CalfsmError as e:
        raise type(e)(f"--chat-template {path}: {e.message}", stage="cli") from None


def _prompt_cache(args: argparse.Namespace) -> PromptCacheConfig | None:
    """``--prompt-cache``, by default half of ``--max-sequences``; None when off."""
    if args.no_prompt_cache:
        return None
    seqs, tokens = args.prompt_cache or (max(1, args.max_sequences // 2), None)
    if seqs > args.max_sequences:
        raise InvalidArgument(f"--prompt-cache {seqs} sequences is over --max-sequences "
                              f"{args.max_sequences}", stage="cli")
    return PromptCacheConfig(seqs, tokens or seqs * CACHE_TOKENS_PER_SEQUENCE)


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (uvicorn listens on it); OSError says why not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") \
            from None
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def warn_if_open(sock: socket.socket, keys: tuple[str, ...]) -> str | None:
    """The warning for a socket others can reach and no key: one log line at WARNING
    (on stderr with ``calfsm serve``'s logging), or one line on stderr if the log level
    hides warnings. Returns the warning (None: nothing to warn about)."""
    if keys or ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
        return None
    message = (f"serving {_url(sock)} with no API key: anyone who can reach this address "
               "can use the server; give --api-key KEY (or CALFSM_API_KEY)")
    if log.isEnabledFor(logging.WARNING):
        log.warning("%s", message)
    else:
        print(f"calfsm: warning: {message}", file=sys.stderr)
    return message


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; the exit status."""
    try:
        from calfsm.serve.app import create_app
        from calfsm.serve.connections import uvicorn_config
        from calfsm.serve.graceful import GracefulServer
    except ImportError as e:
        print(f"calfsm: error: calfsm serve needs the server extra "
              f"(pip install -e \".[server]\"): {e}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        exconfig, config, limits = configs(args)
        manifest = _timed(args, manifest_from_option(args.manifest))
        tokenizer = _tokenizer(args, manifest.submodel(TaskKind.DECODE).vocab)
        driver = _driver(args, manifest)
        provider = _tracer_provider(args.otlp_traces_endpoint)
        sock = _listen(args.host, args.port)
    except ImportError as e:
        print(f"calfsm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CalfsmError as e:
        print(f"calfsm: error: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"calfsm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    failed: list[str] = []

    async def start() -> DeviceExecutor:
        try:
            return await DeviceExecutor.create(
                driver, manifest, exconfig, tokenizer=tokenizer,
                tracer=None if provider is None else provider.get_tracer("calfsm"))
        except CalfsmError as e:
            failed.append(str(e))
            server.should_exit = True
            raise

    class Server(GracefulServer):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"calfsm: listening on {_url(sock)}", file=sys.stderr, flush=True)

    with contextlib.closing(sock):
        warn_if_open(sock, config.api_keys)
        server = Server(uvicorn_config(
            create_app(start, config), limits, host=args.host, port=args.port,
            log_level=args.log_level, timeout_graceful_shutdown=_AFTER_GRACE_S))
        try:
            with _stop_signals_handled():
                server.run(sockets=[sock])
        finally:
            if provider is not None:
                provider.shutdown()     # the spans still queued, within their timeout
    if failed:
        print(f"calfsm: start-up failed: {failed[0]}", file=sys.stderr)
        return EXIT_DEVICE_FAILED
    return EXIT_OK
