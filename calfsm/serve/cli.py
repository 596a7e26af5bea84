"""``calfsm serve``: the reference server under uvicorn, on the real-time simulated device.

``calfsm.cli`` adds this subcommand with :func:`add_parser` and runs it with :func:`run`;
nothing here imports the server's dependencies until it runs, so ``calfsm --help`` works
without the ``server`` extra. The executor is built inside the app's lifespan: the port
answers at once, ``/health`` and ``/ready`` say 503 while the device warms up (what a
startup probe waits for), and a start-up that fails stops the server with exit status 3.

SIGTERM or Ctrl-C stops it gracefully (:class:`calfsm.serve.graceful.GracefulServer`):
no new work, running streams get ``--shutdown-grace`` seconds, the rest are cut with a
retryable 503 each, and the process exits 0 about half a second after that.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import attrs

from calfsm.drivers import driver_names, load_driver
from calfsm.errors import CalfsmError
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.manifest import (
    Manifest,
    StepTiming,
    builtin_manifest_names,
    manifest_from_option,
)

__all__ = ["add_parser", "run"]

EXIT_OK, EXIT_USAGE, EXIT_DEVICE_FAILED = 0, 2, 3
#: uvicorn's own wait for connections, after the app's graceful shutdown has ended or
#: cut every stream (only an answer a client does not read can still be open then)
_AFTER_GRACE_S = 0.5

_DESCRIPTION = """\
Serve the OpenAI-compatible API (completions, chat, SSE streaming), /health, /ready and
/metrics over one executor, by default on the simulated device in real time. Needs the
server extra: pip install -e ".[server]". See docs/serving.md."""


def add_parser(sub: Any, **kw: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to ``calfsm``'s subcommands."""
    p = sub.add_parser("serve", help="run the OpenAI-compatible reference server",
                       description=_DESCRIPTION, **kw)
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--driver", default="sim", choices=driver_names(),
                   help="sim: the simulated device in real time (--decode-ms, "
                        "--prefill-token-us); calrt: the C ABI through cffi")
    p.add_argument("--manifest", default="qwen3-b1", metavar="NAME|PATH",
                   help=f"a built-in name ({', '.join(builtin_manifest_names())}) or a "
                        "manifest file")
    p.add_argument("--model-name", default=None,
                   help="the name clients send as 'model' (default: the manifest's name)")
    p.add_argument("--decode-ms", type=float, default=10.0,
                   help="sim: wall milliseconds per decode step")
    p.add_argument("--prefill-token-us", type=float, default=50.0,
                   help="sim: wall microseconds per prefilled token")
    p.add_argument("--faults", default="none", metavar="none|swarm|PLAN.json",
                   help="sim: a fault plan (swarm: a random one drawn from --seed)")
    p.add_argument("--seed", type=int, default=0, help="seeds the driver and swarm plan")
    p.add_argument("--max-sequences", type=int, default=64,
                   help="choices (streams) at once; a request past them is answered 429")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="jobs that may wait for the device, else 429 (default: twice "
                        "--max-sequences: a stream has at most one step queued and one "
                        "prepared ahead, so a running stream's next step is never refused)")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="seconds a choice may take, then 504")
    p.add_argument("--hang-after", type=float, default=5.0,
                   help="liveness: seconds a job may stay on the device (and past its "
                        "execution timeout) before /health answers 503")
    p.add_argument("--default-max-tokens", type=int, default=16,
                   help="tokens per choice when a request gives no max_tokens")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    # ---- shutdown ----
    p.add_argument("--shutdown-grace", type=float, default=10.0, metavar="S",
                   help="on SIGTERM/Ctrl-C: seconds running streams may go on finishing "
                        "before they are cut (503); new requests get 503 at once")
    return p




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
                            faults=faults)
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


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; the exit status."""
    try:
        import uvicorn

        from calfsm.serve.app import ServerConfig, create_app
        from calfsm.serve.graceful import GracefulServer
    except ImportError as e:
        print(f"calfsm: error: calfsm serve needs the server extra "
              f"(pip install -e \".[server]\"): {e}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        manifest = _timed(args, manifest_from_option(args.manifest))
        driver = _driver(args, manifest)
        exconfig = ExecutorConfig(max_waiting=args.max_waiting or 2 * args.max_sequences,
                                  max_sequences=args.max_sequences,
                                  hang_after_s=args.hang_after)
        config = ServerConfig(model_name=args.model_name,
                              request_timeout_s=args.request_timeout,
                              default_max_tokens=args.default_max_tokens,
                              shutdown_grace_s=args.shutdown_grace)
    except (CalfsmError, OSError) as e:
        print(f"calfsm: error: {getattr(e, 'message', e)}", file=sys.stderr)
        return EXIT_USAGE
    failed: list[str] = []

    async def start() -> DeviceExecutor:
        try:
            return await DeviceExecutor.create(driver, manifest, exconfig)
        except CalfsmError as e:
            failed.append(str(e))
            server.should_exit = True
            raise

    server = GracefulServer(uvicorn.Config(
        create_app(start, config), host=args.host, port=args.port,
        log_level=args.log_level, timeout_graceful_shutdown=_AFTER_GRACE_S))
    with _stop_signals_handled():
        server.run()
    if failed:
        print(f"calfsm: start-up failed: {failed[0]}", file=sys.stderr)
        return EXIT_DEVICE_FAILED
    return EXIT_OK
