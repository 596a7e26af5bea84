/* Parser of the calbin description line format (see calrt_configure in calrt_c.h). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "emu_internal.h"

static const struct { const char *name; uint32_t size; } DTYPES[] = {
    {"S32", 4}, {"U32", 4}, {"S16", 2}, {"U16", 2}, {"S8", 1}, {"U8", 1},
    {"F32", 4}, {"F16", 2}, {"BF16", 2},
};

uint32_t emu_dtype_itemsize(const char *dtype) {
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
        if (strcmp(dtype, DTYPES[i].name) == 0) return DTYPES[i].size;
    return 0;
}

static const char *KINDS[] = {"prefill_ids", "prefill_embeds", "decode", "vision"};

void emu_config_free(emu_config *cfg) {
    if (!cfg) return;
    for (uint32_t i = 0; i < cfg->n_models; i++) {
        free(cfg->models[i].tensors);
        free(cfg->models[i].csrs);
    }
    free(cfg->models);
    free(cfg);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decode a percent-encoded field into dst[CALRT_NAME_MAX]; `=` is the empty string. */
static int decode_name(const char *src, char *dst) {
    if (strcmp(src, "=") == 0) { dst[0] = 0; return 0; }
    size_t o = 0;
    for (const char *p = src; *p; p++) {
        char c = *p;
        if (c == '%') {
            int a = hexval(p[1]), b = a < 0 ? -1 : hexval(p[2]);
            if (b < 0) return -1;
            c = (char)(a * 16 + b);
            if (c == 0) return -1;
            p += 2;
        } else if (c == '=') {
            return -1;
        }
        if (o + 1 >= CALRT_NAME_MAX) return -1;
        dst[o++] = c;
    }
    dst[o] = 0;
    return 0;
}

static int parse_i64(const char *s, int64_t *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

#define MAX_FIELDS (6 + CALRT_MAX_DIMS)

/* Split a line in place on single spaces. Returns the field count or -1. */
static int split(char *line, char **f) {
    int n = 0;
    char *p = line;
    for (;;) {
        if (n == MAX_FIELDS + 1) return -1;
        f[n++] = p;
        char *sp = strchr(p, ' ');
        if (!sp) break;
        *sp = 0;
        p = sp + 1;
    }
    for (int i = 0; i < n; i++)
        if (!*f[i]) return -1;
    return n;
}

static int add_tensor(emu_model *m, char **f, int nf, int32_t dir) {
    /* input|output name dtype byte_size ndim d0 ... */
    if (nf < 5) return -1;
    emu_tensor t;
    memset(&t, 0, sizeof t);
    if (decode_name(f[1], t.name) < 0) return -1;
    if (strlen(f[2]) >= sizeof t.dtype) return -1;
    strcpy(t.dtype, f[2]);
    t.itemsize = emu_dtype_itemsize(t.dtype);
    if (!t.itemsize) return -1;
    int64_t bs, nd;
    if (parse_i64(f[3], &bs) < 0) return -1;
    if (parse_i64(f[4], &nd) < 0 || nd < 0 || nd > CALRT_MAX_DIMS || nf != 5 + nd) return -1;
    t.ndim = (uint32_t)nd;
    for (int i = 0; i < nd; i++)
        if (parse_i64(f[5 + i], &t.shape[i]) < 0) return -1;
    /* semantic problems are checked by usable(): keep the values as written */
    t.byte_size = (uint64_t)bs;
    t.signed_byte_size = bs;
    t.direction = dir;
    /* inputs stay before outputs */
    emu_tensor *nt = realloc(m->tensors, (m->n_inputs + m->n_outputs + 1) * sizeof *nt);
    if (!nt) return -2;
    m->tensors = nt;
    uint32_t total = m->n_inputs + m->n_outputs;
    if (dir == CALRT_DIR_INPUT) {
        memmove(&nt[m->n_inputs + 1], &nt[m->n_inputs], m->n_outputs * sizeof *nt);
        nt[m->n_inputs] = t;
        m->n_inputs++;
    } else {
        nt[total] = t;
        m->n_outputs++;
    }
    return 0;
}

/* Whether element count x itemsize == byte_size, every dim positive (no overflow). */
static int tensor_ok(const emu_tensor *t) {
    if (t->ndim < 1 || t->signed_byte_size <= 0) return 0;
    uint64_t elems = 1;
    for (uint32_t i = 0; i < t->ndim; i++) {
        if (t->shape[i] <= 0) return 0;
        if ((uint64_t)t->shape[i] > (1ULL << 40) / elems) return 0;
        elems *= (uint64_t)t->shape[i];
    }
    return elems * t->itemsize == t->byte_size;
}

/* B of a model (docs/driver-protocol.md, Batches): the first dimension of its token
 * tensor when that has one ([B, n] ids, [B, n, hidden] embeddings); 1 for a tensor of
 * lower rank ([n] ids, [n, hidden] embeddings: one row). */
static uint64_t batch_of(const emu_model *m) {
    const emu_tensor *t = &m->tensors[0];
    uint32_t rank = m->kind == CALRT_KIND_PREFILL_EMBEDS ? 3 : 2;
    return t->ndim >= rank ? (uint64_t)t->shape[0] : 1;
}

/* The structural checks a device makes when it loads a calbin (SimDriver's
 * _calbin_usable): at least one model; unique non-empty names; two inputs, an output and
 * two CSRs each; consistent tensors; with B > 1 every tensor [B, ...]; a prefill output
 * of B x tile_d0 rows. Sets each model's batch. */
static int usable(emu_config *cfg) {
    if (cfg->n_models == 0) return 0;
    for (uint32_t i = 0; i < cfg->n_models; i++) {
        emu_model *m = &cfg->models[i];
        if (!m->name[0]) return 0;
        for (uint32_t k = 0; k < i; k++)
            if (strcmp(cfg->models[k].name, m->name) == 0) return 0;
        if (m->n_inputs < 2 || m->n_outputs < 1 || m->n_csrs < 2) return 0;
        for (uint32_t t = 0; t < m->n_inputs + m->n_outputs; t++)
            if (!tensor_ok(&m->tensors[t])) return 0;
        m->batch = batch_of(m);
        for (uint32_t t = 0; m->batch > 1 && t < m->n_inputs + m->n_outputs; t++) {
            const emu_tensor *x = &m->tensors[t];
            if (x->ndim < 2 || (uint64_t)x->shape[0] != m->batch) return 0;
        }
        const emu_tensor *o = &m->tensors[m->n_inputs];
        if (m->kind == CALRT_KIND_PREFILL_IDS || m->kind == CALRT_KIND_PREFILL_EMBEDS) {
            if (m->tile_d0 <= 0) return 0;
            /* no overflow: elems < 2^40 (tensor_ok), each factor >= 1 */
            uint64_t elems = o->byte_size / o->itemsize;
            uint64_t tile = (uint64_t)m->tile_d0 * (uint64_t)o->shape[o->ndim - 1];
            if (elems % m->batch || elems / m->batch != tile) return 0;
        }
    }
    return 1;
}

int32_t emu_calbin_parse(const char *text, size_t nbytes, emu_config **out) {
    if (memchr(text, 0, nbytes)) return CALRT_FILE_FORMAT_INVALID;
    char *buf = malloc(nbytes + 1);
    if (!buf) return CALRT_ALLOC_FAILED;
    memcpy(buf, text, nbytes);
    buf[nbytes] = 0;
    emu_config *cfg = calloc(1, sizeof *cfg);
    if (!cfg) { free(buf); return CALRT_ALLOC_FAILED; }
    int32_t rc = CALRT_FILE_FORMAT_INVALID;
    int line_no = 0, ended = 0;
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        size_t len = strlen(line);
        if (len && line[len - 1] == '\r') line[--len] = 0;
        char *f[MAX_FIELDS + 1];
        if (ended) goto fail;  /* nothing after `end` */
        int nf = split(line, f);
        if (nf < 0) goto fail;
        if (line_no++ == 0) {
            if (nf != 2 || strcmp(f[0], "calfsm-calbin") || strcmp(f[1], "1")) goto fail;
            continue;
        }
        emu_model *m = cfg->n_models ? &cfg->models[cfg->n_models - 1] : NULL;
        if (strcmp(f[0], "sha256") == 0 || strcmp(f[0], "calrt_version") == 0) {
            if (nf != 2) goto fail;
        } else if (strcmp(f[0], "model") == 0) {
            if (nf != 4) goto fail;
            emu_model *nm = realloc(cfg->models, (cfg->n_models + 1) * sizeof *nm);
            if (!nm) { rc = CALRT_ALLOC_FAILED; goto fail; }
            cfg->models = nm;
            m = &nm[cfg->n_models++];
            memset(m, 0, sizeof *m);
            if (decode_name(f[1], m->name) < 0) goto fail;
            m->kind = CALRT_KIND_NONE;
            if (strcmp(f[2], "-")) {
                int k = -1;
                for (int i = 0; i < 4; i++)
                    if (strcmp(f[2], KINDS[i]) == 0) k = i;
                if (k < 0) goto fail;
                m->kind = k;
            }
            m->tile_d0 = -1;
            if (strcmp(f[3], "-")) {
                int64_t d0;
                if (parse_i64(f[3], &d0) < 0) goto fail;
                m->tile_d0 = d0 <= 0 ? 0 : (d0 > (1 << 30) ? (1 << 30) : (int32_t)d0);
            }
        } else if (strcmp(f[0], "input") == 0 || strcmp(f[0], "output") == 0) {
            if (!m) goto fail;
            int r = add_tensor(m, f, nf, f[0][0] == 'i' ? CALRT_DIR_INPUT : CALRT_DIR_OUTPUT);
            if (r == -2) { rc = CALRT_ALLOC_FAILED; goto fail; }
            if (r < 0) goto fail;
        } else if (strcmp(f[0], "csr") == 0) {
            if (!m || nf != 2) goto fail;
            char (*nc)[CALRT_NAME_MAX] = realloc(m->csrs, (m->n_csrs + 1) * sizeof *nc);
            if (!nc) { rc = CALRT_ALLOC_FAILED; goto fail; }
            m->csrs = nc;
            if (decode_name(f[1], nc[m->n_csrs]) < 0) goto fail;
            m->n_csrs++;
        } else if (strcmp(f[0], "end") == 0) {
            if (nf != 1) goto fail;
            ended = 1;
        } else {
            goto fail;
        }
    }
    if (!ended) goto fail;
    free(buf);
    if (!usable(cfg)) { emu_config_free(cfg); return CALRT_INVALID_CALBIN; }
    cfg->refs = 1;
    *out = cfg;
    return CALRT_SUCCESS;
fail:
    free(buf);
    emu_config_free(cfg);
    return rc;
}
