"""What the executor tells operators: Prometheus metrics, traces, the dump sink, goodput
and the decode steps the device ran."""
