"""The direct path: one job at a time, straight through a driver, every code checked.

Theory of operation
-------------------
:class:`DirectRunner` is the baseline the executor is measured and golden-checked
against. It configures the driver, resolves the manifest against the device's model list
(exact names only), creates one buffer set per sub-model kind with host arrays mapped
once, and then runs prefill and decode jobs synchronously: write the inputs, slice, set
the CSRs and the KV sequence, ``kv_apply``, ``infer``, ``wait``, ``status``,
``output_bytes``, read the row. Every return code goes through
:func:`calfsm.errors.check` (or :func:`~calfsm.errors.from_calrt`) with the stage name of
the call, so a failure raises the classified :class:`~calfsm.errors.CalfsmError`.

Nothing is allocated per job except the float32 row handed back (``out=`` avoids even
that); :meth:`DirectRunner.generate` picks greedy tokens straight from the BF16 bits.

:mod:`calfsm.engine.readback` judges each output, as it does for the executor and the warm-up.

:func:`golden_prompts` is the fixed set of 100 prompts the acceptance golden uses (the
executor's golden reuses it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from calfsm.drivers import refmodel
from calfsm.drivers.base import Calbin, Driver
from calfsm.engine.readback import check_ending, check_output, read_output
from calfsm.errors import Internal, InvalidArgument, ResourceExhausted, check
from calfsm.manifest import Manifest, TaskKind
from calfsm.util.lazy import bf16_dtype

__all__ = ["GOLDEN_SEED", "DirectRunner", "golden_prompts"]

#: the seed of :func:`golden_prompts`; changing it changes every golden
GOLDEN_SEED = 20240613


class DirectSet:
    """One sub-model's handle, buffers and mapped host arrays."""

    __slots__ = ("bf16", "contract", "cur", "handle", "inp", "kind", "logits", "max_tokens",
                 "out", "out_name", "out_size", "pos", "pos_name", "reading", "rows", "tok",
                 "tok_name", "total", "vocab")


class DirectRunner:
    """Synchronous prefill/decode through ``driver`` for ``manifest``.

    ``configure=False`` skips ``driver.configure`` (for a driver configured already).
    """

    def __init__(self, driver: Driver, manifest: Manifest, *, timeout_s: float = 60.0,
                 configure: bool = True) -> None:
        self.driver = driver
        self.manifest = manifest
        self.timeout_s = float(timeout_s)
        if configure:
            check(driver.configure(Calbin.from_manifest(manifest)), "configure")
        code, models = driver.get_all_models()
        check(code, "get_all_models")
        resolved = manifest.resolve(models or ())
        self.sets: dict[TaskKind, DirectSet] = {}
        for kind in (TaskKind.PREFILL_IDS, TaskKind.DECODE):
            sub = manifest.submodel(kind)       # the widest, of shape buckets
            s = DirectSet()
            s.kind = sub.kind
            s.contract = sub
            code, s.handle = driver.model(resolved[sub.kind].name)
            check(code, "model")
            code, bufs = driver.create_buffers(s.handle)
            check(code, "create_buffers")
            s.inp, s.out = bufs  # type: ignore[misc]
            tok, pos, lg = sub.token_or_embed, sub.position, sub.logits
            s.tok = np.zeros(tok.shape, tok.dtype.host_dtype)
            s.pos = np.zeros(pos.shape, pos.dtype.host_dtype)
            s.logits = np.zeros(lg.shape, lg.dtype.host_dtype)
            s.tok_name, s.pos_name, s.out_name = tok.name, pos.name, lg.name
            s.out_size = lg.byte_size
            check(driver.map_buffer(s.inp, tok.name, s.tok), "map_buffer")
            check(driver.map_buffer(s.inp, pos.name, s.pos), "map_buffer")
            check(driver.map_buffer(s.out, lg.name, s.logits), "map_buffer")
            s.tok = s.tok.reshape(-1)
            s.pos = s.pos.reshape(-1)
            s.cur, s.total = sub.csr_cur_seq, sub.csr_total_seq
            s.rows = sub.rows
            s.vocab = sub.vocab
            s.max_tokens = sub.max_tokens
            s.bf16 = s.logits.reshape(-1).view(bf16_dtype())
            s.logits = s.logits.reshape(-1, s.vocab)[:s.rows]   # row 0 of a batch graph
            self.sets[sub.kind] = s
        if TaskKind.DECODE not in self.sets or TaskKind.PREFILL_IDS not in self.sets:
            raise InvalidArgument("the direct path needs a prefill_ids and a decode "
                                  "sub-model", stage="resolve")
        self.vocab = self.sets[TaskKind.DECODE].vocab

    # ---- one job ----------------------------------------------------------------------
    def _run(self, s: DirectSet, seq_id: int, n: int, total: int) -> None:
        self.program(s, seq_id, n, total)
        check(self.driver.infer(s.handle, s.inp, s.out), "infer", seq_id=seq_id)
        self.collect(s, seq_id)

    def program(self, s: DirectSet, seq_id: int, n: int, total: int) -> None:
        """Everything before ``infer``: KV room, both CSRs and the KV sequence."""
        d = self.driver
        ctx = {"seq_id": seq_id}
        if not d.kv_apply(seq_id, total):
            raise ResourceExhausted(f"KV apply of sequence {seq_id} to {total} positions "
                                    "refused", stage="kv_apply", **ctx)
        check(d.set_csr(s.inp, s.cur, n), "set_csr", **ctx)
        check(d.set_csr(s.inp, s.total, total), "set_csr", **ctx)
        check(d.set_kv_seq(s.inp, seq_id), "set_kv_seq", **ctx)

    def collect(self, s: DirectSet, seq_id: int) -> None:
        """Everything after ``infer``: wait, then status and the output's byte count,
        judged as the executor judges them (:mod:`calfsm.engine.readback`)."""
        ctx = {"seq_id": seq_id}
        check(self.driver.wait(s.out, self.timeout_s), "wait", **ctx)
        s.reading = reading = read_output(self.driver, s.out, s.contract)
        check_ending(reading, ctx)
        if reading[2] != s.out_size:            # the BF16 rows are read directly
            raise Internal(f"device produced {reading[2]} bytes of {s.out_name!r}, "
                           f"expected {s.out_size}", stage="output", **ctx)

    def _f32(self, s: DirectSet, seq_id: int, n: int, out: np.ndarray | None) -> np.ndarray:
        """The float32 logits of the last token: bounds-, size- and finite-checked."""
        return check_output(s.reading, s.bf16, s.contract, n, out, {"seq_id": seq_id})

    def prefill_bf16(self, seq_id: int, tokens: Sequence[int], past_len: int = 0
                     ) -> np.ndarray:
        """Run a prefill; the BF16 row of the last token (a view of the mapped output,
        valid until the next prefill)."""
        s = self.sets[TaskKind.PREFILL_IDS]
        n = len(tokens)
        if n < 1 or n > s.max_tokens or past_len < 0:
            raise InvalidArgument(f"prefill of {n} tokens after {past_len} (at most "
                                  f"{s.max_tokens})", stage="validate", seq_id=seq_id)
        s.tok[:n] = tokens
        s.pos[:n] = np.arange(past_len, past_len + n, dtype=np.int32)
        d = self.driver
        if not s.contract.batched:      # a batch graph's row 0 reads its own prefix
            check(d.slice_tensor(s.inp, s.tok_name, 0, 4 * n), "slice_tensor",
                  seq_id=seq_id)
            check(d.slice_tensor(s.inp, s.pos_name, 0, 4 * n), "slice_tensor",
                  seq_id=seq_id)
        self._run(s, seq_id, n, past_len + n)
        return s.logits[refmodel.tile_row(n, s.rows)]

    def decode_bf16(self, seq_id: int, token: int, pos: int) -> np.ndarray:
        """Run one decode step; the BF16 row (a view of the mapped output)."""
        s = self.sets[TaskKind.DECODE]
        s.tok[0] = token
        s.pos[0] = pos
        self._run(s, seq_id, 1, pos + 1)
        return s.logits[0]

    def prefill(self, seq_id: int, tokens: Sequence[int], past_len: int = 0, *,
                out: np.ndarray | None = None) -> np.ndarray:
        """Prefill ``tokens`` at positions ``past_len...``; the last token's logits (float32)."""
        self.prefill_bf16(seq_id, tokens, past_len)
        return self._f32(self.sets[TaskKind.PREFILL_IDS], seq_id, len(tokens), out)

    def decode(self, seq_id: int, token: int, pos: int, *,
               out: np.ndarray | None = None) -> np.ndarray:
        """Decode ``token`` at position ``pos``; its logits (float32)."""
        self.decode_bf16(seq_id, token, pos)
        return self._f32(self.sets[TaskKind.DECODE], seq_id, 1, out)

    def generate(self, seq_id: int, prompt: Sequence[int], n_tokens: int, *,
                 release: bool = True) -> list[int]:
        """Prefill ``prompt`` then decode greedily: ``n_tokens`` tokens (the first from the
        prefill's logits). Releases the sequence's KV afterwards unless ``release=False``."""
        try:
            tok = refmodel.greedy(self.prefill_bf16(seq_id, prompt))
            out = [tok]
            pos = len(prompt)
            for _ in range(n_tokens - 1):
                tok = refmodel.greedy(self.decode_bf16(seq_id, tok, pos))
                out.append(tok)
                pos += 1
            return out[:max(n_tokens, 0)]
        finally:
            if release:
                check(self.driver.kv_release(seq_id, 0), "kv_release", seq_id=seq_id)

    def release(self, seq_id: int, keep_len: int = 0) -> None:
        check(self.driver.kv_release(seq_id, keep_len), "kv_release", seq_id=seq_id)

    def close(self) -> None:
        """Destroy the buffers (the driver stays open and configured)."""
        for s in self.sets.values():
            self.driver.destroy_buffers(s.inp, s.out)
        self.sets = {}


def golden_prompts(n: int = 100, *, vocab: int = 1024, max_len: int = 4096,
                   seed: int = GOLDEN_SEED) -> list[list[int]]:
    """The fixed golden prompts: ``n`` prompts of tokens ``< vocab``, lengths spread over
    ``1..max_len`` (the spec's edge lengths first, then log-uniform), seeded."""
    rng = random.Random(seed)
    edges = [x for x in (1, 2, 15, 16, 17, 127, 128, 1024, max_len - 1, max_len)
             if 1 <= x <= max_len]
    lengths = edges[:n]
    while len(lengths) < n:
        lengths.append(max(1, min(max_len, round(2 ** rng.uniform(0, np.log2(max_len))))))
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths]
