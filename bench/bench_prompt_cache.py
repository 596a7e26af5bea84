"""The prompt cache against none: multi-turn chats on SimDriver in real time.

Run from the repository root::

    python bench/bench_prompt_cache.py              # three runs, ~7 minutes
    python bench/bench_prompt_cache.py --quick      # one short run (a smoke test)
    python bench/bench_prompt_cache.py --smoke   # seconds; its figures mean nothing

The device: the manifests' own timing (``tiny-b8``, like ``tiny`` and ``qwen3-b1``:
10 ms a decode step, 200 us a prefilled token), ``LatencyModel.fixed(decode_s=10 ms,
prefill_per_token_s=200 us, batch_row_share=0.05)``: a 2,000-token prefill takes 400 ms,
a batch decode step of eight rows 13.5 ms. Continuous batching runs on the batch
runner's evidence (``examples/vendor/batch_semantics.py`` on the simulated device,
written into a temporary directory), as ``calfsm serve --manifest tiny-b8`` would.
Both executors have ``calfsm serve``'s defaults: 64 sequences, and on one side the
prompt cache of 32 sequences of 4,096 tokens (``PromptCacheConfig(32, 32 * 4096)``).

A chat (the shape of vLLM's multi-turn benchmark, ``benchmarks/multi_turn``, scaled
to ~2,000 tokens): a system prompt of 500 tokens every chat shares, then 10 turns of a
50-token user message and a 100-token greedy answer; turn ``k`` sends the whole
history, ``500 + 50 k + 100 (k - 1)`` tokens (550 to 1,950), and the history ends at
2,000. With the cache a turn prefills only its new message and the last answer token
(never decoded, so not in the KV): 51 tokens, 10.2 ms of device time (the physical
bound); without it the whole history, 110-390 ms.

Each run, side by side (the order of the two sides alternates from run to run):

(a) one chat alone: the time to first token of each turn, and the ratio with / without
    the cache for every later turn (target <= 0.1x each);
(b) 16 chats at once (one thread each, every turn sent when the answer before it is
    in): aggregate tokens/s, first request to last answer, and the ratio with / without
    (target >= 2x).

Both sides must give the same tokens (greedy: the same history, the same answers);
that is checked. Each figure is reported per run and as the median with the range.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runs import add_smoke_option, print_summary, repeat  # noqa: E402

from calfsm.clock import RealClock  # noqa: E402
from calfsm.drivers.sim import LatencyModel, SimDriver  # noqa: E402
from calfsm.executor import DeviceExecutor, ExecutorConfig  # noqa: E402
from calfsm.generate.promptcache import PromptCacheConfig  # noqa: E402
from calfsm.generate.sampling import SamplingParams  # noqa: E402
from calfsm.manifest import TaskKind, builtin_manifest  # noqa: E402

MANIFEST = builtin_manifest("tiny-b8")
VOCAB = MANIFEST.submodel(TaskKind.DECODE).vocab
DECODE_S, PREFILL_TOKEN_S, SHARE = 0.010, 200e-6, 0.05
# a dynamic-shape device (shape_cost="rows"): this bench is about the cache, and on a
# static tiny-b8 calbin every lone prefill would pay the graph's eight rows
LATENCY = LatencyModel.fixed(decode_s=DECODE_S, prefill_per_token_s=PREFILL_TOKEN_S,
                             batch_row_share=SHARE, shape_cost="rows")
CACHE = PromptCacheConfig(32, 32 * 4096)        # calfsm serve's default at 64 sequences
TIMEOUT_S = 900.0


class Shape:
    """One chat's sizes."""

    def __init__(self, system: int, user: int, answer: int, turns: int) -> None:
        self.system, self.user, self.answer, self.turns = system, user, answer, turns


def write_evidence(directory: str) -> None:
    """The real runner, on the simulated device, writing the file the executor reads."""
    cmd = [sys.executable, str(ROOT / "examples/vendor/batch_semantics.py"), "--driver",
           "sim", "--manifest", "tiny-b8", "--out", directory]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"batch runner failed:\n{done.stdout}\n{done.stderr}")


def executor(evidence: str, cached: bool) -> DeviceExecutor:
    drv = SimDriver(MANIFEST, clock=RealClock(), latency=LATENCY)
    return DeviceExecutor(drv, MANIFEST, ExecutorConfig(
        max_sequences=64, evidence_dir=evidence, prompt_cache=CACHE if cached else None))


def messages(shape: Shape, chat: int) -> tuple[list[int], list[list[int]]]:
    """The shared system prompt and the chat's own user messages (seeded)."""
    system = np.random.default_rng(0).integers(0, VOCAB, shape.system).tolist()
    rng = np.random.default_rng(1000 + chat)
    return system, [rng.integers(0, VOCAB, shape.user).tolist() for _ in range(shape.turns)]


def chat(ex: DeviceExecutor, shape: Shape, index: int, out: list) -> None:
    """One chat's turns, each sent with the whole history when the answer before it is
    in: appends (ttft_s, answer tokens, cached tokens) per turn to ``out``."""
    history, users = messages(shape, index)
    params = SamplingParams(max_tokens=shape.answer)
    for user in users:
        prompt = history + user
        r = ex.generate(prompt, params).result(TIMEOUT_S)
        assert r.error is None and len(r.tokens) == shape.answer, r
        out.append((r.ttft_s, r.tokens, r.usage.cached_tokens))
        history = prompt + list(r.tokens)


def one_chat(evidence: str, shape: Shape, cached: bool) -> list:
    with executor(evidence, cached) as ex:
        turns: list = []
        gc.collect()
        gc.disable()
        try:
            chat(ex, shape, 0, turns)
        finally:
            gc.enable()
        return turns


def many_chats(evidence: str, shape: Shape, n: int, cached: bool
               ) -> tuple[float, list[list], dict]:
    """``n`` chats at once: (tokens/s from the first request to the last answer, each
    chat's turns, the cache's statistics)."""
    with executor(evidence, cached) as ex:
        results: list[list] = [[] for _ in range(n)]
        threads = [threading.Thread(target=chat, args=(ex, shape, i, results[i]),
                                    daemon=True) for i in range(n)]
        gc.collect()
        gc.disable()
        try:
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT_S)
            wall = time.monotonic() - t0
        finally:
            gc.enable()
        assert all(len(r) == shape.turns for r in results), "a chat did not finish"
        stats = ex.prompt_cache_stats()
        tokens = sum(len(t[1]) for r in results for t in r)
        return tokens / wall, results, {} if stats is None else {
            "hits": stats.hits, "misses": stats.misses, "reused": stats.reused_tokens}


def one_run(args: argparse.Namespace, evidence: str, index: int, shape: Shape
            ) -> dict[str, float]:
    out: dict[str, float] = {}
    order = (False, True) if index % 2 == 0 else (True, False)
    single = {c: one_chat(evidence, shape, c) for c in order}
    for c in order:
        assert [t[1] for t in single[c]] == [t[1] for t in single[not c]], "tokens differ"
    ratios = [w[0] / wo[0] for w, wo in zip(single[True], single[False])][1:]
    out["(a) later turns TTFT ratio max"] = max(ratios)
    out["(a) later turns TTFT ratio median"] = statistics.median(ratios)
    out["(a) last turn TTFT ms, cache"] = single[True][-1][0] * 1e3
    out["(a) last turn TTFT ms, none"] = single[False][-1][0] * 1e3
    out["(a) turn 2 TTFT ratio"] = ratios[0]
    rates, chats, stats = {}, {}, {}
    for c in order:
        rates[c], chats[c], stats[c] = many_chats(evidence, shape, args.chats, c)
    assert [[t[1] for t in r] for r in chats[True]] == \
        [[t[1] for t in r] for r in chats[False]], "tokens differ"
    out["(b) tokens/s, cache"] = rates[True]
    out["(b) tokens/s, none"] = rates[False]
    out["(b) tokens/s ratio"] = rates[True] / rates[False]
    out["(b) cache hits"] = stats[True]["hits"]
    out["(b) cache misses"] = stats[True]["misses"]
    per_turn = "  ".join(f"{w[0] * 1e3:.1f}/{wo[0] * 1e3:.1f}"
                         for w, wo in zip(single[True], single[False]))
    print(f"  (a) TTFT ms per turn, cache/none: {per_turn}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--quick", action="store_true",
                   help="one run, 4 chats of 4 turns with 20-token answers")
    add_smoke_option(p, "a few seconds, one run of 2 chats of 3 short turns")
    args = p.parse_args(argv)
    shape = Shape(system=500, user=50, answer=100, turns=10)
    if args.quick:
        args.runs, args.chats = 1, 4
        shape = Shape(system=500, user=50, answer=20, turns=4)
    if args.smoke:
        args.runs, args.chats = 1, 2
        shape = Shape(system=40, user=8, answer=3, turns=3)
    with tempfile.TemporaryDirectory(prefix="calfsm-bench-evidence-") as evidence:
        write_evidence(evidence)
        runs = repeat(args.runs, lambda i: one_run(args, evidence, i, shape))
    end = shape.system + shape.turns * (shape.user + shape.answer)
    print(f"\nchats of a {shape.system}-token system prompt and {shape.turns} turns of "
          f"{shape.user} + {shape.answer} tokens (history to {end}); decode "
          f"{DECODE_S * 1e3:.0f} ms, prefill {PREFILL_TOKEN_S * 1e6:.0f} us/token, "
          f"batch_row_share {SHARE}; the suffix's prefill alone "
          f"{(shape.user + 1) * PREFILL_TOKEN_S * 1e3:.1f} ms")
    print_summary(runs, width=36)
    return 0


if __name__ == "__main__":
    sys.exit(main())
