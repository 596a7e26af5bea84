/* The reference model (docs/reference-model.md) in C: hash chain, logits, tile layout.
 * Pure functions, no state, no allocation; bit-identical to calfsm/drivers/refmodel.py. */
#ifndef EMU_REFMODEL_H
#define EMU_REFMODEL_H

#include <stdint.h>
#include <stddef.h>

#define REF_H_INIT 0x811C9DC5u

static inline uint32_t ref_fmix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    x ^= x >> 16;
    return x;
}

static inline uint32_t ref_step(uint32_t h_prev, uint32_t token, uint32_t pos) {
    return ref_fmix32(h_prev ^ (token * 0x9E3779B1u) ^ (pos * 0x85EBCA77u));
}

/* BF16 bits of logit v of hash h (round to nearest even). */
static inline uint16_t ref_logit_bf16(uint32_t h, uint32_t v) {
    uint32_t u = ref_fmix32(h ^ (v * 0x27D4EB2Fu));
    float f = (float)((int32_t)(u >> 8) - 8388608) * (1.0f / 1048576.0f);
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Write the vocab logits of hash h into row[0..vocab). */
void ref_logits_row(uint32_t h, uint16_t *row, size_t vocab);

/* The word an embedding row of nbytes bytes steps the chain with, in place of a token id:
 * fmix32 of the sum (mod 2^32) of fmix32(256 * i + row[i]). */
uint32_t ref_embed_word(const uint8_t *row, size_t nbytes);

#endif
