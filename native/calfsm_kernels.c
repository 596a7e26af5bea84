/* calfsm's host-side kernels (calfsm_kernels.h).
 *
 * The conversion is plain C that the compiler vectorises at -O2, no intrinsics: GCC's -O2
 * cost model ("very cheap") vectorises only loops whose trip count is a known multiple of
 * the vector width and that need no alias check, so the work is done in fixed-size blocks
 * on restrict pointers: BIG_BLOCK values (the accumulator below is folded across vector
 * lanes once per block, so blocks are long), then BLOCK values, then a scalar tail of
 * fewer than BLOCK. The finite check rides along in the same loop as an OR reduction:
 * (b & 0x7F80) + 0x80 carries into bit 15 exactly when the exponent bits are all set (NaN
 * or Inf), so one test at the end tells whether any value is non-finite; only then is the
 * first one looked for.
 *
 * The library is built for the baseline ISA (x86-64: SSE2, 16-byte vectors), where this
 * loop is ~1.5x slower than numpy's float32 copy of the row, which uses the widest
 * vectors the CPU has. So on x86-64 the same body is also compiled for AVX2 and
 * AVX-512BW and chosen at run time from the CPU's features (GCC and clang; elsewhere the
 * baseline loop, on aarch64 already NEON).
 */
#include "calfsm_kernels.h"

#define BLOCK 64
#define BIG_BLOCK 1024
#define EXP 0x7F80u

uint32_t calfsm_kernels_version(void) {
    return CALFSM_KERNELS_VERSION;
}

#if defined(__GNUC__) || defined(__clang__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

INLINE uint16_t convert(const uint16_t *restrict src, uint32_t *restrict dst, uint64_t n,
                        uint16_t acc) {
    for (uint64_t i = 0; i < n; i++) {
        uint16_t b = src[i];
        dst[i] = (uint32_t)b << 16;
        acc |= (uint16_t)((b & EXP) + 0x80u);
    }
    return acc;
}

/* The OR of the carry bits of all n values (bit 15 set: some value is NaN or Inf). The
 * float32 target is written as its bit patterns: numpy memory has no declared type, so
 * storing uint32_t into it is well defined. */
INLINE uint16_t convert_all(const uint16_t *restrict src, float *restrict dst, uint64_t n) {
    uint32_t *restrict bits = (uint32_t *)dst;
    uint16_t acc = 0;
    uint64_t i = 0;
    for (; n - i >= BIG_BLOCK; i += BIG_BLOCK)
        acc = convert(src + i, bits + i, BIG_BLOCK, acc);
    for (; n - i >= BLOCK; i += BLOCK) acc = convert(src + i, bits + i, BLOCK, acc);
    return convert(src + i, bits + i, n - i, acc);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MAX_LEVEL 2
__attribute__((target("avx512f,avx512bw")))
static uint16_t convert_avx512(const uint16_t *restrict src, float *restrict dst,
                               uint64_t n) {
    return convert_all(src, dst, n);
}

__attribute__((target("avx2")))
static uint16_t convert_avx2(const uint16_t *restrict src, float *restrict dst, uint64_t n) {
    return convert_all(src, dst, n);
}

int32_t calfsm_kernels_level(void) {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}
#else
#define MAX_LEVEL 0
int32_t calfsm_kernels_level(void) {
    return 0;
}
#endif

int64_t calfsm_bf16_to_f32_finite_at(const uint16_t *restrict src, float *restrict dst,
                                     uint64_t n, int32_t level) {
    uintptr_t s = (uintptr_t)src, d = (uintptr_t)dst;
    if (n && s < d + 4 * n && d < s + 2 * n) return CALFSM_OVERLAP;
    int32_t top = calfsm_kernels_level();
    if (level > top) level = top;
    uint16_t acc;
    switch (level) {
#if MAX_LEVEL >= 2
    case 2: acc = convert_avx512(src, dst, n); break;
    case 1: acc = convert_avx2(src, dst, n); break;
#endif
    default: acc = convert_all(src, dst, n); break;
    }
    if (!(acc & 0x8000u)) return -1;
    for (uint64_t i = 0; i < n; i++)
        if ((src[i] & EXP) == EXP) return (int64_t)i;
    return -1;
}

int64_t calfsm_bf16_to_f32_finite(const uint16_t *restrict src, float *restrict dst,
                                  uint64_t n) {
    return calfsm_bf16_to_f32_finite_at(src, dst, n, MAX_LEVEL);
}
