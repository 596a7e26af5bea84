/* Host-side numeric kernels of calfsm, compiled into libcalrt_emu.so next to the emulator
 * and loaded by calfsm.engine.logits with cffi (ABI mode). Not part of the CalRT ABI of
 * calrt_c.h: a vendor shim does not implement them, and calfsm falls back to numpy when
 * the bundled library is absent or lacks them. */
#ifndef CALFSM_KERNELS_H
#define CALFSM_KERNELS_H

#include <stdint.h>

/* Bumped on any incompatible change below; calfsm uses the kernels only when the library
 * reports the version it was written for. */
#define CALFSM_KERNELS_VERSION 1u
uint32_t calfsm_kernels_version(void);

/* The widest instruction set this CPU runs the kernels with: 0 the build's baseline, on
 * x86-64 also 1 (AVX2) and 2 (AVX-512BW). */
int32_t calfsm_kernels_level(void);

/* BF16 -> FP32 of n values in one pass: dst[i] = the float whose bits are src[i] << 16
 * (exact, NaN payloads kept), all n written. Returns the index of the first NaN or +-Inf
 * (exponent bits all set), or -1 when all n are finite; CALFSM_OVERLAP, writing nothing,
 * when the two ranges overlap. */
#define CALFSM_OVERLAP (-2)
int64_t calfsm_bf16_to_f32_finite(const uint16_t *src, float *dst, uint64_t n);

/* The same at a given level (clamped to 0..calfsm_kernels_level()), so that a test can
 * check every variant this CPU runs. */
int64_t calfsm_bf16_to_f32_finite_at(const uint16_t *src, float *dst, uint64_t n,
                                     int32_t level);

#endif /* CALFSM_KERNELS_H */
