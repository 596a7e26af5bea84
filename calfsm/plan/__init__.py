"""Start-up decisions taken from vendor evidence: capabilities, jobs in flight, batching."""
