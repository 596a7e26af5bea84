"""The generation API: sequences, streams and their flows, sampling, logits processors,
logprobs, stop strings, tokenizers, the prompt cache and the live request table.

Built on the engine's public face; the engine never imports it."""
