"""What the executor tells operators: Prometheus metrics and the dump sink."""
