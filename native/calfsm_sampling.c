/* calfsm's sampling kernel (calfsm_sampling.h).
 *
 * What is computed is specified op by op in calfsm/generate/sampling.py (its numpy fallback is
 * the same arithmetic), so this file only says how it is made fast. Every floating-point
 * step is one IEEE-rounded operation in a fixed order, with no contraction into FMA (the
 * pragmas below; GCC's -std=c11 default too) and no excess precision (FLT_EVAL_METHOD 0;
 * else the kernel reports version 0 and calfsm uses numpy). "no-trapping-math" only lets
 * GCC if-convert the selects so that the loops vectorise; it changes no result. All after
 * the weights is integer arithmetic and the thresholds are exact order statistics, so
 * passes may be grouped and blocks skipped freely without changing the result:
 *
 * - top-k: the row's block maxima (at most KBLOCKS, vectorised); the k-th largest of them
 *   bounds the k-th largest key from below, so only the values above that bound in the
 *   blocks reaching it are gathered and radix-selected (11/11/10 bits). A large k, or a
 *   gather that overflows CAP, takes the whole-row radix select.
 * - weights, in blocks of SB values: a block whose largest key is below the top-k key, or
 *   whose largest logit already scales below S_MIN, holds no weight (rounding is
 *   monotone, so no smaller value passes) and is zeroed without computing exp; the others
 *   run a vectorised loop that also sums their masses. Block masses are kept for the
 *   draw; with top-p, each block's masses are added into a histogram of the weights' top
 *   11 bits (four copies, so that equal buckets do not wait on each other).
 * - top-p: the bucket where the masses from the top reach `need`, then that bucket's
 *   weights gathered (skipping blocks whose largest weight is below it) and radix-selected.
 * - the draw: the block masses (recomputed for the nucleus), then one block scanned.
 *
 * On x86-64 the body is also compiled for AVX2 and AVX-512 (without FMA), chosen at run
 * time like calfsm_kernels.c.
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
#endif

#include "calfsm_sampling.h"

#include <float.h>
#include <string.h>

#include "calfsm_kernels.h"
#include "calfsm_sample_ops.h"

#define CAP 2048    /* keys a select gathers on the stack instead of scanning again */

uint32_t calfsm_sampling_version(void) {
#if FLT_EVAL_METHOD == 0
    return CALFSM_SAMPLING_VERSION;
#else
    return 0;
#endif
}

/* The weights of one block, in place (weight_of, calfsm_sample_ops.h: 0 below the
 * top-k key tk). Returns the sum of their masses. */
INLINE uint64_t weights(float *restrict x, uint64_t len, double m, double inv_t,
                        uint32_t tk) {
    uint64_t sum = 0;
    for (uint64_t i = 0; i < len; i++) {
        float w = weight_of(x[i], m, inv_t, tk);
        x[i] = w;
        sum += mass_of(bits_of(w));
    }
    return sum;
}

/* Sum of the masses of the block's weights whose bits are >= tp. */
INLINE uint64_t block_mass(const float *restrict x, uint64_t len, uint32_t tp) {
    uint64_t s = 0;
    for (uint64_t i = 0; i < len; i++) {
        uint32_t b = bits_of(x[i]);
        uint64_t q = mass_of(b);
        s += b >= tp ? q : 0;
    }
    return s;
}

/* From the top bucket down, the one where a running count (or mass) reaches *need;
 * *need becomes what is still needed inside it, *above (if given) gains what is above. */
INLINE uint32_t walk32(const uint32_t *h, uint32_t top, uint64_t *need) {
    uint64_t above = 0;
    uint32_t b = top;
    while (b > 0 && above + h[b] < *need) above += h[b--];
    *need -= above;
    return b;
}

INLINE uint32_t walk64(const uint64_t *h, uint32_t top, uint64_t *need, uint64_t *above_out) {
    uint64_t above = 0;
    uint32_t b = top;
    while (b > 0 && above + h[b] < *need) above += h[b--];
    *need -= above;
    *above_out += above;
    return b;
}

/* The rank-th largest of keys[0..c) (1 <= rank <= c), radix-selected on 11/11/10 bits;
 * each walk starts at the highest bucket in use. */
INLINE uint32_t kth_of(const uint32_t *restrict keys, uint32_t c, uint64_t rank) {
    uint32_t h1[2048], h2[2048], h3[1024], t1 = 0, t2 = 0, t3 = 0;
    memset(h1, 0, sizeof h1);
    memset(h2, 0, sizeof h2);
    memset(h3, 0, sizeof h3);
    for (uint32_t j = 0; j < c; j++) {
        uint32_t b = keys[j] >> 21;
        h1[b]++;
        t1 = b > t1 ? b : t1;
    }
    uint32_t b1 = walk32(h1, t1, &rank);
    for (uint32_t j = 0; j < c; j++) {
        if ((keys[j] >> 21) != b1) continue;
        uint32_t b = (keys[j] >> 10) & 0x7FFu;
        h2[b]++;
        t2 = b > t2 ? b : t2;
    }
    uint32_t pre = b1 << 11 | walk32(h2, t2, &rank);
    for (uint32_t j = 0; j < c; j++) {
        if ((keys[j] >> 10) != pre) continue;
        uint32_t b = keys[j] & 0x3FFu;
        h3[b]++;
        t3 = b > t3 ? b : t3;
    }
    return pre << 10 | walk32(h3, t3, &rank);
}

/* The k-th largest order key of row[0..n) by a radix select over the whole row: a
 * histogram pass (kept in four copies, one per index mod 4, so that runs of values in one
 * bucket do not wait on each other's increments), then the boundary bucket gathered (or,
 * if it does not fit CAP, two more passes). */
INLINE uint32_t topk_radix(const float *restrict row, uint64_t n, uint64_t k) {
    if (n <= CAP) {  /* a small row: select among all its keys at once */
        uint32_t all[CAP];
        for (uint64_t i = 0; i < n; i++) all[i] = okey(bits_of(row[i]));
        return kth_of(all, (uint32_t)n, k);
    }
    uint32_t h1[4][2048];
    memset(h1, 0, sizeof h1);
    for (uint64_t i = 0; i < n; i++) h1[i & 3][okey(bits_of(row[i])) >> 21]++;
    for (uint32_t j = 0; j < 2048; j++) h1[0][j] += h1[1][j] + h1[2][j] + h1[3][j];
    uint64_t rank = k;
    uint32_t b1 = walk32(h1[0], 2047, &rank);
    uint32_t h2[2048], h3[1024];
    memset(h2, 0, sizeof h2);
    memset(h3, 0, sizeof h3);
    if (h1[0][b1] <= CAP) {
        /* gather the bucket without a branch: always store, advance on a match */
        uint32_t cand[CAP + 1], c = 0;   /* the count says it fits */
        for (uint64_t i = 0; i < n; i++) {
            uint32_t key = okey(bits_of(row[i]));
            cand[c] = key;
            c += (key >> 21) == b1;
        }
        return kth_of(cand, c, rank);
    }
    for (uint64_t i = 0; i < n; i++) {
        uint32_t key = okey(bits_of(row[i]));
        if ((key >> 21) == b1) h2[(key >> 10) & 0x7FFu]++;
    }
    uint32_t pre = b1 << 11 | walk32(h2, 2047, &rank);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t key = okey(bits_of(row[i]));
        if ((key >> 10) == pre) h3[key & 0x3FFu]++;
    }
    return pre << 10 | walk32(h3, 1023, &rank);
}

/* The k-th largest order key of row[0..n) (1 <= k < n); *maxk gets the largest.
 * The row is cut into at most KBLOCKS blocks and their maxima taken (vectorised); the
 * k-th largest maximum L is a lower bound of the answer (k blocks hold a value >= L), so
 * when k <= the number of blocks only the values >= L in blocks reaching L are gathered,
 * and the answer is the k-th largest of those. Else, or if they do not fit CAP, the
 * whole-row radix select. */
INLINE uint32_t topk_key(const float *restrict row, uint64_t n, uint64_t k, uint32_t *maxk) {
    uint64_t bs = block_size(n);
    uint32_t nb = (uint32_t)((n + bs - 1) / bs);
    uint32_t bmax[KBLOCKS], mx = 0;
    for (uint32_t b = 0; b < nb; b++) {
        uint64_t lo = b * bs, hi = lo + bs < n ? lo + bs : n, i = lo;
        uint32_t m = 0;
        for (; hi - i >= SB; i += SB) {
            uint32_t v = max_key(row + i, SB);
            m = v > m ? v : m;
        }
        uint32_t v = max_key(row + i, hi - i);
        bmax[b] = m = v > m ? v : m;
        mx = m > mx ? m : mx;
    }
    *maxk = mx;
    if (k > nb) return topk_radix(row, n, k);
    uint32_t low = kth_of(bmax, nb, k);
    /* gathered without a branch (always store, advance on a hit), SB values at a time
     * while fewer than CAP are held */
    uint32_t cand[CAP + SB], c = 0;
    for (uint64_t i = 0; i < n && c <= CAP; i += SB) {
        if (bmax[i / bs] < low) continue;
        uint64_t hi = i + SB < n ? i + SB : n;
        for (uint64_t j = i; j < hi; j++) {
            uint32_t key = okey(bits_of(row[j]));
            cand[c] = key;
            c += key >= low;
        }
    }
    return c <= CAP ? kth_of(cand, c, k) : topk_radix(row, n, k);
}

/* The largest weight bits t whose tokens at or above it weigh >= need in all, from the
 * first-level masses mA (by bits >> 21; weights are below 2, so 512 buckets); *mass gets
 * that weight. The boundary bucket is gathered while it fits CAP, else scanned again.
 * Blocks whose largest weight (btop, when given) is below the bucket are skipped. */
INLINE uint32_t topp_key(const float *restrict row, uint64_t n, uint64_t need,
                         const uint64_t *mA, const uint32_t *btop, uint64_t *mass) {
    uint64_t h2[2048], h3[1024];
    memset(h2, 0, sizeof h2);
    memset(h3, 0, sizeof h3);
    uint64_t above = 0;
    uint32_t bA = walk64(mA, 511, &need, &above);
    uint32_t cand[CAP + SB], c = 0;
    for (uint64_t i = 0; i < n && c <= CAP; i += SB) {
        if (btop && btop[i / SB] >> 21 < bA) continue;
        uint64_t hi = i + SB < n ? i + SB : n;
        for (uint64_t j = i; j < hi; j++) {
            uint32_t b = bits_of(row[j]);
            cand[c] = b;
            c += (b >> 21) == bA;
        }
    }
    int gathered = c <= CAP;
    if (gathered) {
        for (uint32_t j = 0; j < c; j++) h2[(cand[j] >> 10) & 0x7FFu] += mass_of(cand[j]);
    } else {
        for (uint64_t i = 0; i < n; i++) {
            uint32_t b = bits_of(row[i]);
            if ((b >> 21) == bA) h2[(b >> 10) & 0x7FFu] += mass_of(b);
        }
    }
    uint32_t b2 = walk64(h2, 2047, &need, &above);
    uint32_t pre = bA << 11 | b2;
    if (gathered) {
        for (uint32_t j = 0; j < c; j++)
            if ((cand[j] >> 10) == pre) h3[cand[j] & 0x3FFu] += mass_of(cand[j]);
    } else {
        for (uint64_t i = 0; i < n; i++) {
            uint32_t b = bits_of(row[i]);
            if ((b >> 10) == pre) h3[b & 0x3FFu] += mass_of(b);
        }
    }
    uint32_t b3 = walk64(h3, 1023, &need, &above);
    *mass = above + h3[b3];
    return pre << 10 | b3;
}

/* The masses and first-level buckets of one block's weights (vectorised); returns the
 * largest weight's bits. */
INLINE uint32_t block_buckets(const float *restrict x, uint64_t len, uint64_t *restrict q,
                              uint32_t *restrict bucket) {
    uint32_t m = 0;
    for (uint64_t i = 0; i < len; i++) {
        uint32_t b = bits_of(x[i]);
        q[i] = mass_of(b);
        bucket[i] = (b >> 21) & 511u;
        m = b > m ? b : m;
    }
    return m;
}

#define BSUMS 1024  /* block masses kept for the later passes (rows of up to BSUMS * SB) */

INLINE int64_t sample_body(float *restrict row, uint64_t n, double inv_t, uint64_t top_k,
                           uint64_t p_q, uint64_t u) {
    uint32_t tk = 0, mx = 0;
    if (top_k && top_k < n) {
        tk = topk_key(row, n, top_k, &mx);
    } else {
        uint64_t i = 0;
        for (; n - i >= SB; i += SB) {
            uint32_t b = max_key(row + i, SB);
            mx = b > mx ? b : mx;
        }
        uint32_t b = max_key(row + i, n - i);
        mx = b > mx ? b : mx;
    }
    double m = (double)key_float(mx);
    int nucleus = p_q < P_ONE;
    uint64_t mA[4][512];
    if (nucleus) memset(mA, 0, sizeof mA);
    uint64_t bsum[BSUMS];
    uint32_t btop[BSUMS];
    int sums = n <= (uint64_t)BSUMS * SB;
    uint64_t z = 0;
    for (uint64_t i = 0; i < n; i += SB) {
        uint64_t len = n - i < SB ? n - i : SB;
        float *x = row + i;
        uint32_t bm = len == SB ? max_key(x, SB) : max_key(x, len);
        uint64_t bz = 0;
        if (bm < tk || ((double)key_float(bm) - m) * inv_t < S_MIN) {
            memset(x, 0, len * sizeof *x);
        } else if (len < SB) {
            bz = weights(x, len, m, inv_t, tk);
        } else {
            bz = tk ? weights(x, SB, m, inv_t, tk) : weights(x, SB, m, inv_t, 0);
        }
        if (sums) {
            bsum[i / SB] = bz;
            btop[i / SB] = 0;
        }
        z += bz;
        if (nucleus && bz) {
            uint64_t q[SB];
            uint32_t bucket[SB];
            uint32_t top = len == SB ? block_buckets(x, SB, q, bucket)
                                     : block_buckets(x, len, q, bucket);
            if (sums) btop[i / SB] = top;
            for (uint64_t j = 0; j < len; j++) mA[j & 3][bucket[j]] += q[j];
        }
    }
    if (z == 0) return CALFSM_SAMPLE_ENOMASS;
    uint32_t tp = 0;
    uint64_t s = z;
    if (nucleus) {
        for (uint32_t j = 0; j < 512; j++) mA[0][j] += mA[1][j] + mA[2][j] + mA[3][j];
        tp = topp_key(row, n, ceil_share(z, p_q), mA[0], sums ? btop : 0, &s);
    }
    uint64_t r = mulhi(u, s), cum = 0;
    for (uint64_t i = 0; i < n; i += SB) {
        uint64_t len = n - i < SB ? n - i : SB;
        const float *x = row + i;
        uint64_t bs;
        if (sums && (!nucleus || !bsum[i / SB]))
            bs = bsum[i / SB];
        else
            bs = len == SB ? block_mass(x, SB, tp) : block_mass(x, len, tp);
        if (cum + bs > r) {
            for (uint64_t j = 0; j < len; j++) {
                uint32_t b = bits_of(x[j]);
                if (b >= tp) cum += mass_of(b);
                if (cum > r) return (int64_t)(i + j);
            }
        }
        cum += bs;
    }
    return CALFSM_SAMPLE_ENOMASS;  /* unreachable: the masses sum to s > r */
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MAX_LEVEL 2
__attribute__((target("avx512f,avx512bw")))
static int64_t sample_avx512(float *restrict row, uint64_t n, double inv_t, uint64_t top_k,
                             uint64_t p_q, uint64_t u) {
    return sample_body(row, n, inv_t, top_k, p_q, u);
}

__attribute__((target("avx2")))
static int64_t sample_avx2(float *restrict row, uint64_t n, double inv_t, uint64_t top_k,
                           uint64_t p_q, uint64_t u) {
    return sample_body(row, n, inv_t, top_k, p_q, u);
}
#else
#define MAX_LEVEL 0
#endif

int64_t calfsm_sample_at(float *row, uint64_t n, double inv_temp, uint64_t top_k,
                         uint64_t top_p_q32, uint64_t u, int32_t level) {
    if (n == 0 || n > CALFSM_SAMPLE_MAX_VOCAB || !(inv_temp > 0.0 && inv_temp <= DBL_MAX)
        || top_p_q32 == 0 || top_p_q32 > P_ONE)
        return CALFSM_SAMPLE_EINVAL;
    int32_t top = calfsm_kernels_level();
    if (level > top) level = top;
    switch (level) {
#if MAX_LEVEL >= 2
    case 2: return sample_avx512(row, n, inv_temp, top_k, top_p_q32, u);
    case 1: return sample_avx2(row, n, inv_temp, top_k, top_p_q32, u);
#endif
    default: return sample_body(row, n, inv_temp, top_k, top_p_q32, u);
    }
}

int64_t calfsm_sample(float *row, uint64_t n, double inv_temp, uint64_t top_k,
                      uint64_t top_p_q32, uint64_t u) {
    return calfsm_sample_at(row, n, inv_temp, top_k, top_p_q32, u, MAX_LEVEL);
}
