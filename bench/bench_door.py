"""``calfsm serve``'s front door under attack, with its defaults: idle, slow-header and
slow-body connections, an 8 MiB header, deep JSON, an unbounded max_tokens, and one client
holding streams it never reads while others ask for tokens.

Run from the repository root (about a minute; everything on 127.0.0.1)::

    python bench/bench_door.py
    python bench/bench_door.py --idle 5000 --slow 300 --others 20
    python bench/bench_door.py --smoke   # seconds; its figures mean nothing

The server is ``calfsm serve --port 0`` in a subprocess, with one API key for the hog
and one per other client (so they are distinct clients from one address), and otherwise
its defaults: qwen3-b1 at 10 ms per decode, 64 sequences, a 10 s header timeout, a 30 s
body timeout, 1000 connections. Each line says what was sent and what the server did.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from contextlib import AsyncExitStack

import httpx
from runs import add_smoke_option

HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
MODEL = "qwen3-b1"
#: --smoke: the same attacks, small, against short timeouts on the tiny manifest
SMOKE_SERVE = ["--manifest", "tiny", "--max-sequences", "4", "--header-timeout", "0.5",
               "--body-timeout", "0.5"]


def start(keys: list[str], extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    args = [a for k in keys for a in ("--api-key", k)]
    proc = subprocess.Popen([sys.executable, "-m", "calfsm.tools.cli", "serve", "--port", "0",
                             *args, *extra], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"listening on (http://[\d.]+:(\d+))", line)
        if m:
            url = m.group(1)
            for _ in range(1200):
                try:
                    if httpx.get(url + "/ready").status_code == 200:
                        return proc, url, int(m.group(2))
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
    raise SystemExit("calfsm serve did not start")


def closes(socks: list[socket.socket], within: float) -> list[float]:
    """Seconds until the server closed each connection (from now), as they come."""
    t0, sel, out = time.monotonic(), selectors.DefaultSelector(), []
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    while sel.get_map() and time.monotonic() - t0 < within:
        for key, _ in sel.select(0.2):
            s = key.fileobj
            try:
                data = s.recv(65536)            # type: ignore[union-attr]
            except (ConnectionResetError, BlockingIOError):
                data = b""
            if not data or data.startswith(b"HTTP/1.1 408"):
                sel.unregister(s)
                s.close()                       # type: ignore[union-attr]
                out.append(time.monotonic() - t0)
    return out


def idle(port: int, n: int) -> str:
    t0 = time.monotonic()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    opened = time.monotonic() - t0
    done = closes(socks, 60)
    at_once = sum(1 for t in done if t < 1)
    return (f"{n} connections that send nothing (opened in {opened:.1f} s): {len(done)} "
            f"closed, {at_once} within 1 s, the last after {max(done):.1f} s")


def slow_headers(port: int, n: int) -> str:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    t0, alive, i = time.monotonic(), list(socks), 0
    while alive and time.monotonic() - t0 < 60:
        still = []
        for s in alive:
            try:
                s.sendall(HEAD[i:i + 1] or b"a")
                still.append(s)
            except OSError:
                s.close()
        alive, i = still, i + 1
        closes(alive, 1.0)                      # one byte a second; closes what was cut
        alive = [s for s in alive if s.fileno() != -1]
    return (f"{n} connections sending their headers a byte a second: {n - len(alive)} "
            f"closed within {time.monotonic() - t0:.1f} s")


def slow_bodies(port: int, n: int, key: str) -> str:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(HEAD + f"authorization: Bearer {key}\r\ncontent-length: 1000\r\n\r\n{{"
                  .encode())
        socks.append(s)
    done = closes(socks, 90)
    return (f"{n} requests whose Content-Length lies (1 of 1000 bytes sent): {len(done)} "
            f"closed, the last after {max(done):.1f} s")


def big_header(port: int) -> str:
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    try:
        s.sendall(HEAD + b"x-big: " + b"a" * (8 << 20) + b"\r\n\r\n")
        got = s.recv(40).split(b"\r\n")[0].decode()
    except OSError as e:
        got = f"connection reset while sending ({e.__class__.__name__})"
    s.close()
    return f"an 8 MiB header: {got} after {time.monotonic() - t0:.2f} s"


def bad_bodies(url: str, key: str, model: str) -> list[str]:
    auth = {"authorization": f"Bearer {key}"}
    r = httpx.post(url + "/v1/completions", content=b"[" * 980 + b"]" * 980, headers=auth)
    out = [f"a JSON body nested 980 levels (2 KB): {r.status_code} "
           f"{r.json()['error']['message']!r}"]
    r = httpx.post(url + "/v1/completions", headers=auth,
                   json={"model": model, "prompt": "x", "max_tokens": 10 ** 30})
    out.append(f"max_tokens 10^30: {r.status_code} {r.json()['error']['message']!r}")
    return out


async def hog(url: str, others: int, model: str, held_n: int) -> str:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c, \
            AsyncExitStack() as stack:
        held: dict[int, int] = {}
        for i in range(held_n):
            r = await stack.enter_async_context(c.stream(
                "POST", "/v1/completions", headers={"authorization": "Bearer hog"},
                json={"model": model, "prompt": [i + 1], "max_tokens": 4000,
                      "stream": True}))
            held[r.status_code] = held.get(r.status_code, 0) + 1

        async def other(i: int) -> int:
            r = await c.post("/v1/completions", headers={"authorization": f"Bearer c{i}"},
                             json={"model": model, "prompt": [7, i], "max_tokens": 20})
            return r.status_code

        t0 = time.monotonic()
        codes = await asyncio.gather(*(other(i) for i in range(others)))
        took = time.monotonic() - t0
    answered = dict(sorted((k, codes.count(k)) for k in set(codes)))
    return (f"one client opens {held_n} streams it never reads: {held}; then {others} other "
            f"clients ask for 20 tokens each: {answered} in {took:.1f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=int, default=5000, help="idle connections")
    ap.add_argument("--slow", type=int, default=300, help="slow-header and slow-body ones")
    ap.add_argument("--others", type=int, default=20, help="clients beside the hog")
    add_smoke_option(ap, "a few seconds: a handful of each on tiny with 0.5 s timeouts and 4 "
                         "sequences")
    args = ap.parse_args()
    model, held_n, extra = MODEL, 64, []
    if args.smoke:
        args.idle, args.slow, args.others = 10, 4, 2
        model, held_n, extra = "tiny", 4, SMOKE_SERVE
    keys = ["hog", *(f"c{i}" for i in range(args.others))]
    proc, url, port = start(keys, extra)
    try:
        print(idle(port, args.idle))
        print(slow_headers(port, args.slow))
        print(slow_bodies(port, args.slow, "c0"))
        print(big_header(port))
        for line in bad_bodies(url, "c0", model):
            print(line)
        print(asyncio.run(hog(url, args.others, model, held_n)))
        print(f"/health after all that: {httpx.get(url + '/health').status_code}")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    print(f"calfsm serve exited {proc.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
