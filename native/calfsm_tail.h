/* calfsm's batch tail: the part of a step's completion the next step waits for, for every
 * row of a job in one call (calfsm/engine/tail.py). Not part of the CalRT ABI. */
#ifndef CALFSM_TAIL_H
#define CALFSM_TAIL_H

#include <stdint.h>

#define CALFSM_TAIL_VERSION 1u
uint32_t calfsm_tail_version(void);

/* what a row asks for (mode) */
#define CALFSM_TAIL_CONVERT 0 /* convert and check only (the token is chosen elsewhere) */
#define CALFSM_TAIL_GREEDY 1  /* argmax, ties to the lowest index */
#define CALFSM_TAIL_DRAW 2    /* calfsm_sample with one 64-bit draw of the row's generator */

/* how a row ended (status) */
#define CALFSM_TAIL_OK 0        /* token chosen (or, CONVERT, the row converted and finite) */
#define CALFSM_TAIL_NONFINITE 1 /* the converted row holds a NaN/Inf (bad: its first index) */
#define CALFSM_TAIL_UNUSABLE 2  /* after the penalties the maximum is not finite, or every
                                 * token is banned: nothing drawn, the caller decides */
#define CALFSM_TAIL_EDRAW 3     /* the sampling kernel refused (token: its code) */
#define CALFSM_TAIL_SKIPPED 4   /* not run (nothing to read or write): nothing drawn */

/* One row. The caller fills the inputs (a stream keeps one, most fields set once), the
 * call fills token, bad and status. Field order is the ABI: calfsm/engine/tail.py
 * declares the same. */
typedef struct calfsm_tail_row {
    const uint16_t *src; /* BF16 bits of the row's logits (NULL: dst holds float32 already) */
    float *dst;          /* the float32 row, vocab values (NULL: nobody reads it after the
                          * token is chosen; the row is worked on in the library's scratch) */
    uint64_t vocab;
    int32_t mode;
    int32_t status;
    double inv_temp;
    uint64_t top_k;
    uint64_t top_p_q32;
    void *bitgen;        /* numpy's bitgen_t of the row's PCG64 (DRAW) */
    /* penalties, in calfsm/generate/penalties.py's order, float32 as numpy does them */
    float repetition;    /* 1: off */
    float frequency;     /* 0: off */
    float presence;      /* 0: off */
    int32_t penalized;   /* 0: skip all of the penalties and the mask below */
    const int64_t *seen; /* the repetition penalty's ids */
    uint64_t n_seen;
    const int64_t *out_ids; /* the output's ids and their counts (float32) */
    const float *out_counts;
    uint64_t n_out;
    const int64_t *banned;  /* min_tokens: ids set to -inf */
    uint64_t n_banned;
    /* constrained decoding: NULL, or vocab bytes, 0 = the token is not allowed (-inf),
     * applied after the penalties, before the token is chosen */
    const uint8_t *allowed;
    int64_t token;       /* out: the token, or the kernel's code (EDRAW) */
    int64_t bad;         /* out: NONFINITE's first index; UNUSABLE's maximum (float32
                          * bits); else -1 */
} calfsm_tail_row;

/* Every row of rows[0..n), on up to `threads` threads (the caller's included; rows are
 * taken one at a time, so uneven rows balance). Returns the rows whose status is not OK. */
int32_t calfsm_tail(calfsm_tail_row *const *rows, uint32_t n, uint32_t threads);

#endif /* CALFSM_TAIL_H */
