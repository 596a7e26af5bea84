"""Vendor runner: do jobs on Ping and Pong really overlap H2D, compute and D2H?
(spec section 14)

With parallel mode on, it runs the same two decode jobs, one on each fixed engine, two
ways in each round: *serial* (submit one, wait, then the other: what one in flight
gives) and *paired* (submit both, then wait for both). It times every job from the host,
on the driver's clock, around ``infer`` and ``wait`` — all a vendor runtime offers — and
checks every output against the reference model. When the driver also reports a per-job
phase timeline (``driver.timeline()``: the simulated device and the emulator can), the
evidence records each job's H2D, compute and D2H spans, and which phases of the two jobs
ran at the same time.

The verdict ``pingpong_overlap`` holds when the paired pair finishes in at most
1 / (1 + ``--min-gain``) of the serial pair's time (median over the rounds; the default
gain 0.10 is spec 13.3's gate for enabling two in flight) with every output correct.
It also writes the timeline as Chrome trace-event JSON (open it in https://ui.perfetto.dev
or chrome://tracing) and, with matplotlib installed (``pip install calfsm[charts]``), as
a PNG chart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from calfsm.drivers import Driver
from calfsm.drivers.base import EngineSlot, JobTag, OutputStatus
from calfsm.errors import code_name
from calfsm.manifest import TaskKind
from calfsm.plan.capabilities import Verdict
from calfsm.tools.vendor_runner import Outcome, RunContext, Slot, run_runner

NAME = "overlap"
_SEQS = {EngineSlot.PING: 40, EngineSlot.PONG: 41}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, metavar="N",
                   help="serial and paired rounds (default 5)")
    p.add_argument("--min-gain", type=float, default=0.10, metavar="G",
                   help="the throughput gain of pairing that counts as overlap "
                        "(default 0.10: spec 13.3's gate)")


class Jobs:
    """The two engines' slots, their positions, and every job's host-side times."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.slots = {e: ctx.bench.slot(TaskKind.DECODE, e) for e in _SEQS}
        self.pos = dict.fromkeys(_SEQS, 0)
        self.jobs: list[dict[str, Any]] = []
        self.wrong = 0
        self.codes: list[str] = []

    def submit(self, engine: EngineSlot, mode: str, rnd: int) -> dict[str, Any] | None:
        ctx, slot, seq = self.ctx, self.slots[engine], _SEQS[engine]
        token = (rnd * 17 + int(engine) * 5 + 3) % slot.vocab
        call, rc = slot.program(seq, [token], self.pos[engine])
        job = {"id": len(self.jobs) + 1, "engine": engine.name, "mode": mode, "round": rnd,
               "seq": seq, "token": token, "position": self.pos[engine]}
        job["t_submit"] = ctx.driver.clock.now()
        if rc == 0:
            call, rc = "infer_fixed", slot.submit(JobTag(10_000 + job["id"], seq))
        job["t_submitted"] = ctx.driver.clock.now()
        if rc:
            self.codes.append(f"{call}: {code_name(rc)}")
            return None
        self.jobs.append(job)
        return job

    def collect(self, job: dict[str, Any]) -> None:
        engine = EngineSlot[job["engine"]]
        slot: Slot = self.slots[engine]
        rc = slot.wait()
        job["t_done"] = self.ctx.driver.clock.now()
        if rc:
            self.codes.append(f"wait: {code_name(rc)}")
            return
        want = self.ctx.bench.chain.record(job["seq"], [job["token"]], job["position"])[0]
        job["correct"] = slot.status() is OutputStatus.DONE_OK and slot.matches(want)
        self.wrong += not job["correct"]
        self.pos[engine] += 1


def _rounds(jobs: Jobs, n: int) -> dict[str, list[float]]:
    spans: dict[str, list[float]] = {"serial": [], "paired": []}
    for rnd in range(n):
        a = jobs.submit(EngineSlot.PING, "serial", rnd)
        if a is None:
            break
        jobs.collect(a)
        b = jobs.submit(EngineSlot.PONG, "serial", rnd)
        if b is None:
            break
        jobs.collect(b)
        spans["serial"].append(b["t_done"] - a["t_submit"])
        a = jobs.submit(EngineSlot.PING, "paired", rnd)
        b = jobs.submit(EngineSlot.PONG, "paired", rnd) if a is not None else None
        if b is None:
            break
        jobs.collect(a)
        jobs.collect(b)
        spans["paired"].append(max(a["t_done"], b["t_done"]) - a["t_submit"])
    return spans


def _device_phases(ctx: RunContext, jobs: Jobs) -> list[dict[str, Any]] | None:
    """The driver's per-job phase spans of our jobs, if it keeps a timeline."""
    timeline = getattr(ctx.driver, "timeline", None)
    spans = timeline() if callable(timeline) else None
    if spans is None:
        return None
    ours = {10_000 + j["id"]: j["id"] for j in jobs.jobs}
    out = []
    for s in spans:
        tag = getattr(s, "tag", None)
        if tag is None or tag.job_id not in ours:
            continue
        out.append({"job": ours[tag.job_id], "engine": EngineSlot(s.engine).name,
                    "phase": str(getattr(s.phase, "value", s.phase)),
                    "start": float(s.start), "end": float(s.end)})
    return out


def _phase_overlaps(phases: list[dict[str, Any]], jobs: Jobs) -> dict[str, float]:
    """Seconds, summed over the paired rounds, that a phase of the PING job and a phase
    of the PONG job of one round ran at the same time (e.g. ``h2d|compute``)."""
    by_job: dict[int, list[dict[str, Any]]] = {}
    for p in phases:
        by_job.setdefault(p["job"], []).append(p)
    total: dict[str, float] = {}
    paired = [j for j in jobs.jobs if j["mode"] == "paired"]
    for rnd in {j["round"] for j in paired}:
        pair = [j for j in paired if j["round"] == rnd]
        if len(pair) != 2:
            continue
        a, b = pair
        for pa in by_job.get(a["id"], []):
            for pb in by_job.get(b["id"], []):
                both = min(pa["end"], pb["end"]) - max(pa["start"], pb["start"])
                if both > 0:
                    key = "|".join(sorted((pa["phase"], pb["phase"])))
                    total[key] = total.get(key, 0.0) + both
    return total


def chrome_trace(jobs: Jobs, phases: list[dict[str, Any]] | None, t0: float) -> dict:
    """Trace-event JSON: the host's view of every job, and the device's phases."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "host: infer -> wait"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "device phases"}}]
    for tid, engine in enumerate(_SEQS, 1):
        for pid in (1, 2):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": engine.name}})
    tids = {e.name: i for i, e in enumerate(_SEQS, 1)}
    for j in jobs.jobs:
        if "t_done" not in j:
            continue
        events.append({"ph": "X", "pid": 1, "tid": tids[j["engine"]],
                       "name": f"{j['mode']} job {j['id']}", "cat": j["mode"],
                       "ts": (j["t_submit"] - t0) * 1e6,
                       "dur": (j["t_done"] - j["t_submit"]) * 1e6,
                       "args": {"round": j["round"], "seq": j["seq"],
                                "correct": j.get("correct")}})
    for p in phases or ():
        events.append({"ph": "X", "pid": 2, "tid": tids[p["engine"]],
                       "name": f"{p['phase']} (job {p['job']})", "cat": p["phase"],
                       "ts": (p["start"] - t0) * 1e6, "dur": (p["end"] - p["start"]) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def png_chart(path: Any, jobs: Jobs, phases: list[dict[str, Any]] | None, t0: float,
              title: str) -> str:
    """A Gantt chart of the jobs (and phases); the note of what was written."""
    try:
        import matplotlib
    except ImportError:
        return "not written: matplotlib is not installed (pip install 'calfsm[charts]')"
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    colors = {"serial": "tab:gray", "paired": "tab:blue", "h2d": "tab:orange",
              "compute": "tab:green", "d2h": "tab:purple"}
    rows = [("host", e.name) for e in _SEQS] + ([("device", e.name) for e in _SEQS]
                                                if phases else [])
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * len(rows)))
    for y, (view, engine) in enumerate(rows):
        if view == "host":
            bars = [((j["t_submit"] - t0) * 1e3, (j["t_done"] - j["t_submit"]) * 1e3,
                     j["mode"]) for j in jobs.jobs if j["engine"] == engine and "t_done" in j]
        else:
            bars = [((p["start"] - t0) * 1e3, (p["end"] - p["start"]) * 1e3, p["phase"])
                    for p in phases or () if p["engine"] == engine]
        for start, width, kind in bars:
            ax.broken_barh([(start, width)], (y - 0.35, 0.7), facecolors=colors[kind],
                           edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"{v} {e}" for v, e in rows])
    ax.set_xlabel("time on the driver's clock (ms)")
    ax.set_title(title, fontsize=9)
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()
               if phases or k in ("serial", "paired")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "written"


def observe(ctx: RunContext) -> Outcome:
    d, args = ctx.driver, ctx.args
    obs: dict[str, Any] = {"min_gain": args.min_gain, "rounds": args.rounds}
    rc = d.enable_parallel_mode(True)
    obs["enable"] = code_name(rc) if rc else "SUCCESS"
    if rc:
        v = Verdict(False, f"no Ping/Pong to overlap: enable_parallel_mode(True) returned "
                           f"{obs['enable']}")
        return Outcome(obs, {"pingpong_overlap": v}, [f"- {v.reason}"])
    jobs = Jobs(ctx)
    t0 = d.clock.now()
    spans = _rounds(jobs, args.rounds)
    phases = _device_phases(ctx, jobs)
    obs.update(makespan_s=spans, jobs=jobs.jobs, wrong=jobs.wrong, codes=jobs.codes,
               clock="virtual" if getattr(d.clock, "virtual", False) else "real",
               device_timeline=phases is not None, phases=phases)
    complete = len(spans["paired"]) == args.rounds
    if not complete:
        return Outcome(obs, {}, [f"- could not run every round: {jobs.codes}"],
                       complete=False)
    serial = statistics.median(spans["serial"])
    paired = statistics.median(spans["paired"])
    gain = serial / paired - 1.0 if paired > 0 else 0.0
    obs.update(serial_median_s=serial, paired_median_s=paired, gain=gain,
               saved_share_of_serial=1.0 - paired / serial if serial > 0 else 0.0)
    overlaps = _phase_overlaps(phases, jobs) if phases is not None else None
    obs["phase_overlap_s"] = overlaps
    holds = jobs.wrong == 0 and not jobs.codes and gain >= args.min_gain
    seen = (f"paired {paired * 1e3:.3f} ms vs serial {serial * 1e3:.3f} ms (median of "
            f"{args.rounds}): {gain:+.1%} throughput, {'at least' if holds else 'below'} "
            f"the {args.min_gain:.0%} that counts (ideal pipelining: +100%)")
    if overlaps is not None:
        seen += ("; device phases at once: " + (", ".join(
            f"{k} {v * 1e3:.3f} ms" for k, v in sorted(overlaps.items())) or "none"))
    if jobs.wrong or jobs.codes:
        seen += f"; {jobs.wrong} wrong outputs, codes {jobs.codes[:3]}"
    trace_path = ctx.out / f"{ctx.stem}-trace.json"
    ctx.out.mkdir(parents=True, exist_ok=True)
    trace_path.write_text(json.dumps(chrome_trace(jobs, phases, t0)), "utf-8")
    ctx.add_file("chrome_trace", trace_path)
    png_path = ctx.out / f"{ctx.stem}-timeline.png"
    obs["png"] = png_chart(png_path, jobs, phases, t0,
                           f"Ping/Pong on {ctx.args.driver}: pairing gives {gain:+.1%} "
                           f"throughput ({'overlap' if holds else 'no overlap that counts'})")
    if obs["png"] == "written":
        ctx.add_file("png_chart", png_path)
    summary = [f"- {seen}",
               f"- timeline: `{trace_path.name}` (Perfetto / chrome://tracing)"
               + (f", chart `{png_path.name}`" if obs["png"] == "written"
                  else f"; PNG {obs['png']}"),
               "- device phase timeline: " + ("yes" if phases is not None
                                              else "no (host-side timestamps only)")]
    return Outcome(obs, {"pingpong_overlap": Verdict(holds, seen)}, summary)


def main(argv: list[str] | None = None, *, driver: Driver | None = None) -> int:
    return run_runner(NAME, __doc__.splitlines()[0], observe, argv, add_arguments,
                      driver=driver)


if __name__ == "__main__":
    sys.exit(main())
