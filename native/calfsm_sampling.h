/* Token sampling of calfsm (temperature, top-k, top-p, one seeded draw) on a float32
 * logits row, in place. Compiled into libcalrt_emu.so next to the emulator and loaded by
 * calfsm.generate.sampling with cffi (ABI mode); not part of the CalRT ABI of calrt_c.h. The
 * arithmetic is specified in calfsm/generate/sampling.py, whose numpy fallback computes the same
 * token and the same consumed row bit for bit. */
#ifndef CALFSM_SAMPLING_H
#define CALFSM_SAMPLING_H

#include <stdint.h>

/* Bumped on any incompatible change below; calfsm uses the kernel only when the library
 * reports the version it was written for. */
#define CALFSM_SAMPLING_VERSION 1u
uint32_t calfsm_sampling_version(void);

/* The largest row a draw accepts: the integer masses (at most 2^40 + 2^17 each) of this
 * many tokens sum below 2^64. */
#define CALFSM_SAMPLE_MAX_VOCAB (1u << 23)
/* n is 0 or above CALFSM_SAMPLE_MAX_VOCAB, inv_temp is not a positive finite number, or
 * top_p_q32 is 0 or above 2^32. */
#define CALFSM_SAMPLE_EINVAL (-1)
/* No token has a positive mass: the row's maximum is NaN or +Inf. */
#define CALFSM_SAMPLE_ENOMASS (-2)

/* Draw one token from row[0..n) and return its index (or a negative error above).
 * inv_temp is 1/temperature; top_k keeps the tokens whose logit is at least the top_k-th
 * largest (0 or >= n: all); top_p_q32 is top_p in units of 2^-32 (2^32: all); u is one
 * uniform 64-bit draw. The row is consumed: it holds the tokens' weights afterwards. */
int64_t calfsm_sample(float *row, uint64_t n, double inv_temp, uint64_t top_k,
                      uint64_t top_p_q32, uint64_t u);

/* The same at a given instruction-set level (calfsm_kernels_level(), clamped), so that
 * a test can check every variant this CPU runs. */
int64_t calfsm_sample_at(float *row, uint64_t n, double inv_temp, uint64_t top_k,
                         uint64_t top_p_q32, uint64_t u, int32_t level);

#endif /* CALFSM_SAMPLING_H */
