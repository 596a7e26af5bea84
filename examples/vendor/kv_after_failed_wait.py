"""Vendor runner: when submit succeeded and the wait failed, is the KV partly updated?
(spec section 14)

Each scenario prefills a prompt on its own sequence, then submits a continuation F of a
few tokens that fails after a successful submit:

- ``timeout_then_late_completion``: F's wait times out, then a second wait lets it end;
- ``timeout_then_reset_<kind>``: F's wait times out, then the device is reset (CCU and
  configuration: the kinds that keep KV; a full reset clears all of it by design);
- ``device_exception``: F carries a CSR the device rejects at execution
  (``DONE_CCU_EXCEPTION`` after a successful wait).

Then it reads back, with decode probes from the top position down, each KV word F would
have written (is it F's word, still unwritten, or something else?) and the last word of
the prompt before F (intact?). ``kv_no_partial_update`` holds when in every scenario F's
positions are all written or none, and the prompt's KV is intact.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from calfsm.drivers import Driver
from calfsm.drivers.base import ResetKind
from calfsm.errors import code_name
from calfsm.manifest import TaskKind
from calfsm.plan.capabilities import Verdict
from calfsm.tools.vendor_runner import Bench, Outcome, RunContext, run_runner

NAME = "kv_after_failed_wait"
PROMPT, CONTINUATION = 5, 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--exec-timeout-s", type=float, default=0.0, metavar="S",
                   help="the execution deadline given to F's wait (default 0: already "
                        "past, as after a long stall)")


def _name(rc: int) -> str:
    return code_name(rc) if rc else "SUCCESS"


def scenario(ctx: RunContext, name: str, index: int) -> dict[str, Any]:
    b: Bench = ctx.bench
    d = ctx.driver
    obs: dict[str, Any] = {"scenario": name}
    lost, rc = b.ensure_configured()
    if rc:
        return {**obs, "error": f"configure: {_name(rc)}"}
    seq = 300 + index
    pre = b.slot(TaskKind.PREFILL_IDS)
    prompt = b.prompt(seq, PROMPT)
    obs["prompt"] = b.run(pre, seq, prompt, 0)
    if not obs["prompt"].get("correct"):
        return {**obs, "error": "the prompt's prefill failed"}
    f_tokens = b.prompt(seq, CONTINUATION, offset=1)
    wrong_total = name == "device_exception"
    call, rc = pre.program(seq, f_tokens, PROMPT,
                           total=PROMPT + CONTINUATION + 1 if wrong_total else None)
    if rc == 0:
        call, rc = "infer", pre.submit()
    obs["submit"] = f"{call}: {_name(rc)}" if rc else "SUCCESS"
    if rc:
        return {**obs, "error": f"F could not be submitted: {obs['submit']}"}
    if wrong_total:
        obs["wait"] = _name(pre.wait())
    else:
        rc = pre.wait(ctx.args.exec_timeout_s)
        obs["wait"] = _name(rc)
        if rc == 0:
            return {**obs, "error": "F finished inside the execution deadline"}
        if name == "timeout_then_late_completion":
            obs["wait_again"] = _name(pre.wait())
        else:
            kind = ResetKind(name.removeprefix("timeout_then_reset_"))
            obs["reset"] = _name(d.reset(kind))
            b.settle(0.05)
            lost, rc = b.ensure_configured()
            obs["configuration_lost"] = lost
            if rc:
                return {**obs, "error": f"configure after the reset: {_name(rc)}"}
    obs["f_status"] = pre.status().name
    written = b.chain.hashes(seq, f_tokens, PROMPT)
    dec = b.slot(TaskKind.DECODE)
    words = {}
    for i in reversed(range(CONTINUATION)):
        words[PROMPT + i] = b.probe_word(dec, seq, PROMPT + i,
                                         {"written": written[i], "unwritten": 0})
    obs["f_positions"] = dict(sorted(words.items()))
    obs["prefix_last_word"] = b.probe_word(dec, seq, PROMPT - 1,
                                           {"intact": b.chain.word(seq, PROMPT - 1),
                                            "unwritten": 0})
    seen = set(words.values())
    obs["outcome"] = ("complete" if seen == {"written"} else
                      "untouched" if seen == {"unwritten"} else
                      "partial" if seen == {"written", "unwritten"} else "corrupt")
    for s in (pre, dec):
        s.destroy()
    d.kv_release(seq, 0)
    b.chain.forget(seq)
    return obs


def observe(ctx: RunContext) -> Outcome:
    caps = ctx.driver.capabilities()
    names = ["timeout_then_late_completion",
             *(f"timeout_then_reset_{k.value}" for k in (ResetKind.CCU,
                                                         ResetKind.CONFIGURATION)
               if caps.can_reset(k)),
             "device_exception"]
    runs = [scenario(ctx, n, i) for i, n in enumerate(names)]
    obs: dict[str, Any] = {"scenarios": runs}
    done = [r for r in runs if "error" not in r]
    lines = [f"{r['scenario']}: " + (f"not observed ({r['error']})" if "error" in r else
                                     f"wait {r['wait']}, F {r['f_status']}, its KV "
                                     f"{r['outcome']}, prompt KV {r['prefix_last_word']}")
             for r in runs]
    holds = bool(done) and all(r["outcome"] in ("complete", "untouched")
                               and r["prefix_last_word"] == "intact" for r in done)
    verdict = Verdict(holds, ("all or nothing in every scenario" if holds
                              else "the KV was partly written or the prompt's KV damaged")
                      + " — " + "; ".join(lines))
    # a partial update seen in any scenario is an answer; "never partial" needs them all
    decided = len(done) == len(runs) or (done and not holds)
    return Outcome(obs, {"kv_no_partial_update": verdict} if decided else {},
                   [f"- {x}" for x in lines], complete=len(done) == len(runs))


def main(argv: list[str] | None = None, *, driver: Driver | None = None) -> int:
    return run_runner(NAME, __doc__.splitlines()[0], observe, argv, add_arguments,
                      driver=driver)


if __name__ == "__main__":
    sys.exit(main())
