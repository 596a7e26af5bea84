"""A llama.cpp-style generation loop on calfsm, through ``calfsm.llama``.

It is the shape of llama.cpp's ``simple`` example: decode the prompt as one batch, take
the arg-max of the last token's logits, decode that token, and so on; a non-zero return
code of ``decode`` is handled as llama.cpp documents it. It runs on the default simulated
device (deterministic: the tokens are the reference model's)::

    python examples/llama_loop.py                       # qwen3-b1, 16 tokens
    python examples/llama_loop.py --manifest tiny --tokens 8 --prompt 1,2,3
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from calfsm import DeviceExecutor, ExecutorConfig, SimDriver, builtin_manifest
from calfsm.llama import ABORTED, NO_KV_SLOT, SUCCESS, LlamaBatch, LlamaContext

DEFAULT_PROMPT = (1, 2, 3)


def generate(ctx: LlamaContext, prompt: Sequence[int], n_predict: int) -> list[int]:
    """Greedy tokens after ``prompt``; stops early (with a message) if decode fails."""
    batch = LlamaBatch.get_one(list(prompt))
    out: list[int] = []
    while len(out) < n_predict:
        rc = ctx.decode(batch)
        if rc == NO_KV_SLOT:
            print("no KV slot for the batch: retry smaller or later", file=sys.stderr)
            break
        if rc == ABORTED:
            print("aborted", file=sys.stderr)
            break
        if rc != SUCCESS:
            print(f"decode failed with {rc}", file=sys.stderr)
            break
        token = int(np.argmax(ctx.get_logits_ith(-1)))
        out.append(token)
        if ctx.memory.seq_pos_max(0) + 1 >= ctx.n_ctx:
            break                                        # the context is full
        batch = LlamaBatch.get_one([token])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="qwen3-b1",
                        help="a built-in manifest (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=16,
                        help="tokens to generate (default: %(default)s)")
    parser.add_argument("--prompt", default=",".join(map(str, DEFAULT_PROMPT)),
                        help="comma-separated token ids (default: %(default)s)")
    args = parser.parse_args(argv)
    prompt = [int(t) for t in args.prompt.split(",") if t.strip()]
    manifest = builtin_manifest(args.manifest)
    with DeviceExecutor(SimDriver(manifest, seed=0), manifest, ExecutorConfig()) as ex, \
            LlamaContext(ex) as ctx:
        tokens = generate(ctx, prompt, args.tokens)
    print(f"prompt {prompt}, {len(tokens)} tokens:")
    print(" ".join(map(str, tokens)))
    return 0 if len(tokens) == args.tokens else 1


if __name__ == "__main__":
    sys.exit(main())
