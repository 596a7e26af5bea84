"""Streaming clients and a prober for ``calfsm serve`` on 127.0.0.1, shared by
``tests/serve/test_serve_probes.py`` and ``bench/bench_probes.py``.

The clients run in a process of their own (``python -m tests.helpers.serve_load PORT ...``), so
their work never delays the prober's measurements; they are written on raw asyncio
sockets because an HTTP client library would spend more CPU than the server does on a
2-core machine. Each of N clients loops, for ``--seconds``, over ``POST
/v1/completions`` with ``"stream": true`` on a fresh connection each time, reading each
answer to its end; after a 429 or 503 it pauses for the answer's ``retry-after-ms``
(what the official OpenAI client honours), or for a fixed ``--retry-ms`` (0: clients
that hammer the server). Then the requests still open are dropped. It prints the
answers it got by status (``unfinished``: dropped at the end), as JSON.

:class:`Prober` asks ``GET /health`` and ``GET /ready`` in turn on a fresh connection
each (as the kubelet does) and times each answer from connect to its last byte.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

__all__ = ["Prober", "answers", "free_port", "pct", "probe_once", "start_load", "start_serve"]

ROOT = Path(__file__).resolve().parents[2]


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank; nan when empty)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the load's clients all connect from 127.0.0.1, which without API keys makes them one
#: client to the server's per-client limits (calfsm/serve/fairuse.py); they stand for
#: many, so those limits are lifted unless the options set them
_MANY_CLIENTS = ("--max-client-streams", "1000000", "--max-client-waiting", "1000000")


def start_serve(*options: str, timeout: float = 60.0) -> tuple[subprocess.Popen, int]:
    """``calfsm serve OPTIONS`` on a free port of 127.0.0.1, once ``/ready`` says 200:
    (the process, its port). Its stderr is a pipe (read it after it ended)."""
    port = free_port()
    many = () if any(o.startswith("--max-client") for o in options) else _MANY_CLIENTS
    proc = subprocess.Popen([sys.executable, "-m", "calfsm.tools.cli", "serve", "--port",
                             str(port), *many, *options], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe_once(port, "/ready", 2.0)[1] == 200:
            return proc, port
        if proc.poll() is not None:
            raise AssertionError(f"calfsm serve exited {proc.returncode}: "
                                 f"{proc.communicate()[1]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"calfsm serve not ready within {timeout} s: "
                         f"{proc.communicate()[1]}")


# ---- the clients ----------------------------------------------------------------------

def _request(model: str, vocab: int, i: int, k: int, tokens: tuple[int, int]) -> bytes:
    """Client ``i``'s ``k``-th request: 8 prompt tokens, max_tokens drawn from
    ``tokens`` (low, high) by a hash of (i, k), so every run asks the same."""
    low, high = tokens
    n = low + (i * 2654435761 + k * 40503) % (high - low + 1)
    prompt = [(i * 7919 + j * 104729 + k) % vocab for j in range(8)]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n,
                       "temperature": 0, "stream": True}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


async def _client(args: argparse.Namespace, i: int, until: float, statuses: Counter
                  ) -> None:
    k = 0
    while time.monotonic() < until:
        k += 1
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
        except OSError:
            statuses["connect-error"] += 1
            await asyncio.sleep(0.05)
            continue
        try:
            writer.write(_request(args.model, args.vocab, i, k, args.tokens))
            status_line = await reader.readline()
            status = int(status_line.split()[1]) if status_line else 0
            pause = 0.0
            while line := await reader.readline():
                if line in (b"\r\n", b"\n"):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "retry-after-ms":
                    pause = float(value) / 1e3
            while await reader.read(65536):       # the body, to its end (connection: close)
                pass
            statuses[status] += 1
            if status in (429, 503):
                await asyncio.sleep(pause if args.retry_ms is None else args.retry_ms / 1e3)
        except (OSError, ValueError, IndexError):
            statuses["read-error"] += 1
        finally:
            writer.close()


async def _load(args: argparse.Namespace) -> Counter:
    """The clients for ``args.seconds``, or until SIGINT (a test that has measured what
    it needed ends the flood then, however long a busy machine took to get there); then
    the requests still open are dropped (the server cancels their streams) and counted
    as ``unfinished``."""
    statuses: Counter = Counter()
    until = time.monotonic() + args.seconds
    tasks = [asyncio.ensure_future(_client(args, i, until, statuses))
             for i in range(args.clients)]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    stopper = asyncio.ensure_future(stop.wait())
    clients = asyncio.ensure_future(asyncio.wait(tasks))
    await asyncio.wait([clients, stopper], timeout=args.seconds,
                       return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    clients.cancel()
    pending = {t for t in tasks if not t.done()}
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if pending:
        statuses["unfinished"] += len(pending)
    return statuses


def _tokens(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="streaming clients for calfsm serve")
    ap.add_argument("port", type=int)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--tokens", type=_tokens, default=(100, 100), help="N or LOW:HIGH")
    ap.add_argument("--seconds", type=float, default=10.0, help="then no new request")
    ap.add_argument("--retry-ms", type=float, default=None,
                    help="pause after a 429/503 (default: its retry-after-ms)")
    ap.add_argument("--model", default="qwen3-b1")
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args(argv)
    statuses = asyncio.run(_load(args))
    print(json.dumps({str(k): v for k, v in sorted(statuses.items(), key=str)}))
    return 0


def start_load(port: int, clients: int, seconds: float, *, tokens: str = "100",
               retry_ms: float | None = None, model: str = "qwen3-b1",
               vocab: int = 151936) -> subprocess.Popen:
    """The clients, in a subprocess; ``communicate()`` gives their answers by status."""
    cmd = [sys.executable, "-m", "tests.helpers.serve_load", str(port), "--clients", str(clients),
           "--seconds", str(seconds), "--tokens", tokens, "--model", model, "--vocab",
           str(vocab)]
    if retry_ms is not None:
        cmd += ["--retry-ms", str(retry_ms)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def answers(load: subprocess.Popen, timeout: float) -> Counter:
    """The clients' answers by status, once they ended (within ``timeout`` s)."""
    out, _ = load.communicate(timeout=timeout)
    return Counter(json.loads(out.strip().splitlines()[-1]))


# ---- the prober -----------------------------------------------------------------------

def probe_once(port: int, path: str, timeout: float) -> tuple[float, int]:
    """(seconds from connect to the last byte, status; 0 for none) of one probe."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close"
                      "\r\n\r\n".encode())
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
    except OSError:
        return time.perf_counter() - t0, 0
    data = b"".join(chunks)
    status = int(data.split(None, 2)[1]) if data.startswith(b"HTTP/") else 0
    return time.perf_counter() - t0, status


class Prober(threading.Thread):
    """``/health`` and ``/ready`` in turn every ``every`` seconds until ``stop`` is set;
    while ``recording`` is set each answer's time and status are kept."""

    def __init__(self, port: int, every: float = 0.05, timeout: float = 30.0) -> None:
        super().__init__(name="prober", daemon=True)
        self.port, self.every, self.timeout = port, every, timeout
        self.times: dict[str, list[float]] = {"/health": [], "/ready": []}
        self.statuses: Counter = Counter()
        self.recording = threading.Event()
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        paths = ("/health", "/ready")
        k = 0
        while not self.stop.is_set():
            path = paths[k % 2]
            k += 1
            took, status = probe_once(self.port, path, self.timeout)
            if self.recording.is_set():
                with self._lock:
                    self.times[path].append(took)
                    self.statuses[(path, status)] += 1
            self.stop.wait(max(0.0, self.every - took))

    def count(self) -> int:
        with self._lock:
            return sum(len(t) for t in self.times.values())

    def take(self) -> tuple[dict[str, list[float]], Counter]:
        """What was recorded since the last take."""
        with self._lock:
            times, statuses = self.times, self.statuses
            self.times, self.statuses = {"/health": [], "/ready": []}, Counter()
        return times, statuses


if __name__ == "__main__":
    sys.exit(main())
