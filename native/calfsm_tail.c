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
#include <string.h>

#include "calfsm_kernels.h"
#include "calfsm_sampling.h"

#if defined(__GNUC__) || defined(__clang__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

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

INLINE uint32_t okey(uint32_t b) {
    return b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
}

INLINE uint32_t key_max(const float *restrict x, uint64_t n) {
    uint32_t m = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t k = okey(bits_of(x[i]));
        m = k > m ? k : m;
    }
    return m;
}

INLINE uint32_t key_max_all(const float *restrict x, uint64_t n) {
    uint32_t m = 0, v;
    uint64_t i = 0;
    for (; n - i >= BIG_BLOCK; i += BIG_BLOCK) {
        v = key_max(x + i, BIG_BLOCK);
        m = v > m ? v : m;
    }
    v = key_max(x + i, n - i);
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

static uint32_t largest_key(const float *x, uint64_t n, int32_t level) {
    switch (level) {
#if MAX_LEVEL >= 2
    case 2: return key_max_avx512(x, n);
    case 1: return key_max_avx2(x, n);
#endif
    default: return key_max_all(x, n);
    }
}

INLINE float key_float(uint32_t k) {
    return float_of((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
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

/* ---- one row ------------------------------------------------------------------------ */

static void penalize(calfsm_tail_row *r) {
    float *x = r->dst;
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

static void run_row(calfsm_tail_row *r, int32_t level) {
    uint64_t n = r->vocab;
    float *x = r->dst;
    r->token = -1;
    r->bad = -1;
    if (!x || !n || n > CALFSM_SAMPLE_MAX_VOCAB) {
        r->status = CALFSM_TAIL_SKIPPED;
        return;
    }
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
        if (bad == CALFSM_OVERLAP) {
            r->status = CALFSM_TAIL_SKIPPED;
            return;
        }
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
    if (r->penalized) penalize(r);
    if (r->allowed) {
        const uint8_t *a = r->allowed;
        for (uint64_t i = 0; i < n; i++)
            if (!a[i]) x[i] = -INFINITY;
    }
    float m = 0.0f;
    if (changes || r->mode == CALFSM_TAIL_GREEDY) {
        m = key_float(largest_key(x, n, level));
        if (changes && !isfinite(m)) {  /* +inf, NaN, or every token banned */
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
    if (!g) {
        r->status = CALFSM_TAIL_SKIPPED;
        return;
    }
    uint64_t u = g->next_raw(g->state);
    int64_t tok = calfsm_sample(x, n, r->inv_temp, r->top_k, r->top_p_q32, u);
    r->token = tok;
    r->status = tok >= 0 ? CALFSM_TAIL_OK : CALFSM_TAIL_EDRAW;
}

/* ---- the rows, on a few threads ---------------------------------------------------- */

typedef struct {
    calfsm_tail_row *const *rows;
    uint32_t n;
    int32_t level;
    atomic_uint next;
} work;

static void *worker(void *arg) {
    work *w = (work *)arg;
    for (;;) {
        uint32_t i = atomic_fetch_add(&w->next, 1u);
        if (i >= w->n) break;
        run_row(w->rows[i], w->level);
    }
    return NULL;
}

int32_t calfsm_tail(calfsm_tail_row *const *rows, uint32_t n, uint32_t threads) {
    work w;
    w.rows = rows;
    w.n = n;
    w.level = calfsm_kernels_level();
    atomic_init(&w.next, 0u);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = n;
    pthread_t tid[MAX_THREADS];
    uint32_t started = 0;
    for (uint32_t t = 1; t < threads; t++) {
        if (pthread_create(&tid[started], NULL, worker, &w) != 0) break;  /* fewer, then */
        started++;
    }
    worker(&w);
    for (uint32_t t = 0; t < started; t++) pthread_join(tid[t], NULL);
    int32_t failed = 0;
    for (uint32_t i = 0; i < n; i++) failed += rows[i]->status != CALFSM_TAIL_OK;
    return failed;
}
