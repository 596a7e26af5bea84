/* The arithmetic of a draw that calfsm_sampling.c (the kernel) and calfsm_tail.c (its
 * top-k draw over the candidates alone) both do, written once so that the two give the
 * same token bit for bit: the order keys, the weight (exp) of one value, its integer
 * mass, and the shares of the draw. Internal to the library (not installed, not ABI).
 *
 * Every function is inline, so it is compiled in the file that includes this header,
 * under that file's floating-point pragmas: an includer must turn off FP contraction
 * (no FMA) before the #include, as both do. What is computed is specified op by op in
 * calfsm/generate/sampling.py. */
#ifndef CALFSM_SAMPLE_OPS_H
#define CALFSM_SAMPLE_OPS_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

#define SB 256          /* values per block */
#define KBLOCKS 1024    /* block maxima a top-k select keeps */
#define S_MIN (-28.0)   /* a scaled logit below this weighs 0: exp(-28) * 2^40 < 1 */
#define Q_ONE 40        /* mass = trunc(weight * 2^Q_ONE) */
#define P_ONE (1ull << 32)

/* float32 constants of the exp below, bit-exact as calfsm/generate/sampling.py writes them */
#define LOG2E 0x1.715476p+0f
#define MAGIC 0x1.8p23f   /* adding it rounds |v| < 2^22 to an integer */
#define LN2_HI 0x1.63p-1f
#define LN2_LO (-0x1.bd0106p-13f)
#define P0 0x1.a0d2cep-13f
#define P1 0x1.6e879cp-10f
#define P2 0x1.11121p-7f
#define P3 0x1.555382p-5f
#define P4 0x1.555554p-3f
#define P5 0x1.0p-1f

INLINE uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

INLINE float float_of(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* The order key: unsigned order of keys is the order of the floats (-0 below +0). */
INLINE uint32_t okey(uint32_t b) {
    return b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
}

INLINE float key_float(uint32_t k) {
    return float_of((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

/* The largest order key of x[0..len). */
INLINE uint32_t max_key(const float *restrict x, uint64_t len) {
    uint32_t m = 0;
    for (uint64_t i = 0; i < len; i++) {
        uint32_t k = okey(bits_of(x[i]));
        m = k > m ? k : m;
    }
    return m;
}

/* The block of a row of n values whose maxima a top-k select keeps: SB, doubled until
 * at most KBLOCKS blocks cover the row. */
INLINE uint64_t block_size(uint64_t n) {
    uint64_t bs = SB;
    while (n > bs * KBLOCKS) bs *= 2;
    return bs;
}

/* The weight of v: exp(s) of s = (v - m) * inv_t, or 0 where s < S_MIN or v's order
 * key is below the top-k key tk (0: none). exp is Cody-Waite range reduction to r in
 * [-ln2/2, ln2/2] and Cephes' degree-5 polynomial, all in float32. */
INLINE float weight_of(float v, double m, double inv_t, uint32_t tk) {
    double d = ((double)v - m) * inv_t;
    int keep = (okey(bits_of(v)) >= tk) & (d >= S_MIN);
    float s = (float)(d >= S_MIN ? d : S_MIN);
    float kb = s * LOG2E;
    kb = kb + MAGIC;             /* k = nearest integer to s*log2(e), in its low bits */
    float kf = kb - MAGIC;
    uint32_t k = bits_of(kb) - bits_of(MAGIC);
    float r = s - kf * LN2_HI;
    r = r - kf * LN2_LO;
    float z = r * r;
    float y = P0 * r;
    y = y + P1;
    y = y * r;
    y = y + P2;
    y = y * r;
    y = y + P3;
    y = y * r;
    y = y + P4;
    y = y * r;
    y = y + P5;
    y = y * z;
    y = y + r;
    y = y + 1.0f;
    float w = y * float_of((k + 127u) << 23);
    return keep ? w : 0.0f;
}

/* trunc(w * 2^40) of a weight's bits (0 <= w < 2): exactly what the double product
 * gives, in integer operations that vectorise (no variable right shift). w = mant *
 * 2^(e - 150), so the mass is mant * 2^sh with sh = e - 110 <= 17: shifted left by
 * sh + 23 (at most 40, so it fits 64 bits), then right by 23; below sh = -23 (and for
 * zero and subnormals, e = 0) nothing of the 24-bit mantissa is left. */
INLINE uint64_t mass_of(uint32_t b) {
    int32_t sh = (int32_t)(b >> 23) - (150 - Q_ONE);
    uint64_t mant = sh >= -23 ? (uint64_t)((b & 0x7FFFFFu) | 0x800000u) : 0u;
    return (mant << (sh >= -23 ? sh + 23 : 0)) >> 23;
}

/* The high 64 bits of a * b: the draw's share r = u * s / 2^64. */
INLINE uint64_t mulhi(uint64_t a, uint64_t b) {
#ifdef __SIZEOF_INT128__
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
#else
    uint64_t al = a & 0xFFFFFFFFu, ah = a >> 32, bl = b & 0xFFFFFFFFu, bh = b >> 32;
    uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    uint64_t mid = (ll >> 32) + (lh & 0xFFFFFFFFu) + (hl & 0xFFFFFFFFu);
    return hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
#endif
}

/* ceil(z * p / 2^32) for p <= 2^32, without overflow: top-p's mass to reach */
INLINE uint64_t ceil_share(uint64_t z, uint64_t p) {
    return (z >> 32) * p + (((z & 0xFFFFFFFFu) * p + 0xFFFFFFFFu) >> 32);
}

#endif /* CALFSM_SAMPLE_OPS_H */
