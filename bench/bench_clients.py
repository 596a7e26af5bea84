"""The load clients users trust, as-is, against ``calfsm serve``: aiperf and guidellm (and
vLLM's ``vllm bench serve`` on request) each in its own virtual environment, their
figures checked against the server's ``/metrics``.

Run from the repository root::

    python bench/bench_clients.py                  # installs once (~15 min), then ~10 min
    python bench/bench_clients.py --clients aiperf --requests 40
    python bench/bench_clients.py --clients aiperf,guidellm,vllm   # vllm: ~5 GB more
    python bench/bench_clients.py --install-only   # just the virtual environments
    python bench/bench_clients.py --smoke          # seconds: the built-in client only

Each client is installed at its pinned version (:data:`CLIENTS`) with pip into
``--cache`` (default ``.cache/clients/NAME``, not committed; pip reaches the package
index) and run as its users run it, as a subprocess of its own interpreter, against one
``calfsm serve`` on 127.0.0.1 (qwen3-b1 on the simulated device in real time,
``--decode-ms`` a decode) with the local Qwen-like tokenizer of
``python -m calfsm.tools.make_tokenizer`` (no model hub is reachable: each client is
given its directory as its tokenizer). Four scenarios a client: ``/v1/completions`` and
``/v1/chat/completions``, streaming and not, ``--requests`` requests one at a time, a
fixed output length (``ignore_eos`` and ``min_tokens`` = ``max_tokens``). ``vllm bench
serve`` always streams, so it runs the two streaming scenarios.

Around each scenario the script scrapes ``/metrics`` and takes the difference, so the
server's figures are those of exactly the scenario's requests, and checks:

- every request succeeded: the client counts ``--requests`` successes and no error, and
  the server ended that many streams ``length`` with ``requests x --output-tokens``
  tokens;
- the client's mean TTFT, mean ITL (time per output token after the first) and mean
  request latency within 5% of the server's (``calfsm_time_to_first_token_seconds``,
  ``calfsm_time_per_output_token_seconds`` and ``calfsm_e2e_request_latency_seconds``:
  sum over count; TTFT and latency also pass within 5% of the server's plus the HTTP
  round trip, below); TTFT and ITL on streaming scenarios only (a client sees no token
  before the whole answer otherwise);
- the client's output tokens per second within 5% of the server's: its tokens over the
  time they were in the server (the requests run one at a time, so the e2e sum is the
  time the server spent on the scenario).

The server's TTFT and request latency start at the request's arrival (its first
layer, once uvicorn has read the request's headers: docs/metrics.md, "Where each clock
starts"), a client's when it starts to send; the server's TTFT ends when the first token
is made, a client's when its chunk has been read. What lies between is not the
server's to measure: the client's write, the loopback, uvicorn's read before the
request reaches the app, and on the way back the chunk's write and the client's read
and parse. So before each scenario the script times that part alone: ``--rtt-requests``
requests the server answers at once (an empty JSON object to the scenario's endpoint:
stamped, read, parsed and refused with a 400, no device), the mean round trip in the
table's "HTTP rtt ms" column, and a TTFT or request latency passes when it is within 5%
of the server's, or of the server's plus that round trip. On a 2-core machine shared
with other work the round trip is 1-3 ms, the server's TTFT 10-20 ms: past 5% of it on
its own. (It is httpx's round trip; aiperf and vLLM send with aiohttp, guidellm with
httpx.)
Exit status 0 when every check passed, 1 when one missed
(the table says which), 2 when a client could not be installed or run.

``--smoke`` runs the same scenarios and checks with a small built-in httpx client
(vLLM's formulas) on ``tiny`` with the byte-level tokenizer, installs nothing, and
judges only that every request succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runs import add_smoke_option

from calfsm.tools.make_tokenizer import cached_tokenizer

ROOT = Path(__file__).resolve().parent.parent
#: the clients and the versions checked here (issue 38)
CLIENTS = {"aiperf": "aiperf==0.13.0", "guidellm": "guidellm==0.8.1", "vllm": "vllm==0.32.0"}
#: what runs without --clients (vllm is ~5 GB of install: opt in)
DEFAULT_CLIENTS = ("aiperf", "guidellm")
WITHIN = 0.05


@dataclass(frozen=True)
class Scenario:
    endpoint: str           # "completions" or "chat"
    stream: bool

    @property
    def name(self) -> str:
        return f"{self.endpoint} {'stream' if self.stream else 'no-stream'}"


SCENARIOS = tuple(Scenario(e, s) for e in ("completions", "chat") for s in (True, False))


@dataclass
class Figures:
    """One side's figures for a scenario (ms; None: that side does not measure it)."""

    ok: int
    errors: int
    ttft_ms: float | None
    itl_ms: float | None
    e2e_ms: float | None
    output_tokens: int | None
    tokens_per_s: float | None
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class Setup:
    url: str
    model: str
    tokenizer: str | None
    requests: int
    prompt_tokens: int
    output_tokens: int
    work: Path


# ---- the server's side: /metrics ---------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}`` (every sample line)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def server_figures(before: dict[str, float], after: dict[str, float]) -> Figures:
    """The scenario's requests as the server counted and timed them."""
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean_ms(hist: str) -> float | None:
        n = d(f"calfsm_{hist}_count")
        return d(f"calfsm_{hist}_sum") / n * 1e3 if n else None

    ended = {k: d(k) for k in after if k.startswith("calfsm_requests_finished_total{")}
    ok = int(sum(v for k, v in ended.items() if 'finish_reason="length"' in k
                 or 'finish_reason="stop"' in k))
    errors = int(sum(ended.values())) - ok
    tokens = int(d("calfsm_generation_tokens_total"))
    e2e_sum = d("calfsm_e2e_request_latency_seconds_sum")
    return Figures(ok=ok, errors=errors, ttft_ms=mean_ms("time_to_first_token_seconds"),
                   itl_ms=mean_ms("time_per_output_token_seconds"),
                   e2e_ms=mean_ms("e2e_request_latency_seconds"), output_tokens=tokens,
                   tokens_per_s=tokens / e2e_sum if e2e_sum > 0 else None)


# ---- the checks ---------------------------------------------------------------------------
@dataclass
class Check:
    what: str
    client: float | None
    server: float | None
    passed: bool
    note: str = ""


def compare(s: Scenario, setup: Setup, client: Figures, server: Figures,
            rtt_ms: float = 0.0) -> list[Check]:
    """The checks of one scenario (docstring of this module); ``rtt_ms`` the HTTP round
    trip a client adds to the server's TTFT and latency (:func:`round_trip_ms`)."""
    want_tokens = setup.requests * setup.output_tokens
    checks = [Check("requests ok", client.ok, server.ok,
                    client.ok == server.ok == setup.requests and client.errors == 0
                    and server.errors == 0,
                    f"of {setup.requests}; errors {client.errors} / {server.errors}"),
              Check("output tokens", client.output_tokens, server.output_tokens,
                    server.output_tokens == want_tokens
                    and client.output_tokens in (None, want_tokens),
                    f"want {want_tokens}")]
    # (what, client, server, judged, the round trip counts: the client's clock holds
    # the request's way in and its answer's way out, the server's neither)
    pairs = [("TTFT ms", client.ttft_ms, server.ttft_ms, s.stream, True),
             ("ITL ms", client.itl_ms, server.itl_ms, s.stream, False),
             ("latency ms", client.e2e_ms, server.e2e_ms, True, True),
             ("tokens/s", client.tokens_per_s, server.tokens_per_s, True, False)]
    for what, c, v, judged, transport in pairs:
        if not judged:
            continue
        if c is None or v is None:
            checks.append(Check(what, c, v, False, "not reported"))
            continue
        off = c / v - 1
        if not transport or rtt_ms <= 0 or abs(off) <= WITHIN:
            checks.append(Check(what, c, v, abs(off) <= WITHIN, f"{off:+.1%}"))
            continue
        rest = c / (v + rtt_ms) - 1
        checks.append(Check(what, c, v, abs(rest) <= WITHIN,
                            f"{off:+.1%}; with the rtt {rest:+.1%}"))
    return checks


def round_trip_ms(url: str, s: Scenario, n: int) -> float:
    """The mean round trip of ``n`` requests the server answers without the device: an
    empty JSON object to the scenario's endpoint (the front stamps its arrival, the app
    reads and parses it and answers 400). One keep-alive connection, as the clients
    keep theirs; one request first, unmeasured, opens it."""
    path = "/v1/completions" if s.endpoint == "completions" else "/v1/chat/completions"
    times: list[float] = []
    with httpx.Client(base_url=url, timeout=60,
                      headers={"content-type": "application/json"}) as c:
        for i in range(n + 1):
            t0 = time.perf_counter()
            r = c.post(path, content=b"{}")
            if i:
                times.append(time.perf_counter() - t0)
            if r.status_code != 400:
                raise RuntimeError(f"an empty request to {path} answered {r.status_code}")
    return sum(times) / len(times) * 1e3 if times else 0.0


# ---- installing and running the clients ---------------------------------------------------
def install(name: str, cache: Path) -> Path:
    """``cache/name``: a virtual environment holding the client at its pinned version
    (made once; ``pip install`` again only when the version is not there)."""
    venv = cache / name
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pin = CLIENTS[name]
    have = subprocess.run([str(py), "-m", "pip", "show", name], capture_output=True,
                          text=True)
    if f"Version: {pin.split('==')[1]}" not in have.stdout:
        print(f"installing {pin} into {venv} ...", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", pin], check=True)
        if name == "vllm":
            # pip resolves torch to a CPU build here, and torchvision, torchaudio and
            # torchcodec to builds for another torch: importing them fails (transformers
            # imports torchvision when it is there). The benchmark client needs none.
            subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision",
                            "torchaudio", "torchcodec"], check=True)
    return venv


def _bin(venv: Path, exe: str) -> str:
    return str(venv / "bin" / exe)


def run_aiperf(venv: Path, s: Scenario, setup: Setup) -> Figures:
    """``aiperf profile`` one request at a time; its profile_export_aiperf.json."""
    out = setup.work / f"aiperf-{s.endpoint}-{'s' if s.stream else 'n'}"
    shutil.rmtree(out, ignore_errors=True)
    n = setup.output_tokens
    argv = [_bin(venv, "aiperf"), "profile", "--model", setup.model, "--url", setup.url,
            "--endpoint-type", s.endpoint, "--tokenizer", str(setup.tokenizer),
            "--synthetic-input-tokens-mean", str(setup.prompt_tokens),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(n),
            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--extra-inputs", f"min_tokens:{n}", "--request-count", str(setup.requests),
            "--concurrency", "1", "--artifact-dir", str(out), "--ui-type", "none",
            # count the tokens the server says it sent (usage), not a re-tokenization
            # of their text: random ids do not round-trip through a BPE
            "--use-server-token-count"]
    if s.stream:
        argv.append("--streaming")
    _run(argv, out / "aiperf.log")
    data = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())

    def avg(key: str) -> float | None:
        v = data.get(key)
        return None if not isinstance(v, dict) else v.get("avg")
    count = avg("completed_request_count") or avg("request_count")
    errors = data.get("error_summary") or []
    n_err = int(sum(e.get("count", 0) for e in errors)) if isinstance(errors, list) else 0
    tokens = avg("total_usage_completion_tokens") or avg("total_output_tokens")
    return Figures(ok=int(count or 0), errors=n_err, ttft_ms=avg("time_to_first_token"),
                   itl_ms=avg("inter_token_latency"), e2e_ms=avg("request_latency"),
                   output_tokens=None if tokens is None else round(tokens),
                   tokens_per_s=avg("output_token_throughput"))


def run_guidellm(venv: Path, s: Scenario, setup: Setup) -> Figures:
    """``guidellm run`` synchronous (one request at a time); its JSON report."""
    out = setup.work / f"guidellm-{s.endpoint}-{'s' if s.stream else 'n'}.json"
    out.unlink(missing_ok=True)
    n = setup.output_tokens
    backend = {"kind": "openai_http", "target": setup.url, "model": setup.model,
               "request_format": "/v1/completions" if s.endpoint == "completions"
               else "/v1/chat/completions", "stream": s.stream,
               "extras": {"body": {"ignore_eos": True, "min_tokens": n}}}
    argv = [_bin(venv, "guidellm"), "run", "--backend", json.dumps(backend),
            "--profile", json.dumps({"kind": "synchronous"}),
            "--constraint", json.dumps({"kind": "max_requests", "count": setup.requests}),
            "--tokenizer", json.dumps({"kind": "hf_auto", "model": setup.tokenizer}),
            "--data", json.dumps({"kind": "synthetic_text",
                                  "prompt_tokens": setup.prompt_tokens, "output_tokens": n}),
            "--output", json.dumps({"kind": "json", "path": str(out)}),
            "--disable-console-interactive"]
    _run(argv, out.with_suffix(".log"))
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]

    def ok(key: str) -> dict:
        return metrics.get(key, {}).get("successful") or {}
    latency = ok("request_latency").get("mean")
    tokens = ok("output_token_count").get("total_sum")
    return Figures(ok=int(totals.get("successful", 0)),
                   errors=int(totals.get("errored", 0)) + int(totals.get("incomplete", 0)),
                   ttft_ms=ok("time_to_first_token_ms").get("mean") if s.stream else None,
                   # guidellm's TPOT divides the whole latency by the tokens; its ITL is
                   # (latency - TTFT) / (tokens - 1), what the server's histogram means
                   itl_ms=ok("inter_token_latency_ms").get("mean") if s.stream else None,
                   e2e_ms=None if latency is None else latency * 1e3,
                   output_tokens=None if tokens is None else round(tokens),
                   tokens_per_s=ok("output_tokens_per_second").get("mean"))


def run_vllm(venv: Path, s: Scenario, setup: Setup) -> Figures:
    """``vllm bench serve`` one request at a time (``--max-concurrency 1``) on its random
    dataset; its saved result. It always streams: a non-streaming scenario is not its."""
    if not s.stream:
        raise NotImplementedError("vllm bench serve always streams")
    out = setup.work / f"vllm-{s.endpoint}"
    out.mkdir(parents=True, exist_ok=True)
    n = setup.output_tokens
    backend, endpoint = (("openai", "/v1/completions") if s.endpoint == "completions"
                         else ("openai-chat", "/v1/chat/completions"))
    argv = [_bin(venv, "vllm"), "bench", "serve", "--backend", backend,
            "--base-url", setup.url, "--endpoint", endpoint, "--model", setup.model,
            "--tokenizer", str(setup.tokenizer), "--dataset-name", "random",
            "--random-input-len", str(setup.prompt_tokens), "--random-output-len", str(n),
            "--random-range-ratio", "0", "--num-prompts", str(setup.requests),
            "--max-concurrency", "1", "--ignore-eos", "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
            "--result-dir", str(out), "--result-filename", "result.json"]
    _run(argv, out / "vllm.log")
    data = json.loads((out / "result.json").read_text())
    done = int(data.get("completed", 0))
    failed = int(data.get("failed", 0) or 0) + sum(1 for e in data.get("errors") or [] if e)
    tokens = data.get("total_output_tokens")
    duration = data.get("duration")
    return Figures(ok=done, errors=failed, ttft_ms=data.get("mean_ttft_ms"),
                   # its TPOT is (latency - TTFT) / (tokens - 1) per request; its ITL the
                   # mean gap between chunks
                   itl_ms=data.get("mean_tpot_ms"), e2e_ms=data.get("mean_e2el_ms"),
                   output_tokens=tokens,
                   tokens_per_s=tokens / duration if tokens and duration else None)


def _run(argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})}, timeout=1800,
                              stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{Path(argv[0]).name} exited {done.returncode} "
                           f"(log {log}):\n{tail}")


def run_builtin(s: Scenario, setup: Setup) -> Figures:
    """A small client with vLLM's formulas (TTFT to the first content chunk; ITL as
    (latency - TTFT) / (tokens - 1)): what ``--smoke`` runs, and a check of the checks."""
    n = setup.output_tokens
    ok = errors = tokens = 0
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    path = "/v1/completions" if s.endpoint == "completions" else "/v1/chat/completions"
    t_start = time.perf_counter()
    with httpx.Client(base_url=setup.url, timeout=120) as c:
        for i in range(setup.requests):
            text = " ".join(f"w{(i * 31 + k) % 97}" for k in range(setup.prompt_tokens))
            body: dict = {"model": setup.model, "max_tokens": n, "min_tokens": n,
                          "ignore_eos": True, "stream": s.stream}
            if s.endpoint == "completions":
                body["prompt"] = text
            else:
                body["messages"] = [{"role": "user", "content": text}]
            if s.stream:
                body["stream_options"] = {"include_usage": True}
            t0 = time.perf_counter()
            first = None
            got = 0
            try:
                if s.stream:
                    with c.stream("POST", path, json=body) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if chunk.get("choices") and first is None:
                                first = time.perf_counter()
                            if chunk.get("usage"):
                                got = chunk["usage"]["completion_tokens"]
                else:
                    r = c.post(path, json=body)
                    r.raise_for_status()
                    got = r.json()["usage"]["completion_tokens"]
            except (httpx.HTTPError, KeyError, ValueError):
                errors += 1
                continue
            t1 = time.perf_counter()
            ok += 1
            tokens += got
            e2e.append(t1 - t0)
            if first is not None:
                ttft.append(first - t0)
                if got > 1:
                    itl.append((t1 - first) / (got - 1))
    wall = time.perf_counter() - t_start

    def mean_ms(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) * 1e3 if xs else None
    return Figures(ok=ok, errors=errors, ttft_ms=mean_ms(ttft), itl_ms=mean_ms(itl),
                   e2e_ms=mean_ms(e2e), output_tokens=tokens,
                   tokens_per_s=tokens / wall if wall > 0 else None)


RUNNERS: dict[str, Callable[[Path, Scenario, Setup], Figures]] = {
    "aiperf": run_aiperf, "guidellm": run_guidellm, "vllm": run_vllm}


# ---- the server ----------------------------------------------------------------------------
def start_server(manifest: str, tokenizer: str | None, decode_ms: float
                 ) -> tuple[subprocess.Popen, str]:
    """``calfsm serve --port 0`` on 127.0.0.1; its URL from the line it prints."""
    argv = [sys.executable, "-m", "calfsm.tools.cli", "serve", "--manifest", manifest,
            "--port", "0", "--decode-ms", str(decode_ms), "--request-timeout", "600"]
    if tokenizer is not None:
        argv += ["--tokenizer", tokenizer]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"calfsm serve exited {proc.returncode}")
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            url = m.group(1)
            while not _ready(url):
                if time.monotonic() > deadline:
                    proc.kill()
                    raise SystemExit("calfsm serve never became ready")
                time.sleep(0.1)
            # keep reading its stderr so it never blocks on a full pipe
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, url
    proc.kill()
    raise SystemExit("calfsm serve never said where it listens")


def _ready(url: str) -> bool:
    """``/ready`` answered 200; a probe that timed out is a no (a loaded machine: the
    server's start-up holds the GIL for seconds, its loop answers late)."""
    try:
        return httpx.get(url + "/ready", timeout=10).status_code == 200
    except httpx.TimeoutException:
        return False


# ---- the command ---------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default=",".join(DEFAULT_CLIENTS),
                    help=f"comma-separated, of {', '.join(CLIENTS)} (default "
                         f"{','.join(DEFAULT_CLIENTS)})")
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "clients"),
                    help="where the clients' virtual environments go")
    ap.add_argument("--requests", type=int, default=20, help="requests per scenario")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--decode-ms", type=float, default=10.0)
    ap.add_argument("--manifest", default="qwen3-b1")
    ap.add_argument("--rtt-requests", type=int, default=20,
                    help="empty requests timed before each scenario: the HTTP round trip "
                         "a client adds to the server's TTFT and latency (0: none)")
    ap.add_argument("--install-only", action="store_true")
    add_smoke_option(ap, "the built-in client on tiny, 3 requests a scenario")
    args = ap.parse_args()
    names = [] if args.smoke else [c.strip() for c in args.clients.split(",") if c.strip()]
    for name in names:
        if name not in CLIENTS:
            ap.error(f"--clients: no client {name!r} (have {', '.join(CLIENTS)})")
    venvs: dict[str, Path] = {}
    for name in names:
        try:
            venvs[name] = install(name, Path(args.cache))
        except subprocess.CalledProcessError as e:
            print(f"{name}: install failed: {e}", file=sys.stderr)
            return 2
    if args.install_only:
        for name, venv in venvs.items():
            print(f"{name}: {venv}")
        return 0
    manifest = "tiny" if args.smoke else args.manifest
    # the Qwen-like tokenizer's directory (built once per machine, then cached)
    tokenizer = None if args.smoke else str(cached_tokenizer())
    requests = 3 if args.smoke else args.requests
    proc, url = start_server(manifest, tokenizer, args.decode_ms)
    try:
        model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
        with tempfile.TemporaryDirectory(prefix="bench-clients-") as work:
            setup = Setup(url, model, tokenizer, requests, args.prompt_tokens,
                          args.output_tokens, Path(work))
            print(f"# load clients against calfsm serve ({manifest}, {args.decode_ms:g} ms "
                  f"a decode, tokenizer {tokenizer or 'byte-level'}); {requests} requests "
                  f"a scenario one at a time, {args.prompt_tokens} prompt tokens, "
                  f"{args.output_tokens} output tokens (ignore_eos, min_tokens)\n")
            print("Each cell: the client's figure / the server's (/metrics), their "
                  "difference (and for TTFT and latency past 5%, the client's against the "
                  "server's plus the HTTP rtt: the mean round trip of an empty request, "
                  "timed before the scenario); MISS past 5%.\n")
            print("| client | scenario | HTTP rtt ms | requests ok | output tokens | "
                  "TTFT ms | ITL ms | latency ms | tokens/s |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            # the server's first requests of each kind pay one-off costs (code paths,
            # the tokenizer's caches): warm them before anything is measured
            run_builtin(SCENARIOS[0], Setup(url, model, tokenizer, 2, args.prompt_tokens,
                                            4, Path(work)))
            run_builtin(SCENARIOS[2], Setup(url, model, tokenizer, 2, args.prompt_tokens,
                                            4, Path(work)))
            misses = 0
            for name in ["built-in", *names]:
                for s in SCENARIOS:
                    if name == "vllm" and not s.stream:
                        print(f"| {name} | {s.name} | | not offered: vllm bench serve "
                              "always streams | | | | | |")
                        continue
                    rtt = round_trip_ms(url, s, args.rtt_requests)
                    before = scrape(url)
                    try:
                        fig = run_builtin(s, setup) if name == "built-in" \
                            else RUNNERS[name](venvs[name], s, setup)
                    except NotImplementedError as e:
                        print(f"| {name} | {s.name} | | not offered: {e} | | | | | |")
                        continue
                    except (RuntimeError, subprocess.TimeoutExpired, OSError,
                            StopIteration, KeyError, ValueError) as e:
                        print(f"| {name} | {s.name} | {rtt:.1f} | **failed**: "
                              f"{str(e).splitlines()[0][:120]} | | | | | |")
                        print(str(e), file=sys.stderr)
                        misses += 1
                        continue
                    server = server_figures(before, scrape(url))
                    cells = dict.fromkeys(("requests ok", "output tokens", "TTFT ms",
                                           "ITL ms", "latency ms", "tokens/s"), "-")
                    for ch in compare(s, setup, fig, server, rtt):
                        judged = not args.smoke or ch.what == "requests ok"
                        misses += not (ch.passed or not judged)
                        cells[ch.what] = _cell(ch, judged)
                    print(f"| {name} | {s.name} | {rtt:.1f} | "
                          + " | ".join(cells.values()) + " |", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"\n{'PASS' if not misses else f'{misses} MISS'}: every request succeeded and "
          f"the figures agree with /metrics within {WITHIN:.0%} (TTFT and latency: "
          f"or with /metrics plus the HTTP round trip)"
          + (" [smoke: only the requests judged]" if args.smoke else ""))
    return 0 if not misses else 1


def _cell(ch: Check, judged: bool) -> str:
    """``client / server note``, the verdict when it missed (judged)."""
    if ch.what in ("requests ok", "output tokens"):
        text = f"{_fmt(ch.client)} / {_fmt(ch.server)}"
    else:
        text = f"{_fmt(ch.client)} / {_fmt(ch.server)} ({ch.note})"
    return text + (" **MISS**" if judged and not ch.passed else "")


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


if __name__ == "__main__":
    sys.exit(main())
