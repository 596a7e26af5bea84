"""Running the vendor runners and reading their evidence, as an integrator would.

It runs every runner of ``examples/vendor/`` against one driver (``--driver sim`` by
default; ``--driver calrt`` with ``CALFSM_CALRT_LIB`` naming a vendor shim asks a real
device), each writing its evidence into ``--out`` (by default the directory every calfsm
command reads), then asks
:class:`calfsm.plan.capabilities.EvidenceStore` what is proven on this device — the same
answer the executor and ``calfsm capabilities --evidence-dir OUT`` give — and prints
whether two jobs in flight, continuous batching and switching between shape buckets may be
enabled.

Exit status 0 when every runner made all its observations (whatever they found).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from calfsm.drivers import load_driver
from calfsm.manifest import builtin_manifest
from calfsm.plan.capabilities import DIR_RULE, EvidenceStore, Level, device_identity, evidence_dir

RUNNERS = ("parallel_mode", "overlap", "cancel_after_timeout", "kv_after_failed_wait",
           "reset_semantics", "batch_semantics", "step_costs")
#: the batch runner asks a batch calbin: the batch form of the manifest the others use
BATCH_FORM = {"tiny": "tiny-b8", "qwen3-b1": "qwen3-b8"}
#: the step-cost runner asks a calbin with shape buckets: the bucket form of the manifest
BUCKET_FORM = {"tiny": "tiny-buckets", "qwen3-b1": "qwen3-buckets"}
VENDOR = Path(__file__).resolve().parent / "vendor"


def run_one(name: str, argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location(f"vendor_{name}", VENDOR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--driver", default="sim")
    p.add_argument("--manifest", default="tiny")
    p.add_argument("--out", default=None, help=f"the evidence directory (default: {DIR_RULE})")
    p.add_argument("--latency", default="virtual:transfer_share=0.3",
                   help="the simulated devices' latency (a real device has its own)")
    args = p.parse_args(argv)
    out = evidence_dir(args.out)
    common = ["--driver", args.driver, "--manifest", args.manifest, "--out", str(out),
              "--latency", args.latency]
    batch = [BATCH_FORM.get(args.manifest, args.manifest) if a == args.manifest else a
             for a in common]
    buckets = [BUCKET_FORM.get(args.manifest, args.manifest) if a == args.manifest else a
               for a in common]
    forms = {"batch_semantics": batch, "step_costs": buckets}
    codes = {name: run_one(name, forms.get(name, common)) for name in RUNNERS}
    with load_driver(args.driver, manifest_or_calbin=builtin_manifest(args.manifest)) as d:
        device, version, declared = device_identity(d), d.version(), d.capabilities()
    store = EvidenceStore(out)
    print(f"\n{device}, runtime {version}:")
    for c in store.capabilities(device=device, runtime_version=version, declared=declared):
        print(f"  {c.name:28} {c.level.value:8} {c.path.name if c.path else '-'}")
    two = store.capability("parallel_two_in_flight", device=device, runtime_version=version)
    print(f"two in flight: {'may be enabled' if two.level is Level.PROVEN else 'stays off'}"
          f" ({two.reason[:80]}...)")
    rows = store.capability("batch_rows_independent", device=device, runtime_version=version)
    print(f"continuous batching: {'may be enabled' if rows.level is Level.PROVEN else 'stays off'}"
          f" ({rows.reason[:80]}...)")
    moves = [store.capability(c, device=device, runtime_version=version)
             for c in ("graph_step_costs", "graph_kv_continuity")]
    print(f"shape buckets: {'may switch graphs' if all(c.proven for c in moves) else 'one graph'}"
          f" ({moves[1].reason[:80]}...)")
    return 0 if all(rc == 0 for rc in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
