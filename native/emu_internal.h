/* Internal types of the CalRT emulator (libcalrt_emu). Not part of the ABI. */
#ifndef EMU_INTERNAL_H
#define EMU_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <stddef.h>

#include "calrt_c.h"

typedef struct {
    char name[CALRT_NAME_MAX];
    char dtype[8];
    uint32_t itemsize;
    int32_t direction;              /* CALRT_DIR_* */
    uint32_t ndim;
    int64_t shape[CALRT_MAX_DIMS];
    uint64_t byte_size;
    int64_t signed_byte_size;       /* as written (validation) */
} emu_tensor;

typedef struct {
    char name[CALRT_NAME_MAX];
    int32_t kind;                   /* CALRT_KIND_* */
    int32_t tile_d0;                /* -1: none; 0: written but not positive */
    uint32_t n_inputs, n_outputs;   /* tensors[0..n_inputs) inputs, then outputs */
    emu_tensor *tensors;
    uint32_t n_csrs;
    char (*csrs)[CALRT_NAME_MAX];
    uint64_t batch;                 /* B (>= 1): rows of a job (emu_calbin.c batch_of) */
} emu_model;

/* A parsed calbin: shared (refcounted) by the device, its buffers and their jobs, so a
 * job orphaned by a configuration reset can still finish with its model's metadata. */
typedef struct {
    int refs;                       /* under the owning device's lock */
    uint64_t serial;                /* globally unique: the generation of model handles */
    int64_t max_seq;                /* largest token tensor of a non-decode model; 0: none */
    uint32_t n_models;
    emu_model *models;
} emu_config;

/* Parse the line format of calrt_configure. Returns 0 and *out (refs = 1), or a code. */
int32_t emu_calbin_parse(const char *text, size_t nbytes, emu_config **out);
void emu_config_free(emu_config *cfg);
uint32_t emu_dtype_itemsize(const char *dtype); /* 0: unknown dtype */

#endif
