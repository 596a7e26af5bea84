"""calfsm on Ray Serve: one replica per device, Ray's proxy in front.

    pip install -e ".[ray]"
    ray start --head --resources '{"calculet_npu": 2}'   # as many as the node has devices
    python examples/ray_serve_replicas.py                 # then POST to :8000/v1/completions
    python examples/ray_serve_replicas.py --routed        # each prompt to the replica whose
                                                          # prompt cache holds its prefix

Each replica builds its own executor in its own process (here the simulated device in
real time, its prompt cache on); Ray places at most one per ``calculet_npu`` and replaces
a replica whose ``/health`` liveness fails (a hung, failed or broken device). With
``--routed`` a front deployment keys each request by its prompt and Ray routes it with
calfsm's prompt-cache router (docs/serving.md, Scale-out).
"""

from __future__ import annotations

import sys
import time

from ray import serve

from calfsm import DeviceExecutor, ExecutorConfig, builtin_manifest
from calfsm.generate.promptcache import PromptCacheConfig
from calfsm.serve import ServerConfig, ray_deployment, realtime_sim, routed_deployment


def build() -> DeviceExecutor:
    manifest = builtin_manifest("qwen3-b1")
    return DeviceExecutor(realtime_sim(manifest), manifest, ExecutorConfig(
        max_waiting=64, max_sequences=64, hang_after_s=5.0,
        prompt_cache=PromptCacheConfig(max_sequences=32, max_tokens=32 * 2048)))


if __name__ == "__main__":
    config = ServerConfig(shutdown_grace_s=5.0)
    if "--routed" in sys.argv[1:]:
        app = routed_deployment(build, num_replicas=2, config=config)
    else:
        app = ray_deployment(build, num_replicas=2, config=config)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(app, name="calfsm", route_prefix="/")
    print("serving on http://127.0.0.1:8000 (Ctrl-C stops)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
