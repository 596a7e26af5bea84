"""Vendor runner: after an execution timeout, is there a safe cancel, or only a reset?
(spec section 14)

In each trial a long job A runs on Ping and a decode B on Pong (when the device has
parallel mode), another sequence K holds KV, and A's wait is given less time than A
needs, so it times out the way an execution deadline does. Then one candidate is tried
to stop A — ``destroy_buffers`` on A's buffers, then each reset kind — and the runner
records what happened to A (aborted? any DMA into its output afterwards?), to B (did it
still finish correctly?), to the configuration, to K's KV, and whether the golden passes.

``safe_cancel_after_timeout`` holds when some candidate ends A and only A (B finishes
correctly, the configuration and K's KV stay, the golden passes). The protocol has no
per-job cancel, so on the shipped drivers it does not hold, and the evidence says which
reset ends the job instead. ``timeout_recovery_by_reset`` holds when some reset ends A and
the golden passes after it (naming the lightest such kind).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from calfsm.drivers import Driver
from calfsm.drivers.base import EngineSlot, OutputStatus, ResetKind
from calfsm.errors import code_name
from calfsm.manifest import TaskKind
from calfsm.plan.capabilities import Verdict
from calfsm.tools.vendor_runner import Bench, Outcome, RunContext, golden, run_runner

NAME = "cancel_after_timeout"
CANDIDATES = ("destroy_buffers", *(f"reset_{k.value}" for k in ResetKind))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=64, metavar="N",
                   help="job A is a prefill of N tokens (default 64): make it longer than "
                        "--exec-timeout-s on a fast device")
    p.add_argument("--exec-timeout-s", type=float, default=0.001, metavar="S",
                   help="the execution deadline given to A's wait (default 1 ms)")


def _name(rc: int) -> str:
    return code_name(rc) if rc else "SUCCESS"


def trial(ctx: RunContext, candidate: str, index: int) -> dict[str, Any]:
    """One timed-out job A, one candidate to stop it, and what it did."""
    b: Bench = ctx.bench
    d, args = ctx.driver, ctx.args
    obs: dict[str, Any] = {"candidate": candidate}
    lost, rc = b.ensure_configured()
    if rc:
        return {**obs, "error": f"configure: {_name(rc)}"}
    parallel = d.enable_parallel_mode(True) == 0
    obs["parallel_mode"] = parallel
    k_seq, a_seq, b_seq = 200 + 10 * index, 201 + 10 * index, 202 + 10 * index
    pre = b.slot(TaskKind.PREFILL_IDS)
    t0 = d.clock.now()
    obs["k_prefill"] = b.run(pre, k_seq, b.prompt(k_seq, 3), 0)
    job_s = d.clock.now() - t0
    a = b.slot(TaskKind.PREFILL_IDS, EngineSlot.PING if parallel else EngineSlot.AUTO)
    other = b.slot(TaskKind.DECODE, EngineSlot.PONG) if parallel else None
    a_tokens = b.prompt(a_seq, args.tokens)
    a.fill()
    call, rc = a.program(a_seq, a_tokens, 0)
    if rc == 0:
        call, rc = "infer", a.submit()
    if rc:
        return {**obs, "error": f"job A {call}: {_name(rc)}"}
    if other is not None:
        other.fill()
        call, rc = other.program(b_seq, [4], 0)
        if rc == 0:
            call, rc = "infer_fixed", other.submit()
        obs["b_submit"] = _name(rc)
        if rc:
            other = None
    rc = a.wait(args.exec_timeout_s)
    obs["a_wait"] = _name(rc)
    if rc == 0:
        # A finished inside the deadline: nothing timed out, nothing to learn
        return {**obs, "error": "job A finished within --exec-timeout-s: make it longer "
                                "(--tokens) or the deadline shorter"}
    if candidate == "destroy_buffers":
        rc = a.destroy()
    else:
        rc = d.reset(ResetKind(candidate.removeprefix("reset_")))
    obs["cancel_code"] = _name(rc)
    obs["a_status_after"] = a.status().name
    obs["b_status_after"] = other.status().name if other is not None else None
    # whatever is still running gets the time to finish, then the outcome is read
    obs["b_wait"] = _name(other.wait()) if other is not None else None
    obs["a_wait_again"] = _name(a.wait())
    b.settle(4 * max(job_s, 1e-3) + args.exec_timeout_s)
    a_status = a.status()
    obs["a_ended"] = a_status.name
    want_a = b.chain.hashes(a_seq, a_tokens, 0)[-1]
    obs["a_output"] = ("untouched" if a.filled() else
                       "written correctly" if a.matches(want_a) else "written, wrong")
    obs["b_ended"] = other.status().name if other is not None else None
    obs["b_correct"] = (other.status() is OutputStatus.DONE_OK
                        and other.matches(b.chain.hashes(b_seq, [4], 0)[0])) \
        if other is not None else None
    # does the configuration still hold without configuring again?
    lost, rc = b.ensure_configured()
    obs["configuration_kept"] = not lost
    if rc:
        return {**obs, "error": f"configure after {candidate}: {_name(rc)}"}
    dec = b.slot(TaskKind.DECODE)
    obs["k_kv"] = b.probe_word(dec, k_seq, 2, {"intact": b.chain.word(k_seq, 2),
                                               "cleared": 0})
    for s in (pre, dec, a, *((other,) if other is not None else ())):
        s.destroy()                     # stale ones (after a reset) refuse: harmless
    for seq in (k_seq, a_seq, b_seq):
        d.kv_release(seq, 0)
    obs["golden"] = golden(d, ctx.manifest, timeout_s=args.timeout_s)
    stopped = a_status is OutputStatus.DONE_ABORTED and obs["a_output"] == "untouched"
    obs["stopped_a"] = stopped
    obs["spared_b"] = obs["b_correct"] is not False
    obs["safe"] = (obs["cancel_code"] == "SUCCESS" and stopped and obs["spared_b"]
                   and obs["configuration_kept"] and obs["k_kv"] == "intact"
                   and obs["golden"]["passed"])
    return obs


def _effect(t: dict[str, Any]) -> str:
    if "error" in t:
        return f"{t['candidate']}: not observed ({t['error']})"
    if t["cancel_code"] != "SUCCESS":
        return f"{t['candidate']} returned {t['cancel_code']} (A then ended {t['a_ended']})"
    parts = [f"A {'aborted, no DMA after' if t['stopped_a'] else 'ended ' + t['a_ended']}"]
    if t["b_ended"] is None:
        parts.append("no job on another engine to spare")
    else:
        parts.append("B on the other engine finished" if t["spared_b"]
                     else f"B on the other engine ended {t['b_ended']}")
    parts.append("configuration kept" if t["configuration_kept"] else "configuration dropped")
    parts.append(f"other KV {t['k_kv']}")
    parts.append("golden passes" if t["golden"]["passed"] else "golden FAILS")
    return f"{t['candidate']}: " + ", ".join(parts)


def observe(ctx: RunContext) -> Outcome:
    trials = [trial(ctx, c, i) for i, c in enumerate(CANDIDATES)]
    obs: dict[str, Any] = {"trials": trials, "exec_timeout_s": ctx.args.exec_timeout_s}
    observed = [t for t in trials if "error" not in t]
    complete = bool(observed) and all("error" not in t for t in trials
                                      if t["candidate"] == "destroy_buffers"
                                      or t.get("cancel_code") != "UNSUPPORTED")
    effects = "; ".join(_effect(t) for t in trials)
    safe = [t["candidate"] for t in observed if t["safe"]]
    resets = [t for t in observed if t["candidate"].startswith("reset_")
              and t["cancel_code"] == "SUCCESS" and t["stopped_a"] and t["golden"]["passed"]]
    verdicts: dict[str, Verdict] = {}
    if observed:
        verdicts["safe_cancel_after_timeout"] = Verdict(
            bool(safe), (f"{safe[0]} ends only the timed-out job" if safe
                         else "no safe cancel, only reset") + f" — {effects}")
        verdicts["timeout_recovery_by_reset"] = Verdict(
            bool(resets), (f"{resets[0]['candidate']} ends the timed-out job and the golden "
                           "passes after it" if resets
                           else "no reset ends the timed-out job with a passing golden")
            + f" — {effects}")
    summary = [f"- {_effect(t)}" for t in trials]
    return Outcome(obs, verdicts, summary, complete=complete)


def main(argv: list[str] | None = None, *, driver: Driver | None = None) -> int:
    return run_runner(NAME, __doc__.splitlines()[0], observe, argv, add_arguments,
                      driver=driver)


if __name__ == "__main__":
    sys.exit(main())
