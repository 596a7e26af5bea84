"""One decode round trip through cffi on the native emulator, beside the same on SimDriver.

Run from the repository root::

    python bench/bench_cffi.py                 # defaults: --vocab 1024 --steps 2000 --reps 7
    python bench/bench_cffi.py --smoke   # seconds; its figures mean nothing

A "round trip" is what the executor does per decode step, with zero device latency:
write the token and position into the mapped host arrays, set both CSRs, ``infer``,
``wait``, ``status`` (KV was applied once up front, as the executor reserves it per job).
Measured in one run, interleaved (emulator batch, sim batch, ...), on:

- ``CalrtDriver`` (cffi ABI mode -> ``libcalrt_emu.so``; real clock, the device thread
  executes the job and ``wait`` blocks on a condition variable);
- ``CalrtDriver.virtual`` (same library, device time follows a VirtualClock: ``wait``
  hands the due job to the device thread and waits for it);
- ``SimDriver`` (pure Python, VirtualClock, ``LatencyModel.zero()``).

Reported: best and median microseconds per round trip over ``--reps`` batches of
``--steps`` steps, and the share of the C calls in it (the same loop with the emulator's
compute replaced by a CCU-exception fault, which returns before the logits are computed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runs import add_smoke_option

from calfsm.drivers.base import Calbin
from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.manifest import TaskKind
from tests.drivers.util import setup, small_calbin


def _prepare(d, cb: Calbin):
    d.configure(cb)
    dec = setup(d, cb, TaskKind.DECODE)
    assert d.set_kv_seq(dec.inp, 0) == 0
    return dec


def _batch(d, dec, steps: int, start: int) -> float:
    tok, pos = dec.tok.reshape(-1), dec.pos.reshape(-1)
    model, inp, out = dec.model, dec.inp, dec.out
    infer, wait, status, set_csr = d.infer, d.wait, d.status, d.set_csr
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        tok[0] = i & 1023
        pos[0] = i
        set_csr(inp, "cur_seq", 1)
        set_csr(inp, "total_seq", i + 1)
        infer(model, inp, out)
        wait(out, 1.0)
        status(out)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    add_smoke_option(ap, "a second, 50 steps x 2 reps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.reps = 50, 2
    cb = small_calbin(vocab=args.vocab, max_seq=(args.reps + 1) * args.steps + 16)
    positions = (args.reps + 1) * args.steps + 16
    zero = LatencyModel.zero()
    no_compute = FaultPlan.of(FaultRule.always("infer", "ccu_exception"))
    drivers = {
        "calrt (cffi, real clock)": CalrtDriver(latency=zero),
        "calrt (cffi, virtual clock)": CalrtDriver.virtual(latency=zero),
        "sim (python, virtual clock)": SimDriver(latency=zero),
        "calrt calls only (no compute)": CalrtDriver(latency=zero, faults=no_compute),
    }
    runs = {}
    for name, d in drivers.items():
        dec = _prepare(d, cb)
        assert d.kv_apply(0, positions)
        _batch(d, dec, min(200, args.steps), 0)   # warm up
        runs[name] = (d, dec, [])
    for rep in range(args.reps):
        for d, dec, times in runs.values():
            times.append(_batch(d, dec, args.steps, (rep + 1) * args.steps))
    print(f"decode round trip (set 2 CSRs, infer, wait, status), V={args.vocab}, "
          f"{args.steps} steps x {args.reps} reps, zero device latency")
    print(f"{'driver':32} {'best us':>9} {'median us':>10}")
    for name, (d, _dec, times) in runs.items():
        print(f"{name:32} {min(times) * 1e6:9.1f} {statistics.median(times) * 1e6:10.1f}")
        d.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
