"""Vendor runner: what does each reset kind do to in-flight DMA, the KV, the other engine
and host buffers, and does the golden pass after it? (spec section 14)

For each kind (``ResetKind``: ccu, configuration, full) it sets up a sequence K holding
KV, a prefill A in flight on Ping and a decode B in flight on Pong (one job when the
device has no parallel mode), sentinels in both outputs and a copy of both inputs; then
resets, lets device time pass, and records: each job's status right after the reset and
later, whether anything was written into an output after the reset (DMA that did not
stop), whether the input host arrays changed, whether the configuration survived,
whether parallel mode is still on, what became of K's KV (intact or cleared), and the
golden after the device is configured (and parallel mode enabled) again.

``reset_<kind>`` holds when the reset succeeds, ends both jobs (none left pending, no
late write, inputs untouched) and the golden passes afterwards; what it does to the KV,
the configuration and parallel mode is recorded in the reason, for recovery to rely on.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from calfsm.drivers import Driver
from calfsm.drivers.base import EngineSlot, OutputStatus, ResetKind
from calfsm.errors import CalrtCode, code_name
from calfsm.manifest import TaskKind
from calfsm.plan.capabilities import Verdict
from calfsm.tools.vendor_runner import Bench, Outcome, RunContext, Slot, golden, run_runner

NAME = "reset_semantics"


def _name(rc: int) -> str:
    return code_name(rc) if rc else "SUCCESS"


def _output(slot: Slot, want: int) -> str:
    if slot.filled():
        return "untouched"
    return "written correctly" if slot.matches(want) else "written, wrong"


def one_kind(ctx: RunContext, kind: ResetKind, index: int) -> dict[str, Any]:
    b: Bench = ctx.bench
    d = ctx.driver
    obs: dict[str, Any] = {"kind": kind.value}
    lost, rc = b.ensure_configured()
    if rc:
        return {**obs, "error": f"configure: {_name(rc)}"}
    parallel = d.enable_parallel_mode(True) == 0
    obs["parallel_mode_before"] = parallel
    k_seq, a_seq, b_seq = 400 + 10 * index, 401 + 10 * index, 402 + 10 * index
    pre = b.slot(TaskKind.PREFILL_IDS)
    t0 = d.clock.now()
    obs["k_prefill"] = b.run(pre, k_seq, b.prompt(k_seq, 3), 0)
    job_s = d.clock.now() - t0
    jobs: list[tuple[str, Slot, int, list[int]]] = [
        ("A", b.slot(TaskKind.PREFILL_IDS, EngineSlot.PING if parallel else EngineSlot.AUTO),
         a_seq, b.prompt(a_seq, 32))]
    if parallel:
        jobs.append(("B", b.slot(TaskKind.DECODE, EngineSlot.PONG), b_seq, [6]))
    inputs = {}
    for label, s, seq, tokens in jobs:
        s.fill()
        call, rc = s.program(seq, tokens, 0)
        if rc == 0:
            call, rc = "infer", s.submit()
        obs[f"{label}_submit"] = f"{call}: {_name(rc)}" if rc else "SUCCESS"
        inputs[label] = (s.tok.copy(), s.pos.copy())
    rc = d.reset(kind)
    obs["reset"] = _name(rc)
    if rc == CalrtCode.UNSUPPORTED:
        for _label, s, _seq, _tokens in jobs:
            s.wait()
        return obs
    obs["status_right_after"] = {label: s.status().name for label, s, _, _ in jobs}
    b.settle(4 * max(job_s, 1e-3))
    obs["status_later"] = {label: s.status().name for label, s, _, _ in jobs}
    obs["outputs"] = {label: _output(s, b.chain.hashes(seq, tokens, 0)[-1])
                      for label, s, seq, tokens in jobs}
    obs["inputs_unchanged"] = all(
        np.array_equal(s.tok, inputs[label][0]) and np.array_equal(s.pos, inputs[label][1])
        for label, s, _, _ in jobs)
    lost, rc = b.ensure_configured()
    obs["configuration_kept"] = not lost
    if rc:
        return {**obs, "error": f"configure after the reset: {_name(rc)}"}
    probe = b.slot(TaskKind.PREFILL_IDS, EngineSlot.PING) \
        if d.capabilities().fixed_engine_slots else None
    if probe is not None:       # still in parallel mode? infer_fixed says so
        call, rc = probe.program(k_seq + 5, [1], 0)
        rc = probe.submit() if rc == 0 else rc
        obs["parallel_mode_after"] = rc == 0
        if rc == 0:
            probe.wait()
        d.kv_release(k_seq + 5, 0)
    dec = b.slot(TaskKind.DECODE)
    obs["k_kv"] = b.probe_word(dec, k_seq, 2, {"intact": b.chain.word(k_seq, 2),
                                               "cleared": 0})
    if parallel:
        obs["reenable_parallel"] = _name(d.enable_parallel_mode(True))
    for s in (pre, dec, *(s for _, s, _, _ in jobs), *((probe,) if probe else ())):
        s.destroy()                     # stale ones (after a reset) refuse: harmless
    for seq in (k_seq, a_seq, b_seq):
        d.kv_release(seq, 0)
    b.chain.forget(k_seq)
    obs["golden"] = golden(d, ctx.manifest, timeout_s=ctx.args.timeout_s)
    return obs


def decide(o: dict[str, Any]) -> Verdict:
    kind = o["kind"]
    if "error" in o:
        return Verdict(False, f"reset {kind}: {o['error']}")
    if o["reset"] != "SUCCESS":
        return Verdict(False, f"reset {kind} returned {o['reset']}")
    ended = OutputStatus.PENDING.name not in o["status_later"].values()
    no_late = all(v == "untouched" or (v == "written correctly" and
                  o["status_later"][k] == OutputStatus.DONE_OK.name)
                  for k, v in o["outputs"].items())
    aborted = [k for k, v in o["status_later"].items() if v == OutputStatus.DONE_ABORTED.name]
    facts = [
        f"in flight: {', '.join(f'{k} {v}' for k, v in o['status_later'].items())}"
        + (" (the other engine's job too)" if "B" in aborted else ""),
        "no DMA after it" if no_late else "an output was written after it",
        "host inputs untouched" if o["inputs_unchanged"] else "host inputs CHANGED",
        "configuration kept" if o["configuration_kept"] else "configuration dropped",
        f"KV {o['k_kv']}"]
    if "parallel_mode_after" in o:
        facts.append("parallel mode stays on" if o["parallel_mode_after"]
                     else "parallel mode off (enable again)")
    facts.append("golden passes after it" if o["golden"]["passed"] else
                 f"golden FAILS after it ({o['golden']})")
    holds = ended and no_late and o["inputs_unchanged"] and o["golden"]["passed"]
    return Verdict(holds, f"reset {kind}: " + ", ".join(facts))


def observe(ctx: RunContext) -> Outcome:
    runs = [one_kind(ctx, k, i) for i, k in enumerate(ResetKind)]
    verdicts = {f"reset_{o['kind']}": decide(o) for o in runs}
    return Outcome({"kinds": runs}, verdicts, [f"- {v.reason}" for v in verdicts.values()],
                   complete=all("error" not in o for o in runs))


def main(argv: list[str] | None = None, *, driver: Driver | None = None) -> int:
    return run_runner(NAME, __doc__.splitlines()[0], observe, argv, driver=driver)


if __name__ == "__main__":
    sys.exit(main())
