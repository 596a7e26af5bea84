"""What every vendor runner shares: options, the driver, raw jobs, and the evidence files.

Theory of operation
-------------------
A vendor runner (``examples/vendor/*.py``) asks a device one question of spec section 14
and writes what it saw. Each is a short script over this module:

- :func:`runner_parser` gives the common options (``--driver``, ``--manifest``,
  ``--latency``, ``--seed``, ``--out``, ``--device-id``, ``--timeout-s``);
  :func:`open_driver` builds the driver from the registry like ``calfsm run`` does — the
  simulated device by default, ``--driver calrt`` with ``$CALFSM_CALRT_LIB`` naming a
  vendor shim (else the native emulator). A latency spec applies only where a driver
  models time (the simulated device and the emulator); a real device has its own.
- :class:`Bench` configures the device and hands out :class:`Slot` s: one model's
  buffers with host arrays mapped once, on an engine (AUTO, PING or PONG). A slot runs
  raw protocol calls and returns their CalRT codes; the runner *records* codes, it does
  not raise on them — an unexpected code is an observation. :class:`Chain` keeps the
  reference model's KV words of each sequence on the host, so every output can be
  compared bit for bit with what the reference model says it must be
  (``docs/reference-model.md``), and a KV word can be probed (:meth:`Bench.probe_word`).
- :func:`golden` runs a few fixed prompts through :class:`~calfsm.tools.direct.DirectRunner`
  and compares the greedy tokens with the reference model: "the golden after a reset".
- :func:`run_runner` is a runner's ``main``: parse, build, observe, decide, and write the
  evidence JSON (:class:`~calfsm.plan.capabilities.Evidence`) and a short Markdown summary
  into ``--out`` (by default the evidence directory every calfsm command reads:
  :func:`~calfsm.plan.capabilities.evidence_dir`). Exit status 0 when every observation was
  made (whatever the answers are), 1 when some could not be (the evidence says which and
  stays incomplete), 2 on bad usage.

Nothing sleeps to order events: on a virtual clock time moves only through ``wait``
and :meth:`Bench.settle` (which lets the finish time of a job go by, to see whether it
writes anything late); in real time every wait on the device is bounded.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from calfsm.clock import RealClock
from calfsm.drivers import Driver, driver_class, driver_names, refmodel
from calfsm.drivers.base import Calbin, EngineSlot, JobTag, OutputStatus
from calfsm.drivers.sim import LatencyModel
from calfsm.errors import CalfsmError, InvalidArgument, code_name
from calfsm.manifest import (
    GraphKey,
    Manifest,
    SubmodelContract,
    TaskKind,
    manifest_from_option,
)
from calfsm.plan.capabilities import (
    DIR_RULE,
    Evidence,
    Verdict,
    capability_info,
    device_identity,
    evidence_dir,
)
from calfsm.tools.direct import DirectRunner, golden_prompts

__all__ = ["EXIT_INCOMPLETE", "EXIT_OK", "EXIT_USAGE", "Bench", "Chain", "Outcome",
           "RunContext", "Slot", "golden", "open_driver", "parse_latency", "run_runner",
           "runner_parser", "write_evidence"]

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_USAGE = 2

_DEFAULT_LATENCY = "virtual"


def parse_latency(spec: str) -> tuple[bool, LatencyModel]:
    """``virtual|real[:decode_ms=N,prefill_token_us=N,transfer_share=S]`` -> (real time?,
    the latency model). The base is the simulated device's plausible figures (16 GB/s
    DMA, 0.2 ms per prefill token, 10 ms per decode) on a static calbin
    (``shape_cost=graph`` unless ``shape_cost=rows``); ``transfer_share`` (in [0, 1))
    re-divides each job's time so that this share of it is transfers, half H2D and half
    D2H, its total unchanged (:class:`~calfsm.drivers.sim.LatencyModel`)."""
    kind, _, args = spec.partition(":")
    if kind not in ("virtual", "real"):
        raise InvalidArgument(f"--latency {spec}: must be 'virtual' or 'real', optionally "
                              "followed by :decode_ms=N,prefill_token_us=N,transfer_share=S",
                              stage="runner")
    try:
        model = attrs.evolve(LatencyModel.virtual_default(),
                             shape_cost="graph").with_params(args, stage="runner")
    except InvalidArgument as e:
        raise InvalidArgument(f"--latency: {e.message}", stage="runner") from None
    return kind == "real", model




def runner_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The options every runner has; a runner adds its own."""
    p = argparse.ArgumentParser(prog=f"{name}.py", description=description)
    p.add_argument("--driver", default="sim", choices=driver_names(),
                   help="a registered driver: sim (simulated, default) or calrt (the C ABI; "
                        "$CALFSM_CALRT_LIB names a vendor shim, else the native emulator)")
    p.add_argument("--manifest", default="qwen3-b1", metavar="NAME|PATH",
                   help="the model: a built-in name or a manifest file (default qwen3-b1)")
    p.add_argument("--latency", default=_DEFAULT_LATENCY,
                   metavar="virtual|real[:decode_ms=N,prefill_token_us=N,transfer_share=S]",
                   help="virtual: the device on a virtual clock (nothing sleeps); real: the "
                        "wall clock. The parameters set the simulated device's and the "
                        "emulator's latency; a vendor device keeps its own (and its real "
                        "clock). Default: virtual, 10 ms decode, 0.2 ms per prefill token, "
                        "16 GB/s DMA")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="the driver seed")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory for the evidence JSON and Markdown (default: "
                        f"{DIR_RULE}: where calfsm capabilities and the executor look)")
    p.add_argument("--device-id", default=None, metavar="ID",
                   help="the device name recorded in the evidence (default: the driver "
                        "name, and the library file name for calrt)")
    p.add_argument("--timeout-s", type=float, default=30.0, metavar="S",
                   help="the longest any one wait may take (default 30 s)")
    return p


def open_driver(name: str, manifest: Manifest, latency: str, seed: int) -> Driver:
    """The driver registered as ``name`` for ``manifest``: on a virtual clock unless the
    latency spec says ``real`` (or the driver drives a real device)."""
    real, model = parse_latency(latency)
    cls: Any = driver_class(name)
    kw: dict[str, Any] = {"manifest_or_calbin": manifest, "seed": seed, "latency": model}
    if real:
        return cls(clock=RealClock(), **kw)
    return getattr(cls, "virtual", cls)(**kw)


# ---------------------------------------------------------------------------------------
# the reference model on the host


class Chain:
    """The KV words the reference model says each sequence holds (host side)."""

    def __init__(self) -> None:
        self.words: dict[int, list[int]] = {}

    def word(self, seq: int, pos: int) -> int:
        """The word at ``pos`` (``H_INIT`` before position 0, 0 where never written)."""
        if pos < 0:
            return refmodel.H_INIT
        w = self.words.get(seq, [])
        return w[pos] if pos < len(w) else 0

    def hashes(self, seq: int, tokens: Sequence[int], start: int) -> list[int]:
        """The hashes ``tokens`` at ``start...`` would give, without recording them."""
        h, out = self.word(seq, start - 1), []
        for i, t in enumerate(tokens):
            h = refmodel.step(h, int(t), start + i)
            out.append(h)
        return out

    def record(self, seq: int, tokens: Sequence[int], start: int) -> list[int]:
        """Record that ``tokens`` ran at ``start...`` on ``seq``; their hashes."""
        hs = self.hashes(seq, tokens, start)
        w = self.words.setdefault(seq, [])
        if len(w) < start + len(hs):
            w.extend([0] * (start + len(hs) - len(w)))
        w[start:start + len(hs)] = hs
        return hs

    def forget(self, seq: int, keep: int = 0) -> None:
        if seq in self.words:
            del self.words[seq][keep:]


@attrs.define
class Slot:
    """One model's buffers on one engine, host arrays mapped once."""

    bench: Bench
    kind: TaskKind
    engine: EngineSlot
    model: Any
    inp: Any
    out: Any
    tok: np.ndarray
    pos: np.ndarray
    logits: np.ndarray
    tok_name: str
    pos_name: str
    csrs: tuple[str, str]
    vocab: int
    rows: int
    last_n: int = 0

    def program(self, seq: int, tokens: Sequence[int], start: int, *,
                cur: int | None = None, total: int | None = None) -> tuple[str, int]:
        """Write ``tokens`` at positions ``start...``, slice, set CSRs and the sequence,
        grow the KV. ``("", 0)`` or the first call that failed and its code."""
        d = self.bench.driver
        n = len(tokens)
        self.tok[:n] = tokens
        self.pos[:n] = np.arange(start, start + n)
        self.last_n = n
        calls: list[tuple[str, Callable[[], int]]] = []
        if self.kind is not TaskKind.DECODE:
            calls += [("slice_tensor", lambda: d.slice_tensor(self.inp, self.tok_name, 0, 4 * n)),
                      ("slice_tensor", lambda: d.slice_tensor(self.inp, self.pos_name, 0, 4 * n))]
        calls += [("set_csr", lambda: d.set_csr(self.inp, self.csrs[0], n if cur is None else cur)),
                  ("set_csr", lambda: d.set_csr(self.inp, self.csrs[1],
                                                start + n if total is None else total)),
                  ("set_kv_seq", lambda: d.set_kv_seq(self.inp, seq)),
                  ("kv_apply", lambda: 0 if d.kv_apply(seq, start + n) else 1)]
        for call, fn in calls:
            rc = int(fn())
            if rc:
                return call, rc
        return "", 0

    def submit(self, tag: JobTag | None = None) -> int:
        """``infer_fixed`` on the slot's engine, or ``infer`` for AUTO."""
        d = self.bench.driver
        if self.engine is EngineSlot.AUTO:
            return int(d.infer(self.model, self.inp, self.out, tag=tag))
        return int(d.infer_fixed(self.model, self.inp, self.out, self.engine, tag=tag))

    def wait(self, timeout_s: float | None = None) -> int:
        t = self.bench.timeout_s if timeout_s is None else timeout_s
        return int(self.bench.driver.wait(self.out, t))

    def status(self) -> OutputStatus:
        return OutputStatus(self.bench.driver.status(self.out))

    def row(self) -> np.ndarray:
        """The BF16 logits row of the last token of the last job programmed."""
        return self.logits.reshape(self.rows, self.vocab)[
            refmodel.tile_row(max(self.last_n, 1), self.rows)]

    def matches(self, h: int) -> bool:
        """The output row is the reference model's logits of hash ``h``."""
        return bool(np.array_equal(self.row(), refmodel.logits_bf16(h, self.vocab)))

    def fill(self, value: int = 0xA5A5) -> None:
        """A sentinel in the output array, to see whether the device writes it."""
        self.logits[...] = value

    def filled(self, value: int = 0xA5A5) -> bool:
        return bool(np.all(self.logits == value))

    def destroy(self) -> int:
        return int(self.bench.driver.destroy_buffers(self.inp, self.out))


class Bench:
    """A configured device and its models, for raw jobs; see the module docstring."""

    def __init__(self, driver: Driver, manifest: Manifest, *, timeout_s: float = 30.0
                 ) -> None:
        self.driver = driver
        self.manifest = manifest
        self.timeout_s = float(timeout_s)
        self.calbin = Calbin.from_manifest(manifest)
        self.chain = Chain()
        self.models: dict[TaskKind, Any] = {}
        #: every graph's handle by its key (shape buckets; the widest are ``models``)
        self.graph_models: dict[GraphKey, Any] = {}

    def configure(self) -> int:
        """Configure the calbin and look the models up; the CalRT code."""
        d = self.driver
        rc = int(d.configure(self.calbin))
        if rc:
            return rc
        rc, models = d.get_all_models()
        if rc:
            return int(rc)
        resolved = self.manifest.resolve(models or ())
        self.models = {}
        for kind in (TaskKind.PREFILL_IDS, TaskKind.DECODE):
            rc, handle = d.model(resolved[kind].name)
            if rc:
                return int(rc)
            self.models[kind] = handle
        self.graph_models = {}
        for sub in self.manifest.submodels:
            rc, handle = d.model(sub.exact_name)
            if rc:
                return int(rc)
            self.graph_models[sub.key] = handle
        return 0

    def ensure_configured(self) -> tuple[bool, int]:
        """(whether the device had lost its configuration, the code of configuring it
        again): after a configuration or full reset the models and buffers are stale."""
        rc, _models = self.driver.get_all_models()
        if rc == 0:
            return False, 0
        return True, self.configure()

    def settle(self, seconds: float) -> None:
        """Let device time pass (virtual clock: advanced; real: slept), bounded."""
        self.driver.clock.sleep(min(max(seconds, 0.01), 5.0))

    def slot(self, kind: TaskKind, engine: EngineSlot = EngineSlot.AUTO,
             graph: SubmodelContract | None = None) -> Slot:
        """New buffers for ``kind`` on ``engine`` (of ``graph``, one of its shape buckets;
        None: the kind's widest graph), every tensor mapped; raises the classified error
        if the device refuses (a runner cannot go on without them)."""
        from calfsm.errors import check
        d = self.driver
        sub = self.manifest.submodel(kind) if graph is None else graph
        model = self.models[kind] if graph is None else self.graph_models[graph.key]
        rc, bufs = d.create_buffers(model, engine)
        check(rc, "create_buffers")
        inp, out = bufs  # type: ignore[misc]
        tok = np.zeros(sub.token_or_embed.shape, sub.token_or_embed.dtype.host_dtype)
        pos = np.zeros(sub.position.shape, sub.position.dtype.host_dtype)
        logits = np.zeros(sub.logits.shape, sub.logits.dtype.host_dtype)
        check(d.map_buffer(inp, sub.token_or_embed.name, tok), "map_buffer")
        check(d.map_buffer(inp, sub.position.name, pos), "map_buffer")
        check(d.map_buffer(out, sub.logits.name, logits), "map_buffer")
        return Slot(self, kind, EngineSlot(engine), model, inp, out,
                    tok.reshape(-1), pos.reshape(-1), logits.reshape(-1),
                    sub.token_or_embed.name, sub.position.name,
                    (sub.csr_cur_seq, sub.csr_total_seq), sub.vocab, sub.rows)

    def run(self, slot: Slot, seq: int, tokens: Sequence[int], start: int) -> dict[str, Any]:
        """One whole job: program, submit, wait, status, compare with the reference model;
        the chain records it when it ended DONE_OK with the right output."""
        obs: dict[str, Any] = {"seq": seq, "start": start, "tokens": len(tokens)}
        call, rc = slot.program(seq, tokens, start)
        if rc == 0:
            call, rc = "infer", slot.submit()
        if rc == 0:
            call, rc = "wait", slot.wait()
        obs["code"] = code_name(rc) if rc else "SUCCESS"
        if rc:
            obs["failed_call"] = call
            return obs
        status = slot.status()
        obs["status"] = status.name
        want = self.chain.hashes(seq, tokens, start)[-1]
        obs["correct"] = status is OutputStatus.DONE_OK and slot.matches(want)
        if obs["correct"]:
            self.chain.record(seq, tokens, start)
        return obs

    def prompt(self, seq: int, n: int, offset: int = 0) -> list[int]:
        """A deterministic prompt of ``n`` tokens for ``seq``."""
        vocab = self.manifest.submodel(TaskKind.DECODE).vocab
        return [(seq * 7919 + offset * 104729 + i * 31 + 1) % vocab for i in range(n)]

    def probe_word(self, dec: Slot, seq: int, pos: int, candidates: dict[str, int]
                   ) -> str:
        """Which candidate the KV word of ``seq`` at ``pos`` is, read by a decode at
        ``pos + 1`` (which writes position ``pos + 1``: probe from the top down). The
        name of the matching candidate, ``"other"``, or the failing code/status."""
        token = 1
        call, rc = dec.program(seq, [token], pos + 1)
        if rc == 0:
            call, rc = "infer", dec.submit()
        if rc == 0:
            call, rc = "wait", dec.wait()
        if rc:
            return f"{call}: {code_name(rc)}"
        status = dec.status()
        if status is not OutputStatus.DONE_OK:
            return f"status {status.name}"
        for name, word in candidates.items():
            if dec.matches(refmodel.step(word, token, pos + 1)):
                return name
        return "other"


def golden(driver: Driver, manifest: Manifest, *, prompts: int = 3, tokens: int = 4,
           seq_base: int = 900, timeout_s: float = 30.0) -> dict[str, Any]:
    """A few fixed prompts through the direct path (the device must be configured),
    compared token for token with the reference model: ``{"passed": bool, ...}``."""
    decode = manifest.submodel(TaskKind.DECODE)
    runner = None
    try:
        runner = DirectRunner(driver, manifest, timeout_s=timeout_s, configure=False)
        for i, prompt in enumerate(golden_prompts(prompts, vocab=decode.vocab, max_len=64)):
            got = runner.generate(seq_base + i, prompt, tokens)
            want = _reference_tokens(prompt, tokens, decode.vocab)
            if got != want:
                return {"passed": False, "prompt": i, "got": got, "want": want}
        return {"passed": True, "prompts": prompts, "tokens": tokens}
    except CalfsmError as e:
        return {"passed": False, "error": str(e)}
    finally:
        if runner is not None:
            runner.close()


def _reference_tokens(prompt: Sequence[int], n: int, vocab: int) -> list[int]:
    h = refmodel.H_INIT
    for p, t in enumerate(prompt):
        h = refmodel.step(h, t, p)
    out, pos = [], len(prompt)
    while len(out) < n:
        tok = refmodel.greedy(refmodel.logits_bf16(h, vocab))
        out.append(tok)
        h = refmodel.step(h, tok, pos)
        pos += 1
    return out


# ---------------------------------------------------------------------------------------
# running a runner and writing its evidence


@attrs.define
class RunContext:
    """What a runner's ``observe`` gets: the parsed options, the driver, a :class:`Bench`
    for it, and the output directory (for extra files such as a trace)."""

    args: argparse.Namespace
    driver: Driver
    manifest: Manifest
    bench: Bench
    out: Path
    stem: str
    files: dict[str, str] = attrs.Factory(dict)

    def add_file(self, label: str, path: Path) -> None:
        """Name an extra file the runner wrote (recorded in the evidence)."""
        self.files[label] = path.name


@attrs.frozen
class Outcome:
    """What ``observe`` returns: the raw observations, a verdict per capability it could
    decide, the Markdown lines of its summary, and whether every observation was made."""

    observations: dict[str, Any]
    verdicts: dict[str, Verdict]
    summary: list[str] = attrs.Factory(list)
    complete: bool = True


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "device"


def write_evidence(out: Path, stem: str, evidence: Evidence, summary: Sequence[str]
                   ) -> tuple[Path, Path]:
    """``<stem>.json`` (the evidence) and ``<stem>.md`` (its summary) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{stem}.json"
    json_path.write_text(evidence.to_json() + "\n", "utf-8")
    md = [f"# {evidence.runner}: {evidence.device}, runtime {evidence.runtime_version}", "",
          f"- created: {evidence.to_dict()['created_at']}",
          f"- driver: {evidence.driver}; calbin sha256: `{evidence.calbin_sha256}`",
          f"- settings: {', '.join(f'{k}={v}' for k, v in evidence.settings.items())}",
          f"- complete: {'yes' if evidence.complete else 'no, see the observations'}",
          f"- evidence: `{json_path.name}`"
          + "".join(f", {k}: `{v}`" for k, v in evidence.files.items()), "",
          "| capability | holds | why |", "| --- | --- | --- |"]
    for name, v in evidence.verdicts.items():
        md.append(f"| `{name}` | {'yes' if v.holds else 'no'} | {v.reason} |")
    md += ["", *summary, ""]
    md_path = out / f"{stem}.md"
    md_path.write_text("\n".join(md), "utf-8")
    return json_path, md_path


def run_runner(name: str, description: str, observe: Callable[[RunContext], Outcome],
               argv: Sequence[str] | None = None,
               add_arguments: Callable[[argparse.ArgumentParser], None] | None = None, *,
               driver: Driver | None = None, per_calbin: bool = False) -> int:
    """A runner's ``main``: options, driver, ``observe``, evidence. Returns the exit
    status (see the module docstring). ``driver``: ask this driver (unconfigured; it is
    closed at the end) instead of building one from ``--driver`` and ``--latency`` —
    for a device that needs options the command line does not have. ``per_calbin``: the
    evidence is about the calbin too (the step costs), so its file names the manifest
    (one file per calbin on one device, none replacing another's)."""
    parser = runner_parser(name, description)
    if add_arguments is not None:
        add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        if not (args.timeout_s > 0 and math.isfinite(args.timeout_s)):
            raise InvalidArgument("--timeout-s must be a finite number > 0", stage="runner")
        manifest = manifest_from_option(args.manifest, stage="runner")
        if driver is None:
            driver = open_driver(args.driver, manifest, args.latency, args.seed)
        else:
            args.driver, args.latency = str(driver.name), "the given driver's own"
    except CalfsmError as e:
        print(f"{name}: error: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    out = evidence_dir(args.out)
    try:
        device = args.device_id or device_identity(driver)
        version = driver.version()
        calbin = f"-{_slug(manifest.name or manifest.calbin_sha256[:12])}" if per_calbin \
            else ""
        stem = f"{name}-{_slug(device)}{calbin}-{_slug(version)}"
        bench = Bench(driver, manifest, timeout_s=args.timeout_s)
        ctx = RunContext(args, driver, manifest, bench, out, stem)
        clock = "virtual" if getattr(driver.clock, "virtual", False) else "real"
        try:
            rc = bench.configure()
            if rc:
                outcome = Outcome({"configure": code_name(rc)}, {}, complete=False)
            else:
                outcome = observe(ctx)
        except CalfsmError as e:
            outcome = Outcome({"error": str(e)}, {}, complete=False)
    finally:
        driver.close()
    for cap in outcome.verdicts:
        capability_info(cap)            # a runner may only answer known capabilities
    evidence = Evidence(
        runner=name, device=device, runtime_version=version,
        calbin_sha256=bench.calbin.sha256, created_unix=time.time(),
        observations=outcome.observations, verdicts=dict(outcome.verdicts),
        complete=outcome.complete, driver=args.driver,
        settings={"manifest": args.manifest, "latency": args.latency, "clock": clock,
                  "seed": args.seed, "timeout_s": args.timeout_s,
                  **{k: v for k, v in vars(args).items()
                     if k not in ("driver", "manifest", "latency", "seed", "out",
                                  "device_id", "timeout_s")}},
        files=ctx.files)
    json_path, md_path = write_evidence(out, stem, evidence, outcome.summary)
    for cap, v in outcome.verdicts.items():
        print(f"{cap}: {'holds' if v.holds else 'does not hold'} — {v.reason}")
    if not outcome.complete:
        print(f"{name}: incomplete: some observations could not be made "
              f"(see {json_path})", file=sys.stderr)
    print(f"evidence: {json_path}\nsummary: {md_path}")
    return EXIT_OK if outcome.complete else EXIT_INCOMPLETE
