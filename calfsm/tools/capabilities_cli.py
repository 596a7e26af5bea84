"""``calfsm capabilities``: each vendor question, how much is known about it on this
device, the evidence file behind it and its age.

The device and runtime version come from the driver (``--driver``, built like ``calfsm
run`` builds it), or from ``--device`` and ``--runtime-version`` without opening any
device. Exit status 0 when every required capability (``--require``; by default
``parallel_two_in_flight``, the one a calfsm feature is gated on) is proven; 1 when one is
not; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from calfsm.drivers import driver_names, load_driver
from calfsm.drivers.base import Capabilities
from calfsm.errors import CalfsmError, InvalidArgument
from calfsm.manifest import manifest_from_option
from calfsm.plan.buckets import BucketPlan, plan_buckets
from calfsm.plan.capabilities import (
    CAPABILITIES,
    DIR_RULE,
    Capability,
    EvidenceStore,
    Level,
    capability_info,
    device_identity,
    format_age,
)

__all__ = ["DEFAULT_REQUIRED", "EVIDENCE_DIR_HELP", "EXIT_UNPROVEN", "add_parser", "main"]

EXIT_OK = 0
EXIT_UNPROVEN = 1
EXIT_USAGE = 2
#: the capabilities calfsm gates a feature on today (two in flight)
DEFAULT_REQUIRED = ("parallel_two_in_flight",)
#: the help of every ``--evidence-dir`` option: one rule for every command
EVIDENCE_DIR_HELP = f"the vendor runners' evidence files (default: {DIR_RULE})"

_DESCRIPTION = """\
Print each vendor question (spec section 14), how much is known about it on this device
(proven, failed, claimed by the driver, unknown), the evidence file behind it and its
age. The runners of examples/vendor/ write the evidence."""

_EPILOG = """\
exit status:
  0  every required capability is proven on this device
  1  a required capability is not proven (failed, claimed, unknown or stale)
  2  bad usage
"""


def add_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    p = sub.add_parser("capabilities", help="what the vendor runners' evidence proves",
                       description=_DESCRIPTION, epilog=_EPILOG,
                       formatter_class=formatter)
    p.add_argument("--evidence-dir", default=None, metavar="DIR",
                   help=EVIDENCE_DIR_HELP)
    p.add_argument("--driver", default="sim", choices=driver_names(),
                   help="the driver whose device is asked about (its name, library, runtime "
                        "version and declared capabilities)")
    p.add_argument("--manifest", default="qwen3-b1", metavar="NAME|PATH",
                   help="the model the driver is built for")
    p.add_argument("--device", default=None, metavar="ID",
                   help="the device id instead of the driver's (with --runtime-version, no "
                        "device is opened)")
    p.add_argument("--runtime-version", default=None, metavar="V",
                   help="the runtime version instead of the driver's")
    p.add_argument("--calbin-sha256", default=None, metavar="SHA",
                   help="only evidence for this calbin counts (default: any calbin)")
    p.add_argument("--require", action="append", default=None, metavar="NAME",
                   help="a capability that must be proven (repeat; 'all' or 'none'; "
                        f"default: {', '.join(DEFAULT_REQUIRED)})")
    p.add_argument("--max-age-s", type=float, default=None, metavar="S",
                   help="evidence older than this is stale (default: no limit)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _required(names: list[str] | None) -> tuple[str, ...]:
    if names is None:
        return DEFAULT_REQUIRED
    if names == ["none"]:
        return ()
    if "all" in names:
        return tuple(c.name for c in CAPABILITIES)
    for n in names:
        capability_info(n)
    return tuple(dict.fromkeys(names))


def _identity(args: argparse.Namespace
              ) -> tuple[str, str, Capabilities | None, BucketPlan | None]:
    """(device, runtime version, declared capabilities or None, and on a manifest with
    shape buckets what the executor would switch between, and why)."""
    if args.device is not None and args.runtime_version is not None:
        return args.device, args.runtime_version, None, None
    manifest = manifest_from_option(args.manifest)
    driver = load_driver(args.driver, manifest_or_calbin=manifest)
    try:
        plan = plan_buckets(manifest, driver, evidence_dir=args.evidence_dir) \
            if manifest.bucketed else None
        return (args.device or device_identity(driver),
                args.runtime_version or driver.version(), driver.capabilities(), plan)
    finally:
        driver.close()


def _buckets(plan: BucketPlan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    graphs = list(plan.buckets.names) if plan.buckets is not None else []
    return {"switching": plan.buckets is not None, "graphs": graphs,
            "why": plan.proof if plan.buckets is not None else plan.note}


def _row(c: Capability, required: bool) -> dict[str, Any]:
    return {"capability": c.name, "level": c.level.value, "required": required,
            "evidence": str(c.path) if c.path else None, "age_s": c.age_s,
            "reason": c.reason, "question": c.question}


def main(args: argparse.Namespace) -> int:
    """Run ``calfsm capabilities`` with parsed ``args``; the exit status."""
    try:
        required = _required(args.require)
        if args.max_age_s is not None and not args.max_age_s >= 0:
            raise InvalidArgument("--max-age-s must be >= 0", stage="cli")
        device, version, declared, buckets = _identity(args)
    except CalfsmError as e:
        print(f"calfsm: error: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"calfsm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    store = EvidenceStore(args.evidence_dir)
    answers = store.capabilities(device=device, runtime_version=version,
                                 calbin_sha256=args.calbin_sha256, declared=declared,
                                 max_age_s=args.max_age_s)
    unproven = [c.name for c in answers if c.name in required and c.level is not Level.PROVEN]
    if args.json:
        print(json.dumps({"device": device, "runtime_version": version,
                          "evidence_dir": str(store.directory), "required": list(required),
                          "unproven_required": unproven, "problems": store.problems(),
                          "capabilities": [_row(c, c.name in required) for c in answers],
                          "shape_buckets": _buckets(buckets)},
                         indent=1))
    else:
        _print_table(answers, required, device, version, store)
        shown = _buckets(buckets)
        if shown is not None:
            print(f"shape buckets ({args.manifest}): "
                  + (f"switching between {len(shown['graphs'])} graphs: "
                     if shown["switching"] else "") + str(shown["why"]))
    for name in unproven:
        print(f"calfsm: required capability {name} is not proven on {device} runtime "
              f"{version}", file=sys.stderr)
    return EXIT_UNPROVEN if unproven else EXIT_OK


def _print_table(answers: list[Capability], required: tuple[str, ...], device: str,
                 version: str, store: EvidenceStore) -> None:
    from rich.console import Console
    from rich.table import Table

    style = {Level.PROVEN: "green", Level.FAILED: "red", Level.CLAIMED: "yellow",
             Level.UNKNOWN: "dim"}
    table = Table(title=f"vendor capabilities — {device}, runtime {version}, evidence in "
                        f"{store.directory}")
    for col in ("capability", "level", "evidence", "age", "why"):
        table.add_column(col)
    for c in answers:
        mark = " (required)" if c.name in required else ""
        table.add_row(f"{c.name}{mark}\n[dim]{c.question}[/dim]",
                      f"[{style[c.level]}]{c.level.value}[/{style[c.level]}]",
                      c.path.name if c.path else "-", format_age(c.age_s), c.reason)
    console = Console(width=max(Console().width, 140))
    console.print(table)
    for line in store.problems():
        console.print(f"[red]ignored:[/red] {line}")
