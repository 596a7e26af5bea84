/* calfsm's batch tail (calfsm_tail.h): for each row of a finished job, the BF16 -> float32
 * conversion with its finite check, the penalties, the allowed-token mask, and the token
 * (argmax or calfsm_sample with one draw of the row's own generator), on a few threads.
 *
 * Bit for bit what the numpy path of calfsm/generate/sampling.py and penalties.py gives
 * (tests/engine/test_tail.py): the conversion is calfsm_bf16_to_f32_finite's, the draw is
 * calfsm_sample itself, the penalties are the same float32 operations in the same order
 * (no contraction into FMA), and the argmax is numpy's (the first index of the maximum;
 * -0 and +0 compare equal). A row that is not plainly right (a non-finite value, a maximum
 * that is not finite after the penalties) is reported, not judged: the caller's checked
 * path raises its precise error, and nothing was drawn.
 *
 * A greedy row with nothing between the conversion and the argmax is one pass over the
 * BF16 row (convert, check, and the largest BF16 order key by lanes), then a scan of the
 * BF16 row for the first value equal to the maximum.
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
#endif

#define _GNU_SOURCE
#include "calfsm_tail.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "calfsm_kernels.h"
#include "calfsm_sampling.h"
#include "calfsm_sample_ops.h"

#define BLOCK 64
#define BIG_BLOCK 1024
#define EXP16 0x7F80u
#define MAX_THREADS 16

/* numpy's bitgen_t (numpy/random/bitgen.h): the generator behind PCG64().random_raw() */
typedef struct {
    void *state;
    uint64_t (*next_uint64)(void *st);
    uint32_t (*next_uint32)(void *st);
    double (*next_double)(void *st);
    uint64_t (*next_raw)(void *st);
} np_bitgen;

uint32_t calfsm_tail_version(void) {
    return CALFSM_TAIL_VERSION;
}

/* ---- greedy on the BF16 row: convert, check, largest key, in one pass -------------- */

/* order key of BF16 bits: unsigned order of keys is the order of the values */
INLINE uint16_t key16(uint16_t b) {
    return b ^ (uint16_t)((uint16_t)((int16_t)b >> 15) | 0x8000u);
}

INLINE uint16_t conv_key(const uint16_t *restrict src, uint32_t *restrict dst, uint64_t n,
                         uint16_t *restrict acc) {
    uint16_t a = *acc, m = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint16_t b = src[i];
        dst[i] = (uint32_t)b << 16;
        a |= (uint16_t)((b & EXP16) + 0x80u);
        uint16_t k = key16(b);
        m = k > m ? k : m;
    }
    *acc = a;
    return m;
}

INLINE uint16_t scan_key(const uint16_t *restrict src, uint64_t n, uint16_t *restrict acc) {
    uint16_t a = *acc, m = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint16_t b = src[i];
        a |= (uint16_t)((b & EXP16) + 0x80u);
        uint16_t k = key16(b);
        m = k > m ? k : m;
    }
    *acc = a;
    return m;
}

/* conv_key_all without the float32 row: the largest key and the carry bits only */
INLINE uint16_t scan_key_all(const uint16_t *restrict src, uint64_t n, uint16_t *acc) {
    uint16_t m = 0, v;
    uint64_t i = 0;
    *acc = 0;
    for (; n - i >= BIG_BLOCK; i += BIG_BLOCK) {
        v = scan_key(src + i, BIG_BLOCK, acc);
        m = v > m ? v : m;
    }
    for (; n - i >= BLOCK; i += BLOCK) {
        v = scan_key(src + i, BLOCK, acc);
        m = v > m ? v : m;
    }
    v = scan_key(src + i, n - i, acc);
    return v > m ? v : m;
}

/* returns the largest key; *acc gets the carry bits (bit 15: a value is NaN or Inf) */
INLINE uint16_t conv_key_all(const uint16_t *restrict src, float *restrict dst, uint64_t n,
                             uint16_t *acc) {
    uint32_t *restrict bits = (uint32_t *)dst;
    uint16_t m = 0, v;
    uint64_t i = 0;
    *acc = 0;
    for (; n - i >= BIG_BLOCK; i += BIG_BLOCK) {
        v = conv_key(src + i, bits + i, BIG_BLOCK, acc);
        m = v > m ? v : m;
    }
    for (; n - i >= BLOCK; i += BLOCK) {
        v = conv_key(src + i, bits + i, BLOCK, acc);
        m = v > m ? v : m;
    }
    v = conv_key(src + i, bits + i, n - i, acc);
    return v > m ? v : m;
}

/* ---- the largest float32 order key (a row the penalties changed) ------------------- */

INLINE uint32_t key_max_all(const float *restrict x, uint64_t n) {
    uint32_t m = 0, v;
    uint64_t i = 0;
    for (; n - i >= BIG_BLOCK; i += BIG_BLOCK) {
        v = max_key(x + i, BIG_BLOCK);
        m = v > m ? v : m;
    }
    v = max_key(x + i, n - i);
    return v > m ? v : m;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MAX_LEVEL 2
__attribute__((target("avx512f,avx512bw")))
static uint16_t conv_key_avx512(const uint16_t *restrict s, float *restrict d, uint64_t n,
                                uint16_t *acc) {
    return conv_key_all(s, d, n, acc);
}
__attribute__((target("avx2")))
static uint16_t conv_key_avx2(const uint16_t *restrict s, float *restrict d, uint64_t n,
                              uint16_t *acc) {
    return conv_key_all(s, d, n, acc);
}
__attribute__((target("avx512f,avx512bw")))
static uint16_t scan_key_avx512(const uint16_t *restrict s, uint64_t n, uint16_t *acc) {
    return scan_key_all(s, n, acc);
}
__attribute__((target("avx2")))
static uint16_t scan_key_avx2(const uint16_t *restrict s, uint64_t n, uint16_t *acc) {
    return scan_key_all(s, n, acc);
}
__attribute__((target("avx512f,avx512bw")))
static uint32_t key_max_avx512(const float *restrict x, uint64_t n) {
    return key_max_all(x, n);
}
__attribute__((target("avx2")))
static uint32_t key_max_avx2(const float *restrict x, uint64_t n) {
    return key_max_all(x, n);
}
#else
#define MAX_LEVEL 0
#endif

static uint16_t convert_key(const uint16_t *s, float *d, uint64_t n, uint16_t *acc,
                            int32_t level) {
    switch (level) {
#if MAX_LEVEL >= 2
    case 2: return conv_key_avx512(s, d, n, acc);
    case 1: return conv_key_avx2(s, d, n, acc);
#endif
    default: return conv_key_all(s, d, n, acc);
    }
}

static uint16_t scan_largest_key(const uint16_t *s, uint64_t n, uint16_t *acc,
                                 int32_t level) {
    switch (level) {
#if MAX_LEVEL >= 2
    case 2: return scan_key_avx512(s, n, acc);
    case 1: return scan_key_avx2(s, n, acc);
#endif
    default: return scan_key_all(s, n, acc);
    }
}

static uint32_t largest_key(const float *x, uint64_t n, int32_t level) {
    switch (level) {
#if MAX_LEVEL >= 2
    case 2: return key_max_avx512(x, n);
    case 1: return key_max_avx2(x, n);
#endif
    default: return key_max_all(x, n);
    }
}

/* the first index of a value equal to m (numpy's argmax: -0 == +0) */
static int64_t first_equal(const float *x, uint64_t n, float m) {
    for (uint64_t i = 0; i < n; i++)
        if (x[i] == m) return (int64_t)i;
    return -1;
}

static int64_t first_nonfinite16(const uint16_t *s, uint64_t n) {
    for (uint64_t i = 0; i < n; i++)
        if ((s[i] & EXP16) == EXP16) return (int64_t)i;
    return -1;
}

/* the first index of BF16 bits whose value equals that of mb (-0 == +0) */
static int64_t first_equal16(const uint16_t *s, uint64_t n, uint16_t mb) {
    if ((mb & 0x7FFFu) == 0) {
        for (uint64_t i = 0; i < n; i++)
            if ((s[i] & 0x7FFFu) == 0) return (int64_t)i;
        return -1;
    }
    for (uint64_t i = 0; i < n; i++)
        if (s[i] == mb) return (int64_t)i;
    return -1;
}

/* ---- the draw of a top-k row nobody reads after it: the candidates only ---------------
 *
 * calfsm_sample leaves every token's weight in the row, so it writes the whole row and
 * reads it again for top-p and the draw. A row in scratch is read by nobody after the
 * draw, and with top-k only the tokens at or above the k-th largest logit weigh anything
 * (calfsm/generate/sampling.py, step 2). So here: the block maxima (one pass), the k-th
 * largest of them as a lower bound, the values above it gathered from the blocks that
 * reach it, the k-th largest of those (the top-k key), and then the weights, the masses,
 * the nucleus and the draw over those candidates alone, in vocabulary order, with the
 * same operations as calfsm_sample: the same token. Anything outside the common case (k
 * above the number of blocks, more than GATHER candidates) returns -3: then
 * calfsm_sample. */

#define GATHER 4096
#define NOT_SPARSE (-3)

/* the k largest of keys seen, descending, in top[0..k) (k small: insertion) */
INLINE void keep_top(uint32_t *top, uint32_t *have, uint32_t k, uint32_t key) {
    uint32_t h = *have;
    if (h == k && key <= top[k - 1]) return;
    uint32_t j = h < k ? h++ : k - 1;
    while (j > 0 && top[j - 1] < key) {
        top[j] = top[j - 1];
        j--;
    }
    top[j] = key;
    *have = h;
}

INLINE void block_max_body(const float *restrict x, uint64_t n, uint64_t bs,
                           uint32_t *restrict bmax) {
    for (uint64_t lo = 0, b = 0; lo < n; lo += bs, b++) {
        uint64_t len = n - lo < bs ? n - lo : bs;
        bmax[b] = len == SB ? max_key(x + lo, SB) : max_key(x + lo, len);
    }
}

#if MAX_LEVEL >= 2
__attribute__((target("avx512f,avx512bw")))
static void block_max_avx512(const float *restrict x, uint64_t n, uint64_t bs,
                             uint32_t *restrict bmax) {
    block_max_body(x, n, bs, bmax);
}
__attribute__((target("avx2")))
static void block_max_avx2(const float *restrict x, uint64_t n, uint64_t bs,
                           uint32_t *restrict bmax) {
    block_max_body(x, n, bs, bmax);
}
#endif

static void block_maxima(const float *x, uint64_t n, uint64_t bs, uint32_t *bmax,
                         int32_t level) {
    switch (level) {
#if MAX_LEVEL >= 2
    case 2: block_max_avx512(x, n, bs, bmax); return;
    case 1: block_max_avx2(x, n, bs, bmax); return;
#endif
    default: block_max_body(x, n, bs, bmax);
    }
}

/* the largest BF16 key of each block, and the carry bits of all (bit 15: NaN or Inf) */
INLINE uint16_t block_max16_body(const uint16_t *restrict s, uint64_t n, uint64_t bs,
                                 uint16_t *restrict bmax) {
    uint16_t acc = 0;
    for (uint64_t lo = 0, b = 0; lo < n; lo += bs, b++) {
        uint64_t len = n - lo < bs ? n - lo : bs;
        bmax[b] = len == SB ? scan_key(s + lo, SB, &acc) : scan_key(s + lo, len, &acc);
    }
    return acc;
}

#if MAX_LEVEL >= 2
__attribute__((target("avx512f,avx512bw")))
static uint16_t block_max16_avx512(const uint16_t *restrict s, uint64_t n, uint64_t bs,
                                   uint16_t *restrict bmax) {
    return block_max16_body(s, n, bs, bmax);
}
__attribute__((target("avx2")))
static uint16_t block_max16_avx2(const uint16_t *restrict s, uint64_t n, uint64_t bs,
                                 uint16_t *restrict bmax) {
    return block_max16_body(s, n, bs, bmax);
}
#endif

static uint16_t block_maxima16(const uint16_t *s, uint64_t n, uint64_t bs, uint16_t *bmax,
                               int32_t level) {
    switch (level) {
#if MAX_LEVEL >= 2
    case 2: return block_max16_avx512(s, n, bs, bmax);
    case 1: return block_max16_avx2(s, n, bs, bmax);
#endif
    default: return block_max16_body(s, n, bs, bmax);
    }
}

/* the float32 order key of a BF16 key (the same order) */
INLINE uint32_t key32_of16(uint16_t k) {
    uint16_t b = (k & 0x8000u) ? (uint16_t)(k ^ 0x8000u) : (uint16_t)~k;
    return okey((uint32_t)b << 16);
}

typedef struct {
    uint32_t idx;
    uint32_t bits;   /* the weight's */
    uint64_t q;      /* its mass */
} cand;

static int by_bits_desc(const void *a, const void *b) {
    uint32_t x = ((const cand *)a)->bits, y = ((const cand *)b)->bits;
    return x < y ? 1 : x > y ? -1 : 0;
}

INLINE int sparse_fits(uint64_t n, uint64_t k) {
    return k && k < n && k <= 64 && k <= (n + block_size(n) - 1) / block_size(n);
}

INLINE float value_at(const float *x, const uint16_t *s16, uint64_t j) {
    return s16 ? float_of((uint32_t)s16[j] << 16) : x[j];
}

/* the draw over the top-k candidates of a row of floats (x) or of BF16 bits (s16),
 * whose block maxima (order keys) are in bmax */
static int64_t sparse_draw(const float *x, const uint16_t *s16, const uint32_t *bmax,
                           uint64_t n, double inv_t, uint64_t k, uint64_t p_q, uint64_t u) {
    if (!sparse_fits(n, k)) return NOT_SPARSE;
    uint64_t bs = block_size(n);
    uint32_t nb = (uint32_t)((n + bs - 1) / bs);
    uint32_t top[64], have = 0, mx = 0;
    for (uint32_t b = 0; b < nb; b++) {
        keep_top(top, &have, (uint32_t)k, bmax[b]);
        mx = bmax[b] > mx ? bmax[b] : mx;
    }
    uint32_t low = top[k - 1];
    cand c[GATHER];  /* 64 KiB of stack */
    uint32_t nc = 0;
    have = 0;
    for (uint32_t b = 0; b < nb; b++) {
        if (bmax[b] < low) continue;
        uint64_t lo = (uint64_t)b * bs, hi = lo + bs < n ? lo + bs : n;
        for (uint64_t j = lo; j < hi; j++) {
            uint32_t key = okey(bits_of(value_at(x, s16, j)));
            if (key < low) continue;
            if (nc == GATHER) return NOT_SPARSE;
            c[nc].idx = (uint32_t)j;
            c[nc].bits = key;   /* the key, for now */
            nc++;
            keep_top(top, &have, (uint32_t)k, key);
        }
    }
    uint32_t tk = top[k - 1];
    double m = (double)key_float(mx);
    uint32_t w = 0;
    uint64_t z = 0;
    for (uint32_t i = 0; i < nc; i++) {
        if (c[i].bits < tk) continue;
        float wt = weight_of(value_at(x, s16, c[i].idx), m, inv_t, 0);
        c[w].idx = c[i].idx;
        c[w].bits = bits_of(wt);
        c[w].q = mass_of(c[w].bits);
        z += c[w].q;
        w++;
    }
    if (z == 0) return CALFSM_SAMPLE_ENOMASS;
    uint32_t tp = 0;
    uint64_t s = z;
    if (p_q < P_ONE) {
        cand sorted[GATHER];
        memcpy(sorted, c, w * sizeof *c);
        qsort(sorted, w, sizeof *sorted, by_bits_desc);
        uint64_t need = ceil_share(z, p_q), above = 0;
        for (uint32_t i = 0; i < w;) {
            uint32_t j = i;
            uint64_t g = 0;
            while (j < w && sorted[j].bits == sorted[i].bits) g += sorted[j++].q;
            if (above + g >= need) {
                tp = sorted[i].bits;
                s = above + g;
                break;
            }
            above += g;
            i = j;
        }
    }
    uint64_t r = mulhi(u, s), cum = 0;
    for (uint32_t i = 0; i < w; i++) {
        if (c[i].bits >= tp) cum += c[i].q;
        if (cum > r) return (int64_t)c[i].idx;
    }
    return CALFSM_SAMPLE_ENOMASS;
}

/* ---- scratch rows: a row without a target is worked on in one of these ---------------
 *
 * A row whose float32 values nobody reads after its token is chosen (a stream's step)
 * is converted into a scratch row kept by the library instead of its target: the one
 * row a thread works on stays in its cache, where a target far away would be written
 * out to memory and read back by every pass of the draw. Claimed and given back per row
 * (an atomic flag each), allocated at first use and kept. */

#define SCRATCH_ROWS MAX_THREADS
static atomic_int scratch_busy[SCRATCH_ROWS];
static float *scratch_row[SCRATCH_ROWS];
static uint64_t scratch_len[SCRATCH_ROWS];

static int claim_scratch(uint64_t n, float **row) {
    for (int i = 0; i < SCRATCH_ROWS; i++) {
        int expected = 0;
        if (!atomic_compare_exchange_strong(&scratch_busy[i], &expected, 1)) continue;
        if (scratch_len[i] < n) {
            float *p = (float *)realloc(scratch_row[i], n * sizeof(float));
            if (!p) {
                atomic_store(&scratch_busy[i], 0);
                return -1;
            }
            scratch_row[i] = p;
            scratch_len[i] = n;
        }
        *row = scratch_row[i];
        return i;
    }
    return -1;
}

static void give_scratch(int i) {
    if (i >= 0) atomic_store(&scratch_busy[i], 0);
}

/* ---- one row ------------------------------------------------------------------------ */

static void penalize(calfsm_tail_row *r, float *x) {
    float rep = r->repetition, fr = r->frequency, pr = r->presence;
    if (rep != 1.0f) {
        for (uint64_t j = 0; j < r->n_seen; j++) {
            float v = x[r->seen[j]];
            x[r->seen[j]] = v > 0.0f ? v / rep : v * rep;
        }
    }
    if (fr != 0.0f || pr != 0.0f) {
        for (uint64_t j = 0; j < r->n_out; j++) {
            float v = x[r->out_ids[j]];
            if (fr != 0.0f) {
                float t = fr * r->out_counts[j];
                v = v - t;
            }
            if (pr != 0.0f) v = v - pr;
            x[r->out_ids[j]] = v;
        }
    }
    for (uint64_t j = 0; j < r->n_banned; j++) x[r->banned[j]] = -INFINITY;
}

static void run_on(calfsm_tail_row *r, float *x, int32_t level);

static void run_row(calfsm_tail_row *r, int32_t level) {
    uint64_t n = r->vocab;
    r->token = -1;
    r->bad = -1;
    r->status = CALFSM_TAIL_SKIPPED;
    if (!n || n > CALFSM_SAMPLE_MAX_VOCAB || (!r->dst && (!r->src || r->mode == CALFSM_TAIL_CONVERT)))
        return;
    int changes = r->penalized || r->allowed;
    if (!r->dst && r->mode == CALFSM_TAIL_GREEDY && !changes) {
        /* greedy and no row wanted: one read of the BF16 row, nothing written */
        uint16_t acc;
        uint16_t mk = scan_largest_key(r->src, n, &acc, level);
        if (acc & 0x8000u) {
            r->bad = first_nonfinite16(r->src, n);
            r->status = CALFSM_TAIL_NONFINITE;
            return;
        }
        r->token = first_equal16(r->src, n,
                                 (mk & 0x8000u) ? (uint16_t)(mk ^ 0x8000u) : (uint16_t)~mk);
        r->status = CALFSM_TAIL_OK;
        return;
    }
    if (!r->dst && r->mode == CALFSM_TAIL_DRAW && !changes && r->bitgen && r->inv_temp > 0.0
        && r->top_p_q32 && r->top_p_q32 <= P_ONE && sparse_fits(n, r->top_k)) {
        /* a top-k draw and no row wanted: the BF16 row read once for its block maxima
         * and its finite check, then the candidates alone; a float row only if they do
         * not fit (then calfsm_sample, with the same draw) */
        uint64_t bs = block_size(n);
        uint32_t nb = (uint32_t)((n + bs - 1) / bs);
        uint16_t b16[KBLOCKS];
        uint32_t bmax[KBLOCKS];
        if (block_maxima16(r->src, n, bs, b16, level) & 0x8000u) {
            r->bad = first_nonfinite16(r->src, n);
            r->status = CALFSM_TAIL_NONFINITE;
            return;
        }
        for (uint32_t b = 0; b < nb; b++) bmax[b] = key32_of16(b16[b]);
        np_bitgen *g = (np_bitgen *)r->bitgen;
        uint64_t u = g->next_raw(g->state);
        int64_t tok = sparse_draw(NULL, r->src, bmax, n, r->inv_temp, r->top_k,
                                  r->top_p_q32, u);
        if (tok == NOT_SPARSE) {
            float *x;
            int own = claim_scratch(n, &x);
            if (own < 0) {
                x = (float *)malloc(n * sizeof *x);
                if (!x) {   /* nothing else to do: the draw is spent, say so */
                    r->token = CALFSM_SAMPLE_EINVAL;
                    r->status = CALFSM_TAIL_EDRAW;
                    return;
                }
            }
            calfsm_bf16_to_f32_finite(r->src, x, n);    /* finite: checked above */
            tok = calfsm_sample(x, n, r->inv_temp, r->top_k, r->top_p_q32, u);
            if (own < 0) free(x);
            give_scratch(own);
        }
        r->token = tok;
        r->status = tok >= 0 ? CALFSM_TAIL_OK : CALFSM_TAIL_EDRAW;
        return;
    }
    float *x = r->dst;
    int own = -1;
    if (!x && (own = claim_scratch(n, &x)) < 0) return;   /* SKIPPED: the caller converts */
    run_on(r, x, level);
    give_scratch(own);
}

static void run_on(calfsm_tail_row *r, float *x, int32_t level) {
    uint64_t n = r->vocab;
    int changes = r->penalized || r->allowed;
    if (r->src && r->mode == CALFSM_TAIL_GREEDY && !changes) {
        uint16_t acc;
        uint16_t mk = convert_key(r->src, x, n, &acc, level);
        if (acc & 0x8000u) {
            r->bad = first_nonfinite16(r->src, n);
            r->status = CALFSM_TAIL_NONFINITE;
            return;
        }
        uint16_t mb = (mk & 0x8000u) ? (uint16_t)(mk ^ 0x8000u) : (uint16_t)~mk;
        r->token = first_equal(x, n, float_of((uint32_t)mb << 16));
        r->status = CALFSM_TAIL_OK;
        return;
    }
    if (r->src) {
        int64_t bad = calfsm_bf16_to_f32_finite(r->src, x, n);
        if (bad == CALFSM_OVERLAP) return;      /* SKIPPED */
        if (bad >= 0) {
            r->bad = bad;
            r->status = CALFSM_TAIL_NONFINITE;
            return;
        }
    }
    if (r->mode == CALFSM_TAIL_CONVERT) {
        r->status = CALFSM_TAIL_OK;
        return;
    }
    if (r->penalized) penalize(r, x);
    if (r->allowed) {
        const uint8_t *a = r->allowed;
        for (uint64_t i = 0; i < n; i++)
            if (!a[i]) x[i] = -INFINITY;
    }
    float m = 0.0f;
    if (changes || r->mode == CALFSM_TAIL_GREEDY) {
        m = key_float(largest_key(x, n, level));
        if (changes && !isfinite(m)) {  /* +inf, NaN, or every token banned */
            r->bad = (int64_t)bits_of(m);   /* the maximum, for the caller's error */
            r->status = CALFSM_TAIL_UNUSABLE;
            return;
        }
    }
    if (r->mode == CALFSM_TAIL_GREEDY) {
        r->token = first_equal(x, n, m);
        r->status = CALFSM_TAIL_OK;
        return;
    }
    np_bitgen *g = (np_bitgen *)r->bitgen;
    if (!g) return;                         /* SKIPPED */
    uint64_t u = g->next_raw(g->state);
    int64_t tok = NOT_SPARSE;
    if (!r->dst && r->inv_temp > 0.0 && r->top_p_q32 && r->top_p_q32 <= P_ONE
        && sparse_fits(n, r->top_k)) {
        uint32_t bmax[KBLOCKS];
        block_maxima(x, n, block_size(n), bmax, level);
        tok = sparse_draw(x, NULL, bmax, n, r->inv_temp, r->top_k, r->top_p_q32, u);
    }
    if (tok == NOT_SPARSE)
        tok = calfsm_sample(x, n, r->inv_temp, r->top_k, r->top_p_q32, u);
    r->token = tok;
    r->status = tok >= 0 ? CALFSM_TAIL_OK : CALFSM_TAIL_EDRAW;
}

/* ---- the rows, on a few threads ----------------------------------------------------
 *
 * The helpers are detached threads started per call, and the caller works too: rows are
 * claimed one at a time, and the call returns once every row is done, not once every
 * helper has ended. So a helper the scheduler starts late (a busy machine) costs the call
 * nothing: it finds no row left and ends on its own, and the last one out frees the
 * shared state. */

typedef struct {
    calfsm_tail_row *const *rows;
    uint32_t n;
    int32_t level;
    atomic_uint next;
    atomic_uint done;
    atomic_uint refs;
    pthread_mutex_t lock;
    pthread_cond_t all_done;
} work;

static void release(work *w) {
    if (atomic_fetch_sub(&w->refs, 1u) == 1u) {
        pthread_mutex_destroy(&w->lock);
        pthread_cond_destroy(&w->all_done);
        free(w);
    }
}

static void take_rows(work *w) {
    for (;;) {
        uint32_t i = atomic_fetch_add(&w->next, 1u);
        if (i >= w->n) break;
        run_row(w->rows[i], w->level);
        if (atomic_fetch_add(&w->done, 1u) + 1u == w->n) {
            pthread_mutex_lock(&w->lock);
            pthread_cond_broadcast(&w->all_done);
            pthread_mutex_unlock(&w->lock);
        }
    }
}

static void *helper(void *arg) {
    work *w = (work *)arg;
    take_rows(w);
    release(w);
    return NULL;
}

int32_t calfsm_tail(calfsm_tail_row *const *rows, uint32_t n, uint32_t threads) {
    int32_t level = calfsm_kernels_level();
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = n;
    work *w = threads > 1 ? (work *)malloc(sizeof *w) : NULL;
    if (!w || pthread_mutex_init(&w->lock, NULL) != 0) {
        free(w);                      /* one thread: the caller alone, nothing shared */
        for (uint32_t i = 0; i < n; i++) run_row(rows[i], level);
    } else {
        pthread_cond_init(&w->all_done, NULL);
        w->rows = rows;
        w->n = n;
        w->level = level;
        atomic_init(&w->next, 0u);
        atomic_init(&w->done, 0u);
        atomic_init(&w->refs, 1u);
        pthread_attr_t attr;
        int attr_ok = pthread_attr_init(&attr) == 0
                      && pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED) == 0;
        for (uint32_t t = 1; attr_ok && t < threads; t++) {
            pthread_t tid;
            atomic_fetch_add(&w->refs, 1u);
            if (pthread_create(&tid, &attr, helper, w) != 0) {  /* fewer helpers, then */
                atomic_fetch_sub(&w->refs, 1u);
                break;
            }
        }
        if (attr_ok) pthread_attr_destroy(&attr);
        take_rows(w);
        pthread_mutex_lock(&w->lock);     /* rows a helper is still running */
        while (atomic_load(&w->done) < n) pthread_cond_wait(&w->all_done, &w->lock);
        pthread_mutex_unlock(&w->lock);
        release(w);
    }
    int32_t failed = 0;
    for (uint32_t i = 0; i < n; i++) failed += rows[i]->status != CALFSM_TAIL_OK;
    return failed;
}
