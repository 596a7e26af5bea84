"""A bare ``import calfsm`` loads none of the heavy modules (issue 23: an embedder pays
the import at every process start); using the API loads what it needs, and works.

Each check runs in a fresh interpreter (this process has imported everything already).
Wall time is not asserted (the machines are busy); README.md gives the measured figure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import calfsm
from calfsm import DeviceExecutor, ExecutorConfig, Request, SimDriver, StepScheduler
from calfsm.manifest import builtin_manifest
from tests.helpers.embeds import EMBEDS_GOLDEN_TOKENS

ROOT = Path(__file__).resolve().parents[2]

#: what ``import calfsm`` must not load: the server, metrics, plots, the cffi driver,
#: ml_dtypes (~0.6 s alone), rich, the testing helpers and what they pull in
HEAVY = ("ml_dtypes", "cffi", "prometheus_client", "matplotlib", "starlette", "uvicorn",
         "rich", "calfsm.serve", "calfsm.telemetry.metrics", "calfsm.testing",
         "calfsm.drivers.calrt", "hypothesis", "ray")
#: lighter, but imported only by the calls that use them: asyncio (the async twins),
#: cattrs (loading a manifest), tomllib, importlib.resources (a built-in manifest),
#: importlib.metadata (drivers by entry point), the drivers themselves
ON_FIRST_USE = ("asyncio", "cattrs", "tomllib", "importlib.resources",
                "importlib.metadata", "calfsm.drivers.sim", "calfsm.drivers.faults")

_PRELUDE = f"""
import json, sys
HEAVY = {HEAVY!r}
ON_FIRST_USE = {ON_FIRST_USE!r}
def loaded(names=HEAVY):
    return sorted(m for m in names if m in sys.modules)
"""


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter at the repository root (so this checkout's
    calfsm is the one imported); returns the JSON object it prints last."""
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("calfsm_file") == calfsm.__file__      # the calfsm under test
    return out


def test_a_bare_import_loads_no_heavy_module() -> None:
    out = _run("""
        import calfsm
        print(json.dumps({"calfsm_file": calfsm.__file__, "loaded": loaded(),
                          "on_first_use": loaded(ON_FIRST_USE),
                          "names": sorted(calfsm.__all__), "dir": dir(calfsm)}))
    """)
    assert out["loaded"] == []
    assert out["on_first_use"] == []
    assert out["names"] == sorted(calfsm.__all__)
    assert set(out["dir"]) >= set(calfsm.__all__)      # the lazy names are listed too


def _tokens_in_process() -> list[int]:
    """The greedy tokens of the run the fresh interpreter makes, made here where
    everything is imported."""
    manifest = builtin_manifest("tiny")
    with DeviceExecutor(SimDriver(manifest, seed=0), manifest,
                        ExecutorConfig(threaded=False)) as ex:
        h = ex.enqueue(Request.prefill(0, [1, 2, 3]))
        StepScheduler(ex).run_until(h.done)
        first = h.result(0).greedy()
        h = ex.enqueue(Request.decode(0, first, 3))
        StepScheduler(ex).run_until(h.done)
        return [first, h.result(0).greedy()]


def test_the_executor_runs_after_a_bare_import_and_loads_only_what_it_uses() -> None:
    out = _run("""
        import calfsm
        from calfsm import (DeviceExecutor, ExecutorConfig, Request, SimDriver,
                            StepScheduler, builtin_manifest)
        before = loaded()
        manifest = builtin_manifest("tiny")
        ex = DeviceExecutor(SimDriver(manifest, seed=0), manifest,
                            ExecutorConfig(threaded=False))
        with ex:
            def run(request):
                h = ex.enqueue(request)
                StepScheduler(ex).run_until(h.done)
                return h.result(0)
            first = run(Request.prefill(0, [1, 2, 3])).greedy()
            tokens = [first, run(Request.decode(0, first, 3)).greedy()]
            after_tokens = loaded(HEAVY + ("asyncio",))
            # an embeddings prompt in BF16, then decodes on the same chain
            from tests.helpers.embeds import golden_embeds
            r = run(Request.prefill_embeds(5, golden_embeds()))
            embeds_tokens, pos = [r.greedy()], 17
            while len(embeds_tokens) < 4:
                embeds_tokens.append(run(Request.decode(5, embeds_tokens[-1], pos)).greedy())
                pos += 1
        print(json.dumps({"calfsm_file": calfsm.__file__, "before": before,
                          "after_tokens": after_tokens, "tokens": tokens,
                          "embeds_tokens": embeds_tokens}))
    """)
    assert out["before"] == []
    # the buffer slots' BF16 views need ml_dtypes; the native logits kernel, when the
    # bundled library has it, is loaded with cffi; nothing else (no asyncio: it is sync)
    assert "ml_dtypes" in out["after_tokens"]
    assert set(out["after_tokens"]) <= {"ml_dtypes", "cffi"}
    assert out["tokens"] == _tokens_in_process()
    assert out["embeds_tokens"] == EMBEDS_GOLDEN_TOKENS


def test_embeddings_requests_are_checked_after_a_bare_import() -> None:
    out = _run("""
        import calfsm
        import numpy as np
        from calfsm import InvalidArgument, Request
        ok = Request.prefill_embeds(0, np.zeros((2, 64), np.float16)).tokens.dtype.name
        try:
            Request.prefill_embeds(0, np.zeros((2, 64), np.float64))
            refused = None
        except InvalidArgument as e:
            refused = str(e)
        from calfsm.request import EMBED_DTYPES
        print(json.dumps({"calfsm_file": calfsm.__file__, "ok": ok, "refused": refused,
                          "dtypes": {k.value: v.name for k, v in EMBED_DTYPES.items()}}))
    """)
    assert out["ok"] == "float16"
    assert out["refused"] is not None and "F32, F16, BF16" in out["refused"]
    assert out["dtypes"] == {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
