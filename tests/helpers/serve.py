"""Shared by the server tests (tests/serve/ and a few elsewhere): a real uvicorn on
127.0.0.1 (:class:`LiveServer`), ``calfsm serve`` in a subprocess (:class:`Serving`),
the reference a choice must equal, and the module-scoped ``executor``/``live``/``client``
fixtures several files serve the tiny model with (:func:`live_fixtures`)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.serve import ByteTokenizer, ServerConfig, create_app, realtime_sim
from calfsm.serve.connections import ConnectionLimits, uvicorn_config
from tests.helpers.executor import reference_stream
from tests.helpers.streams import direct_runner

TINY = builtin_manifest("tiny")
CONTRACT = TINY.submodel(TaskKind.DECODE)
VOCAB, MAX_SEQ = CONTRACT.vocab, CONTRACT.max_seq
TOK = ByteTokenizer(VOCAB)
MODEL = "tiny"

PROMPT_TEXT = "The simulated device has no vocabulary: é, ü and 漢字 are bytes."
PROMPT_IDS = [7, 300, 1023, 0, 42, 511]
#: a request body's greedy sampling fields
GREEDY = {"temperature": 0, "max_tokens": 12}

#: how long a ``calfsm serve`` process's start-up (interpreter, imports, the device's
#: warm-up) may take: the machine's time, not calfsm's (over 30 s to 'listening on'
#: seen at load 17)
START_S = 60.0


class LiveServer:
    """uvicorn serving ``app`` in a thread on a socket bound to 127.0.0.1:0, configured
    as ``calfsm serve`` configures it (``uvicorn_config``, with ``limits``;
    ``server_class``: ``uvicorn.Server`` or a subclass such as ``GracefulServer``)."""

    def __init__(self, app: Any, limits: ConnectionLimits | None = None,
                 server_class: type[uvicorn.Server] = uvicorn.Server) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = server_class(uvicorn_config(app, limits, log_level="warning",
                                                  timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        poll(lambda: self.server.started, 10, "uvicorn did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "uvicorn did not stop"
        self.sock.close()


def poll(predicate: Any, timeout: float, what: str, every: float = 0.01) -> Any:
    """Bounded polling: ``predicate()``'s first truthy value within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(every)


def serve(executor: DeviceExecutor, limits: ConnectionLimits | None = None,
          **config: Any) -> LiveServer:
    return LiveServer(create_app(executor, ServerConfig(**config)), limits)


def serve_executor(**config: Any) -> DeviceExecutor:
    """The tiny model on a real-time simulated device with the byte-level tokenizer, as
    ``calfsm serve`` builds it (stop strings are matched on the streams' text);
    ``config`` goes to :class:`ExecutorConfig`."""
    return DeviceExecutor(realtime_sim(TINY, decode_ms=0.2, prefill_token_us=1), TINY,
                          ExecutorConfig(**config), tokenizer=TOK)


def live_fixtures(**config: Any) -> tuple[Any, Any, Any]:
    """Module-scoped ``executor`` (:func:`serve_executor` of ``config``), ``live`` (a
    :class:`LiveServer` of it) and ``client`` (httpx on it) fixtures, for a test module
    to bind: ``executor, live, client = live_fixtures(max_sequences=64)``."""

    @pytest.fixture(scope="module")
    def executor() -> Iterator[DeviceExecutor]:
        ex = serve_executor(**config)
        yield ex
        ex.close()

    @pytest.fixture(scope="module")
    def live(executor: DeviceExecutor) -> Iterator[LiveServer]:
        srv = serve(executor)
        yield srv
        srv.stop()

    @pytest.fixture(scope="module")
    def client(live: LiveServer) -> Iterator[httpx.Client]:
        with httpx.Client(base_url=live.url, timeout=30) as c:
            yield c

    return executor, live, client


def reference(prompt: list[int], params: SamplingParams) -> list[int]:
    """What a choice must give: the direct path's logits sampled by a fresh sampler of
    ``params``, with the stream's finish rules (stop tokens, max_tokens, max_seq)."""
    return reference_stream(direct_runner(), prompt, params)


def params_of(body: dict[str, Any], index: int = 0) -> SamplingParams:
    """The sampling parameters of a request body (choice ``index``: its seed + index)."""
    seed = body.get("seed")
    return SamplingParams(temperature=body.get("temperature", 1.0),
                          top_p=body.get("top_p", 1.0), top_k=body.get("top_k", 0),
                          seed=None if seed is None else seed + index,
                          max_tokens=body.get("max_tokens", 16))


def sse_events(lines: Iterator[str]) -> list[dict[str, Any] | str]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``"[DONE]"`` as is)."""
    out: list[dict[str, Any] | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, of every family in ``text``."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Serving:
    """``calfsm serve ARGS`` in a subprocess on 127.0.0.1 --port 0: the URL its
    'listening on' line gives, and its stderr."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "calfsm.tools.cli", "serve", "--manifest", "tiny", "--port",
             "0", "--decode-ms", "1", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=None if env is None else os.environ | env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._listening(START_S)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def _listening(self, within: float) -> str:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.stderr.append(line)
            m = re.fullmatch(r"calfsm: listening on (http://127\.0\.0\.1:(\d+))\n", line)
            if m:
                assert int(m.group(2)) > 0
                return m.group(1)
        self.proc.kill()
        raise AssertionError(f"no 'listening on' line within {within} s: {self.stderr}")

    def stop(self) -> str:
        """SIGINT; the rest of stderr (asserts exit status 0)."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)
        while (line := self.lines.get(timeout=10)) is not None:
            self.stderr.append(line)
        assert self.proc.returncode == 0, self.stderr
        return "".join(self.stderr)

