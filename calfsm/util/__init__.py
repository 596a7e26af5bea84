"""Small helpers every layer may use: bounded file reading, lazy imports, rate-limited logs."""
