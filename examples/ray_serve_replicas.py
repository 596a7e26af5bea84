"""calfsm on Ray Serve: one replica per device, Ray's proxy in front.

    pip install -e ".[ray]"
    ray start --head --resources '{"calculet_npu": 2}'   # as many as the node has devices
    python examples/ray_serve_replicas.py                 # then POST to :8000/v1/completions

Each replica builds its own executor in its own process (here the simulated device in
real time); Ray places at most one per ``calculet_npu`` and replaces a replica whose
``/health`` liveness fails (a hung, failed or broken device).
"""

from __future__ import annotations

import time

from ray import serve

from calfsm import DeviceExecutor, ExecutorConfig, builtin_manifest
from calfsm.serve import ServerConfig, ray_deployment, realtime_sim


def build() -> DeviceExecutor:
    manifest = builtin_manifest("qwen3-b1")
    return DeviceExecutor(realtime_sim(manifest), manifest, ExecutorConfig(
        max_waiting=64, max_sequences=64, hang_after_s=5.0))


if __name__ == "__main__":
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(ray_deployment(build, num_replicas=2, config=ServerConfig(shutdown_grace_s=5.0)),
              name="calfsm", route_prefix="/")
    print("serving on http://127.0.0.1:8000 (Ctrl-C stops)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
