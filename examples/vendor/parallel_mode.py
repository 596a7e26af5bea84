"""Vendor runner: is parallel mode thread safe, how many jobs are really in flight, and
what does switching it off or closing the device do to jobs in flight? (spec section 14)

It enables parallel mode, then observes, with raw protocol calls only:

1. the real maximum in flight: decode jobs on fresh buffers submitted one after another
   until the device refuses one, checking the accepted ones were all still pending;
2. Ping and Pong: a job on each fixed engine, and a second one on a busy engine;
3. thread safety: several threads, each with its own sequence and buffers, decoding
   at once (program, infer, wait, status) while another thread polls the KV manager and
   a status; every output must be the reference model's for that thread's sequence;
4. drain: parallel mode switched off with two jobs in flight, then the device closed
   with two jobs in flight (is any job left half-done, does any DMA land after close?).

Answers ``parallel_thread_safe``, ``parallel_two_in_flight`` and
``parallel_drain_on_close``. Run ``python examples/vendor/parallel_mode.py --help``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from calfsm.drivers import Driver
from calfsm.drivers.base import EngineSlot, OutputStatus
from calfsm.errors import CalrtCode, code_name
from calfsm.manifest import TaskKind
from calfsm.plan.capabilities import Verdict
from calfsm.tools.vendor_runner import Chain, Outcome, RunContext, Slot, run_runner

NAME = "parallel_mode"
_BUSY = int(CalrtCode.DEVICE_BUSY)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=4, metavar="N",
                   help="threads decoding at once (default 4)")
    p.add_argument("--steps", type=int, default=25, metavar="N",
                   help="decode steps per thread (default 25)")


def max_in_flight(ctx: RunContext, n_slots: int) -> dict[str, Any]:
    """Submit decodes on fresh buffers until the device refuses one."""
    b = ctx.bench
    slots = [b.slot(TaskKind.DECODE) for _ in range(n_slots)]
    accepted, refused = [], None
    t0 = ctx.driver.clock.now()
    for i, s in enumerate(slots):
        call, rc = s.program(10 + i, [5 + i], 0)
        if rc == 0:
            call, rc = "infer", s.submit()
        if rc:
            refused = f"{call}: {code_name(rc)}"
            break
        accepted.append((10 + i, s))
    pending = [s.status() is OutputStatus.PENDING for _, s in accepted]
    waits = [code_name(rc) if (rc := s.wait()) else "SUCCESS" for _, s in accepted]
    job_s = (ctx.driver.clock.now() - t0) / max(len(accepted), 1)
    correct = [s.status() is OutputStatus.DONE_OK
               and s.matches(b.chain.hashes(seq, [5 + i], 0)[0])
               for i, (seq, s) in enumerate(accepted)]
    for s in slots:
        s.destroy()
    return {"slots_tried": n_slots, "accepted": len(accepted), "refused": refused,
            "all_pending_at_refusal": all(pending), "waits": waits,
            "outputs_correct": all(correct), "mean_job_s": job_s}


def ping_pong(ctx: RunContext) -> dict[str, Any]:
    """One job on each fixed engine, and a second job on a busy engine."""
    b = ctx.bench
    ping, ping2, pong = (b.slot(TaskKind.DECODE, e)
                         for e in (EngineSlot.PING, EngineSlot.PING, EngineSlot.PONG))
    obs: dict[str, Any] = {}
    for label, s, seq in (("ping", ping, 20), ("ping_again", ping2, 21), ("pong", pong, 22)):
        call, rc = s.program(seq, [3], 0)
        if rc == 0:
            call, rc = "infer_fixed", s.submit()
        obs[label] = "SUCCESS" if rc == 0 else f"{call}: {code_name(rc)}"
    obs["both_pending"] = ping.status() is OutputStatus.PENDING and \
        pong.status() is OutputStatus.PENDING
    ok = []
    for label, s, seq in (("ping", ping, 20), ("ping_again", ping2, 21), ("pong", pong, 22)):
        if obs[label] == "SUCCESS":
            rc = s.wait()
            ok.append(rc == 0 and s.status() is OutputStatus.DONE_OK
                      and s.matches(b.chain.hashes(seq, [3], 0)[0]))
    obs["outputs_correct"] = bool(ok) and all(ok)
    for s in (ping, ping2, pong):
        s.destroy()
    return obs


def threads(ctx: RunContext, n_threads: int, steps: int) -> dict[str, Any]:
    """Decoders on their own sequences at once, and a poller, from several threads."""
    b, d = ctx.bench, ctx.driver
    slots = [b.slot(TaskKind.DECODE) for _ in range(n_threads)]
    idle = b.slot(TaskKind.DECODE)
    cond = threading.Condition()
    state = {"in_flight": 0, "max_in_flight": 0}
    results: list[dict[str, Any]] = [{} for _ in range(n_threads)]
    done = threading.Event()
    deadline = time.monotonic() + 4 * ctx.args.timeout_s

    def decoder(i: int, slot: Slot) -> None:
        seq, chain = 100 + i, Chain()
        r = results[i]
        r.update(jobs=0, busy_retries=0, wrong=0, unexpected=[], error=None)
        try:
            for step in range(steps):
                token = (i * 13 + step * 7 + 1) % slot.vocab
                call, rc = slot.program(seq, [token], step)
                if rc == 0:
                    call, rc = "infer", slot.submit()
                while rc == _BUSY and time.monotonic() < deadline:
                    r["busy_retries"] += 1
                    time.sleep(0.0002)      # another thread's job holds the engines
                    rc = slot.submit()
                if rc:
                    r["unexpected"].append(f"{call}: {code_name(rc)}")
                    return
                with cond:
                    state["in_flight"] += 1
                    state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
                    cond.notify_all()
                    # give another thread the moment to submit too, so that calls really
                    # overlap with two in flight (bounded: a device of one never gets two)
                    cond.wait_for(lambda: state["in_flight"] >= 2, timeout=0.02)
                rc = slot.wait()
                with cond:
                    state["in_flight"] -= 1
                if rc:
                    r["unexpected"].append(f"wait: {code_name(rc)}")
                    return
                want = chain.record(seq, [token], step)[0]
                if slot.status() is not OutputStatus.DONE_OK or not slot.matches(want):
                    r["wrong"] += 1
                r["jobs"] += 1
        except Exception as e:          # a crash in a driver call is an observation
            r["error"] = f"{type(e).__name__}: {e}"

    poll = {"calls": 0, "error": None}

    def poller() -> None:
        try:
            while not done.is_set():
                d.kv_can_allocate(1)
                d.status(idle.out)
                poll["calls"] += 1
                time.sleep(0.0005)
        except Exception as e:
            poll["error"] = f"{type(e).__name__}: {e}"

    workers = [threading.Thread(target=decoder, args=(i, s), name=f"decoder-{i}")
               for i, s in enumerate(slots)]
    watcher = threading.Thread(target=poller, name="poller")
    watcher.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    done.set()
    watcher.join(5.0)
    hung = [t.name for t in workers if t.is_alive()]
    for s in (*slots, idle):
        if not hung:
            s.destroy()
    for i in range(n_threads):
        b.driver.kv_release(100 + i, 0)
    return {"threads": n_threads, "steps": steps, "per_thread": results, "poller": poll,
            "hung_threads": hung, "max_concurrent_submitted": state["max_in_flight"],
            "jobs": sum(r.get("jobs", 0) for r in results),
            "wrong": sum(r.get("wrong", 0) for r in results),
            "unexpected": [u for r in results for u in r.get("unexpected", [])],
            "errors": [r["error"] for r in results if r.get("error")]
            + ([poll["error"]] if poll["error"] else [])}


def _two_in_flight(ctx: RunContext, seqs: tuple[int, int], start: int
                   ) -> tuple[list[tuple[int, Slot]], list[str]]:
    b = ctx.bench
    pair = [(seqs[0], b.slot(TaskKind.DECODE, EngineSlot.PING)),
            (seqs[1], b.slot(TaskKind.DECODE, EngineSlot.PONG))]
    codes = []
    for seq, s in pair:
        s.fill()
        call, rc = s.program(seq, [9], start)
        if rc == 0:
            call, rc = "infer_fixed", s.submit()
        codes.append("SUCCESS" if rc == 0 else f"{call}: {code_name(rc)}")
    return pair, codes


def drain(ctx: RunContext, job_s: float) -> dict[str, Any]:
    """Parallel mode switched off, then the device closed, each with two jobs in flight."""
    d, b = ctx.driver, ctx.bench
    obs: dict[str, Any] = {}
    pair, obs["off_submit"] = _two_in_flight(ctx, (30, 31), 0)
    rc = d.enable_parallel_mode(False)
    obs["off_code"] = code_name(rc) if rc else "SUCCESS"
    obs["off_status_after"] = [s.status().name for _, s in pair]
    waits, correct = [], []
    for seq, s in pair:
        w = s.wait()
        waits.append(code_name(w) if w else "SUCCESS")
        correct.append(s.status() is OutputStatus.DONE_OK
                       and s.matches(b.chain.hashes(seq, [9], 0)[0]))
    obs["off_waits"], obs["off_outputs_correct"] = waits, correct
    obs["off_jobs_ended"] = [s.status().name for _, s in pair]
    for _, s in pair:
        s.destroy()
    rc = d.enable_parallel_mode(True)
    obs["reenable_code"] = code_name(rc) if rc else "SUCCESS"
    pair, obs["close_submit"] = _two_in_flight(ctx, (32, 33), 0)
    d.close()
    obs["close_status_after"] = after = [s.status().name for _, s in pair]
    d.clock.sleep(min(max(4 * job_s, 0.05), 5.0))    # past when they would have finished
    late = []
    for (seq, s), st in zip(pair, after):
        if st == OutputStatus.DONE_OK.name:
            late.append(not s.matches(b.chain.hashes(seq, [9], 0)[0]))
        else:
            late.append(not s.filled())       # aborted: the sentinel must be intact
    obs["close_late_writes"] = late
    return obs


def decide(obs: dict[str, Any], engines: int) -> dict[str, Verdict]:
    if obs["enable"] != "SUCCESS":
        why = f"enable_parallel_mode(True) returned {obs['enable']}"
        return {k: Verdict(False, why) for k in
                ("parallel_thread_safe", "parallel_two_in_flight", "parallel_drain_on_close")}
    t = obs["threads"]
    bad = t["wrong"] or t["unexpected"] or t["errors"] or t["hung_threads"] \
        or t["jobs"] != t["threads"] * t["steps"]
    # two in flight at once must have happened if the device takes two
    exercised = t["max_concurrent_submitted"] >= min(2, obs["max_in_flight"]["accepted"])
    if bad or not exercised:
        safe = Verdict(False, f"{t['jobs']} of {t['threads'] * t['steps']} jobs done, "
                              f"{t['wrong']} wrong outputs, unexpected codes "
                              f"{t['unexpected'][:3]}, errors {t['errors'][:2]}, hung "
                              f"{t['hung_threads']}, at most "
                              f"{t['max_concurrent_submitted']} submitted at once")
    else:
        safe = Verdict(True, f"{t['threads']} threads x {t['steps']} decodes, up to "
                             f"{t['max_concurrent_submitted']} jobs in progress at once, every "
                             f"output its own sequence's, {t['poller']['calls']} concurrent "
                             "status/KV polls")
    dr = obs["drain"]
    off_ok = dr["off_code"] in ("SUCCESS", "DEVICE_BUSY") and all(dr["off_outputs_correct"])
    close_ok = not any(dr["close_late_writes"]) and \
        OutputStatus.PENDING.name not in dr["close_status_after"]
    late = "a late write after close" if any(dr["close_late_writes"]) \
        else "no write after close"
    drained = Verdict(off_ok and close_ok,
                      f"parallel mode off with two in flight: {dr['off_code']}, the jobs "
                      f"then ended {dr['off_jobs_ended']} "
                      f"({'correct' if all(dr['off_outputs_correct']) else 'NOT correct'}); "
                      f"close with two in flight left them {dr['close_status_after']}, "
                      f"{late}")
    m, pp = obs["max_in_flight"], obs["ping_pong"]
    two = (m["accepted"] >= 2 and m["all_pending_at_refusal"] and m["outputs_correct"]
           and pp["ping"] == pp["pong"] == "SUCCESS" and pp["both_pending"]
           and pp["outputs_correct"] and pp["ping_again"] != "SUCCESS")
    parts = [f"max in flight {m['accepted']} (refused: {m['refused']}"
             f"{'' if m['all_pending_at_refusal'] else '; some had finished already'})",
             f"ping {pp['ping']}, pong {pp['pong']}, a second on ping {pp['ping_again']}",
             f"{engines} engine slots declared"]
    if not safe.holds:
        parts.append("not thread safe")
    if not drained.holds:
        parts.append("no clean drain")
    return {"parallel_thread_safe": safe,
            "parallel_two_in_flight": Verdict(two and safe.holds and drained.holds,
                                              "; ".join(parts)),
            "parallel_drain_on_close": drained}


def observe(ctx: RunContext) -> Outcome:
    d, args = ctx.driver, ctx.args
    caps = d.capabilities()
    obs: dict[str, Any] = {"declared": {"parallel_mode": caps.parallel_mode,
                                        "fixed_engine_slots": caps.fixed_engine_slots,
                                        "engine_slots": caps.engine_slots}}
    rc = d.enable_parallel_mode(True)
    obs["enable"] = code_name(rc) if rc else "SUCCESS"
    if rc == 0:
        obs["max_in_flight"] = max_in_flight(ctx, max(caps.engine_slots, 1) + 2)
        obs["ping_pong"] = ping_pong(ctx)
        obs["threads"] = threads(ctx, args.threads, args.steps)
        if obs["threads"]["hung_threads"]:
            return Outcome(obs, {}, ["A decoder thread never finished."], complete=False)
        obs["drain"] = drain(ctx, obs["max_in_flight"]["mean_job_s"])
    verdicts = decide(obs, caps.engine_slots)
    summary = [f"- enable parallel mode: {obs['enable']}"]
    if rc == 0:
        m, t = obs["max_in_flight"], obs["threads"]
        summary += [f"- max in flight: {m['accepted']} accepted, then {m['refused']}",
                    f"- threads: {t['jobs']} jobs, {t['wrong']} wrong, up to "
                    f"{t['max_concurrent_submitted']} submitted at once",
                    f"- drain: off -> {obs['drain']['off_code']}, close -> "
                    f"{obs['drain']['close_status_after']}"]
    return Outcome(obs, verdicts, summary)


def main(argv: list[str] | None = None, *, driver: Driver | None = None) -> int:
    return run_runner(NAME, __doc__.splitlines()[0], observe, argv, add_arguments,
                      driver=driver)


if __name__ == "__main__":
    sys.exit(main())
