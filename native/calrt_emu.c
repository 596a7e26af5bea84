/*
 * libcalrt_emu: an emulator of the calrt_c.h ABI.
 *
 * Theory of operation
 * -------------------
 * A device is a struct behind a generation-checked handle table. One mutex per device
 * guards all of its state; every API call takes it for its whole duration, and the device
 * worker thread takes it too, so the emulator has no lock ordering to get wrong (the
 * global table lock is only held to look a device up and take a reference, never while
 * waiting for a device lock).
 *
 * infer() validates, computes the job's finish time from the latency model and the
 * engines' availability, and queues it; it reads nothing from host memory. The worker
 * thread executes a job once device time has reached its finish time: it reads the
 * mapped token/position memory *then*, runs the device checks, the hash chain and writes
 * the output tile, sets the status and wakes waiters. In VIRTUAL clock mode device time
 * only moves through wait()/advance(), and due jobs are released to the worker only by a
 * host call (wait, get_status, output_bytes, infer): SimDriver's exact semantics, still
 * executed on the device thread.
 *
 * Buffers and configurations are reference counted by the jobs that use them, so a
 * stale job that survives a reset (fault STALE) can still finish and write its old
 * output array after its handles went stale.
 *
 * Batches (docs/driver-protocol.md, Batches): a model's tensors are [B, ...]. An input
 * buffer keeps B rows of KV sequence and CSRs (row 0 is what the single-row calls set)
 * and the number of rows its next job carries; an output buffer the per-row outcome of
 * its last job. A job of a B == 1 model runs exactly as before (run_single); one of a
 * B > 1 model runs row by row (run_batch), each row through the same checks and hash
 * chain as a single-row job (run_row), and a row that fails writes zeros alone.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "calrt_c.h"
#include "emu_internal.h"
#include "emu_refmodel.h"

#define MAX_DEVICES 256
#define IDX_BITS 20
#define IDX_MASK ((1ULL << IDX_BITS) - 1)
#define MAX_BUFS (1u << IDX_BITS)
#define MAX_RULES 1024
#define NEVER INT64_MAX
#define DMA_BOOKINGS 16
#define DEFAULT_TIMELINE_JOBS 256

/* ---- handles ---------------------------------------------------------------------- */

static uint64_t g_serial;  /* atomic */

static uint64_t next_serial(void) {
    return __atomic_add_fetch(&g_serial, 1, __ATOMIC_RELAXED);
}

static uint64_t make_handle(uint64_t serial, uint32_t idx) {
    return (serial << IDX_BITS) | idx;
}

/* ---- device state ------------------------------------------------------------------ */

typedef struct {
    void *ptr;            /* host memory (NULL: not mapped) */
    int sliced;
    uint64_t off, size;   /* active region when sliced */
} emu_map;

struct job;

typedef struct emu_buf {
    int is_output;
    int in_table;         /* reachable through a handle (also while stale) */
    int pins;             /* jobs referencing it */
    emu_config *cfg;      /* ref held; != device cfg: stale (before a config reset) */
    uint32_t model_idx;
    int32_t engine;
    int destroyed;
    emu_map *maps;        /* one per tensor of the model */
    uint64_t batch;       /* B of its model */
    /* input: per row, B of them (row 0: what the single-row calls set) */
    uint64_t *csr_vals;   /* [row * n_csrs + csr] */
    uint8_t *csr_set;
    int64_t *kv_seqs;     /* [row] */
    uint8_t *kv_sets;
    uint32_t rows;        /* rows of the next job (calrt_set_batch_rows; 1 when created) */
    /* output */
    int32_t status;
    int submitted;
    int has_bytes;        /* a job finished since the last map/submit */
    uint64_t *produced;   /* per tensor, bytes of the last finished job */
    struct job *job;      /* pending job (ours), if any */
    int64_t last_seq;     /* the last job's KV sequence (-1: none) and tag job id: what */
    int last_has_tag;     /* fault rules at output_bytes match */
    int64_t last_job_id;
    uint32_t last_rows;   /* rows of the last job submitted into it */
    uint8_t *row_failed;  /* [row]: that row of the last DONE_OK job failed alone */
} emu_buf;

typedef struct job {
    uint64_t id;
    emu_buf *inp, *out;   /* pinned */
    emu_config *cfg;      /* ref held */
    uint32_t model_idx;
    int32_t engine;
    int64_t seq;          /* the input buffer's (row 0's) KV sequence at submit */
    uint32_t rows;        /* rows it carries (1 on a B == 1 model) */
    int64_t fault_row;    /* the row NAN/INF/ROW_CCU_EXCEPTION hit (-1: none) */
    uint8_t *row_failed;  /* B > 1: [row] the row failed alone (set when it executes) */
    int has_tag;
    calrt_job_tag_t tag;
    int64_t finish_ns;    /* NEVER when hung */
    int64_t phase_ns[6];  /* planned start, end of H2D, compute, D2H (timeline) */
    int effect;           /* CALRT_EMU_EFFECT_* or -1 */
    int64_t n_bytes, index;
    int ghost;            /* survived a reset (STALE): out of the queue, writes no KV */
    struct job *next;
} job;

typedef struct {
    int64_t id;
    uint64_t alloc;
    uint32_t *words;      /* alloc words; past alloc everything reads as 0 */
} kv_seq;

typedef struct {
    calrt_emu_rule_t r;
    int64_t ordinal, fired;
} rule_state;

typedef struct device {
    pthread_mutex_t mu;
    pthread_cond_t work_cv;   /* worker: something to do */
    pthread_cond_t done_cv;   /* callers: a job finished */
    pthread_t worker;
    int stop, closed;
    int refs;                 /* under g_lock */
    int in_table;             /* under g_lock */

    calrt_capabilities_t caps;
    int parallel;
    emu_config *cfg;

    emu_buf **bufs;
    uint64_t *buf_serial;
    uint32_t nbufs;           /* length of the table */

    job *q_head, *q_tail;     /* every unfinished job (queued and ghosts), submission order */
    uint32_t n_queued;        /* jobs in the device queue (not ghosts) */
    uint64_t last_job_id;
    uint64_t released_id;     /* VIRTUAL: jobs with id <= this may execute when due */

    int clock_mode;
    int64_t vnow;             /* VIRTUAL device time, ns */
    int64_t comp_free, d2h_free;  /* compute unit free; the last finish (serial: device) */
    int64_t dma[DMA_BOOKINGS][2]; /* parallel: the DMA channel's bookings, sorted by start */
    uint32_t n_dma;
    double h2d_per_byte, prefill_per_token, decode_per_step, d2h_per_byte, jitter;
    double transfer_share, batch_row_share;
    int shape_graph;              /* LatencyModel.shape_cost: 0 rows, 1 graph */
    double context_per_token;     /* LatencyModel.context_token_s */
    uint32_t seed;

    calrt_emu_job_record_t *timeline;  /* ring of the last ended jobs (NULL: none yet) */
    uint32_t tl_cap, tl_len, tl_head;  /* capacity, records held, next slot */

    uint64_t kv_capacity, kv_used;
    kv_seq *seqs;
    uint32_t n_seqs, cap_seqs;

    rule_state *rules;
    uint32_t n_rules;

    uint64_t st_executed, st_aborted, st_ghosts;
} device;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static device *g_devs[MAX_DEVICES];
static uint64_t g_dev_serial[MAX_DEVICES];

/* ---- time --------------------------------------------------------------------------- */

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t dev_now(device *d) {
    return d->clock_mode == CALRT_EMU_CLOCK_VIRTUAL ? d->vnow : mono_ns();
}

static void abs_ts(int64_t ns, struct timespec *ts) {
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

static int64_t sat_add(int64_t a, int64_t b) {
    if (a == NEVER || b == NEVER) return NEVER;
    if (b > 0 && a > NEVER - b) return NEVER;
    return a + b;
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int64_t secs_to_ns(double s) {
    if (!(s > 0)) return 0;
    double ns = s * 1e9;
    if (ns >= 9.0e18) return NEVER;
    return (int64_t)llround(ns);
}

/* ---- buffers and configs ------------------------------------------------------------ */

static void cfg_unref(emu_config *cfg) {
    if (cfg && --cfg->refs == 0) emu_config_free(cfg);
}

static void buf_free(emu_buf *b) {
    cfg_unref(b->cfg);
    free(b->maps);
    free(b->csr_vals);
    free(b->csr_set);
    free(b->kv_seqs);
    free(b->kv_sets);
    free(b->row_failed);
    free(b->produced);
    free(b);
}

/* Row 0's KV sequence (what the fault filters of the buffer calls see), -1: not set. */
static int64_t buf_seq0(const emu_buf *b) { return b->kv_sets[0] ? b->kv_seqs[0] : -1; }

static void buf_maybe_free(emu_buf *b) {
    if (!b->in_table && b->pins == 0) buf_free(b);
}

static emu_model *buf_model(emu_buf *b) { return &b->cfg->models[b->model_idx]; }

/* Any buffer still in the table (live, destroyed-but-pinned or stale). */
static emu_buf *buf_any(device *d, calrt_buf_t h) {
    uint64_t idx = h & IDX_MASK, serial = h >> IDX_BITS;
    if (h == 0 || idx >= d->nbufs || !d->bufs[idx] || d->buf_serial[idx] != serial)
        return NULL;
    return d->bufs[idx];
}

/* A usable buffer: not destroyed, of the current configuration. */
static emu_buf *buf_lookup(device *d, calrt_buf_t h) {
    emu_buf *b = buf_any(d, h);
    if (!b || b->destroyed || !d->cfg || b->cfg != d->cfg) return NULL;
    return b;
}

static emu_model *model_lookup(device *d, calrt_model_t h) {
    uint64_t idx = h & IDX_MASK, serial = h >> IDX_BITS;
    if (h == 0 || !d->cfg || d->cfg->serial != serial || idx >= d->cfg->n_models) return NULL;
    return &d->cfg->models[idx];
}

/* A live buffer and one of its tensors: the tensor's index, or -(the code): the buffer
 * unknown, destroyed or of an older configuration (INVALID_STATE, before any name check),
 * the name unknown (NOT_FOUND) or a tensor of the other direction (WRONG_DIRECTION). */
static int buf_tensor(device *d, calrt_buf_t h, const char *name, emu_buf **out) {
    emu_buf *b = buf_lookup(d, h);
    *out = b;
    if (!b) return -CALRT_INVALID_STATE;
    emu_model *m = buf_model(b);
    for (uint32_t i = 0; i < m->n_inputs + m->n_outputs; i++) {
        if (strcmp(m->tensors[i].name, name) == 0) {
            if ((m->tensors[i].direction == CALRT_DIR_OUTPUT) != b->is_output)
                return -CALRT_WRONG_DIRECTION;
            return (int)i;
        }
    }
    return -CALRT_NOT_FOUND;
}

/* ---- KV ------------------------------------------------------------------------------ */

static kv_seq *kv_find(device *d, int64_t id) {
    for (uint32_t i = 0; i < d->n_seqs; i++)
        if (d->seqs[i].id == id) return &d->seqs[i];
    return NULL;
}

static void kv_clear(device *d) {
    for (uint32_t i = 0; i < d->n_seqs; i++) free(d->seqs[i].words);
    free(d->seqs);
    d->seqs = NULL;
    d->n_seqs = d->cap_seqs = 0;
    d->kv_used = 0;
}

/* ---- fault rules ------------------------------------------------------------------- */

typedef struct {
    int64_t seq_id;       /* < 0: none */
    int has_job_id;
    int64_t job_id;
    const char *name;     /* NULL: none */
    const int64_t *seqs;  /* infer on a B > 1 model: the rows' KV sequences, which the */
    uint32_t n_seqs;      /* seq_id filter matches too */
} match_ctx;

static const match_ctx NO_CTX = {-1, 0, 0, NULL, NULL, 0};

static int seq_matches(const match_ctx *c, int64_t want) {
    if (c->seq_id >= 0 && c->seq_id == want) return 1;
    for (uint32_t i = 0; i < c->n_seqs; i++)
        if (c->seqs[i] == want) return 1;
    return 0;
}

/* A call reached `point`: advance every matching rule, return the first that fires. */
static const calrt_emu_rule_t *rules_hit(device *d, int32_t point, const match_ctx *c) {
    const calrt_emu_rule_t *hit = NULL;
    for (uint32_t i = 0; i < d->n_rules; i++) {
        rule_state *rs = &d->rules[i];
        const calrt_emu_rule_t *r = &rs->r;
        if (r->point != point) continue;
        if (r->seq_id >= 0 && !seq_matches(c, r->seq_id)) continue;
        if (r->has_job_id && (!c->has_job_id || c->job_id != r->job_id)) continue;
        if (r->has_name && (!c->name || strcmp(c->name, r->name) != 0)) continue;
        int64_t ord = ++rs->ordinal;
        if (hit) continue;
        if (r->limit >= 0 && rs->fired >= r->limit) continue;
        if (ord < r->nth) continue;
        if (r->every == 0 ? ord != r->nth : (ord - r->nth) % r->every != 0) continue;
        rs->fired++;
        hit = r;
    }
    return hit;
}

/* The code of a CODE rule hit at `point`, else 0. */
static int32_t code_fault(device *d, int32_t point, const match_ctx *c) {
    const calrt_emu_rule_t *r = rules_hit(d, point, c);
    return r && r->effect == CALRT_EMU_EFFECT_CODE ? r->code : 0;
}

/* ---- job execution ----------------------------------------------------------------- */

static void job_unlink(device *d, job *j) {
    job **pp = &d->q_head, *prev = NULL;
    while (*pp && *pp != j) { prev = *pp; pp = &(*pp)->next; }
    if (!*pp) return;
    *pp = j->next;
    if (d->q_tail == j) d->q_tail = prev;
    if (!j->ghost) d->n_queued--;
}

static void job_release(job *j) {
    if (j->out->job == j) j->out->job = NULL;
    if (j->inp->job == j) j->inp->job = NULL;
    j->inp->pins--;
    j->out->pins--;
    buf_maybe_free(j->inp);
    buf_maybe_free(j->out);
    cfg_unref(j->cfg);
    free(j->row_failed);
    free(j);
}

static uint32_t rd_u32(const void *base, uint64_t byte_off, uint64_t i) {
    uint32_t v;
    memcpy(&v, (const char *)base + byte_off + 4 * i, 4);
    return v;
}

/* A position as the device compares it: S32 sign-extended, U32 as is. */
static int64_t rd_pos(const void *base, uint64_t off, uint64_t i, int is_signed) {
    uint32_t v = rd_u32(base, off, i);
    return is_signed ? (int64_t)(int32_t)v : (int64_t)v;
}

/* Bytes of one token's input: an id, or for prefill_embeds an embedding row. */
static uint64_t token_bytes(const emu_model *m) {
    const emu_tensor *t = &m->tensors[0];
    return m->kind == CALRT_KIND_PREFILL_EMBEDS
        ? (uint64_t)t->itemsize * (uint64_t)t->shape[t->ndim - 1] : t->itemsize;
}

static int computable(const emu_model *m) {
    if (m->n_inputs < 2 || m->n_outputs < 1 || m->n_csrs < 2) return 0;
    const emu_tensor *t = &m->tensors[0], *p = &m->tensors[1], *o = &m->tensors[m->n_inputs];
    int ok_t;
    if (m->kind == CALRT_KIND_DECODE || m->kind == CALRT_KIND_PREFILL_IDS)
        ok_t = !strcmp(t->dtype, "S32") || !strcmp(t->dtype, "U32");
    else if (m->kind == CALRT_KIND_PREFILL_EMBEDS)
        ok_t = t->ndim >= 2 && (!strcmp(t->dtype, "F32") || !strcmp(t->dtype, "F16")
                                || !strcmp(t->dtype, "BF16"));
    else
        return 0;
    int ok_p = !strcmp(p->dtype, "S32") || !strcmp(p->dtype, "U32");
    int ok_o = !strcmp(o->dtype, "BF16") || !strcmp(o->dtype, "U16");
    return ok_t && ok_p && ok_o;
}

static uint64_t active_bytes(const emu_buf *b, uint32_t t, const emu_tensor *ti) {
    return b->maps[t].sliced ? b->maps[t].size : ti->byte_size;
}

static uint64_t active_off(const emu_buf *b, uint32_t t) {
    return b->maps[t].sliced ? b->maps[t].off : 0;
}

/* One row of a job as the device reads it (docs/driver-protocol.md, Execution order 1;
 * Batches, What a row reads). */
typedef struct {
    uint64_t toff, poff;  /* byte offsets of its first token (or embedding row), position */
    uint64_t n, np;       /* tokens and positions it holds from there */
    uint64_t cur, total;  /* its cur_seq and total_seq */
    int64_t seq;          /* its KV sequence */
} row_in;

/* Run one row of the job's graph, reading the host memory *now*: the device checks
 * (Execution order 2), then the hash chain (KV words written, but not by a ghost) and the
 * row's logits into work[0..elems): the rows of its last chunk, zeros after them. *last:
 * the output row (of vocab values) holding the last token's logits. Returns 1 when the
 * row was written, 0 when a check failed and -1 out of memory; both write nothing (no KV,
 * no logits). */
static int run_row(device *d, const job *j, const emu_model *m, const row_in *r,
                   uint16_t *work, uint64_t elems, uint64_t *last_row) {
    const emu_tensor *pt = &m->tensors[1], *lt = &m->tensors[m->n_inputs];
    const void *tok = j->inp->maps[0].ptr, *pos = j->inp->maps[1].ptr;
    uint64_t row = token_bytes(m), n = r->n, toff = r->toff, poff = r->poff;
    int embeds = m->kind == CALRT_KIND_PREFILL_EMBEDS;
    int pos_signed = strcmp(pt->dtype, "S32") == 0;
    int decode = m->kind == CALRT_KIND_DECODE;

    /* the device checks (docs/driver-protocol.md, Execution order 2) */
    if (n < 1 || r->np != n || r->cur != n) return 0;
    int64_t last = rd_pos(pos, poff, n - 1, pos_signed);
    if ((int64_t)r->total != last + 1 || (decode && n != 1)) return 0;
    int64_t lo = last, hi = last;
    for (uint64_t i = 0; i < n; i++) {
        int64_t p = rd_pos(pos, poff, i, pos_signed);
        if (p < lo) lo = p;
        if (p > hi) hi = p;
    }
    kv_seq *s = kv_find(d, r->seq);
    int64_t alloc = s ? (int64_t)s->alloc : 0;
    if (lo < 0) return 0;
    int64_t max_seq = j->cfg->max_seq;  /* of the configuration it was submitted under */
    if (!j->ghost) {
        int64_t limit = max_seq && max_seq < alloc ? max_seq : alloc;
        if (hi >= limit) return 0;
    } else if (max_seq && hi >= max_seq) {
        return 0;
    }

    uint64_t vocab = (uint64_t)lt->shape[lt->ndim - 1];
    uint64_t rows = decode ? 1 : (m->tile_d0 > 0 ? (uint64_t)m->tile_d0 : 1);
    uint64_t start = ((n - 1) / rows) * rows;
    uint64_t nlast = n - start;
    uint32_t *hs = malloc(sizeof *hs * nlast);
    uint32_t *words = s ? s->words : NULL, *scratch = NULL;
    if (j->ghost) {  /* a stale completion reads KV and writes none */
        scratch = calloc((size_t)hi + 1, sizeof *scratch);
        if (scratch && s) {
            uint64_t k = s->alloc < (uint64_t)hi + 1 ? s->alloc : (uint64_t)hi + 1;
            memcpy(scratch, s->words, k * sizeof *scratch);
        }
        words = scratch;
    }
    if (!hs || !words) {
        free(hs);
        free(scratch);
        return -1;
    }
    for (uint64_t i = 0; i < n; i++) {
        uint32_t p = rd_u32(pos, poff, i);
        uint32_t t = embeds ? ref_embed_word((const uint8_t *)tok + toff + i * row, row)
                            : rd_u32(tok, toff, i);
        uint32_t h = ref_step(p == 0 ? REF_H_INIT : words[p - 1], t, p);
        words[p] = h;
        if (i >= start) hs[i - start] = h;
    }
    free(scratch);
    for (uint64_t k = 0; k * vocab < elems; k++) {
        uint64_t len = elems - k * vocab < vocab ? elems - k * vocab : vocab;
        if (k < nlast) ref_logits_row(hs[k], work + k * vocab, len);
        else memset(work + k * vocab, 0, len * 2);
    }
    free(hs);
    *last_row = decode ? 0 : (n - 1) % rows;
    return 1;
}

/* How many bytes of the output a job writes (SHORT_OUTPUT: fewer). */
static uint64_t output_limit(const job *j, uint64_t total) {
    if (j->effect != CALRT_EMU_EFFECT_SHORT_OUTPUT) return total;
    if (j->n_bytes < 0) return total / 2;
    return (uint64_t)j->n_bytes < total ? (uint64_t)j->n_bytes : total;
}

/* NAN / INF at element `index` (mod vocab) of output row `row` of a row's logits. */
static void poison(const job *j, uint16_t *work, uint64_t elems, uint64_t vocab,
                   uint64_t row) {
    uint64_t at = row * vocab + (uint64_t)(j->index < 0 ? 0 : j->index) % vocab;
    if (at < elems) work[at] = j->effect == CALRT_EMU_EFFECT_NAN ? 0x7FC0 : 0x7F80;
}

/* A job of a B == 1 model: its active regions are its one row; a failed check fails the
 * job, which then writes nothing. */
static int32_t run_single(device *d, job *j, const emu_model *m, uint64_t *nbytes) {
    emu_buf *in = j->inp, *out = j->out;
    const emu_tensor *pt = &m->tensors[1], *lt = &m->tensors[m->n_inputs];
    uint64_t row = token_bytes(m), tbytes = active_bytes(in, 0, &m->tensors[0]);
    if (tbytes % row) return CALRT_STATUS_DONE_CCU_EXCEPTION;
    row_in r = {active_off(in, 0), active_off(in, 1), tbytes / row,
                active_bytes(in, 1, pt) / 4, in->csr_vals[0], in->csr_vals[1], j->seq};
    uint16_t *dst = out->maps[m->n_inputs].ptr;
    uint64_t total = lt->byte_size, limit = output_limit(j, total);
    uint16_t *work = limit < total ? malloc(total) : dst;
    if (!work) return CALRT_STATUS_DONE_CCU_EXCEPTION;
    uint64_t last = 0;
    int rc = run_row(d, j, m, &r, work, total / 2, &last);
    if (rc == 1 && (j->effect == CALRT_EMU_EFFECT_NAN || j->effect == CALRT_EMU_EFFECT_INF))
        poison(j, work, total / 2, (uint64_t)lt->shape[lt->ndim - 1], last);
    if (work != dst) {
        if (rc == 1) memcpy(dst, work, limit);
        free(work);
    }
    if (rc != 1) return CALRT_STATUS_DONE_CCU_EXCEPTION;
    *nbytes = limit;
    return CALRT_STATUS_DONE_OK;
}

/* A job of a B > 1 model (docs/driver-protocol.md, Batches): row r reads the first
 * cur_seq[r] tokens and positions of row r of the input tensors and writes its logits at
 * [r, ...]. A row that fails its checks or a row fault writes zeros and no KV, alone;
 * padding rows write zeros. The job itself ends DONE_OK. */
static int32_t run_batch(device *d, job *j, const emu_model *m, uint64_t *nbytes) {
    emu_buf *in = j->inp, *out = j->out;
    const emu_tensor *tt = &m->tensors[0], *pt = &m->tensors[1];
    const emu_tensor *lt = &m->tensors[m->n_inputs];
    uint64_t b = m->batch, nc = m->n_csrs;
    uint64_t tok_row = tt->byte_size / b, pos_row = pt->byte_size / b;  /* bytes a row has */
    uint64_t tok_cap = tok_row / token_bytes(m), pos_cap = pos_row / pt->itemsize;
    uint64_t vocab = (uint64_t)lt->shape[lt->ndim - 1];
    uint64_t total = lt->byte_size, elems = total / 2 / b, limit = output_limit(j, total);
    uint16_t *dst = out->maps[m->n_inputs].ptr;
    uint16_t *work = limit < total ? malloc(total) : dst;
    if (!work) return CALRT_STATUS_DONE_CCU_EXCEPTION;
    int poisons = j->effect == CALRT_EMU_EFFECT_NAN || j->effect == CALRT_EMU_EFFECT_INF;
    for (uint64_t r = 0; r < b; r++) {
        uint16_t *w = work + r * elems;
        int written = 0;
        int faulted = j->effect == CALRT_EMU_EFFECT_ROW_CCU_EXCEPTION &&
                      j->fault_row == (int64_t)r;
        if (r < j->rows && !faulted) {
            uint64_t cur = in->csr_vals[r * nc];
            /* a row holds at most tok_cap tokens: more fails its checks */
            row_in ri = {r * tok_row, r * pos_row, cur <= tok_cap ? cur : 0,
                         cur <= pos_cap ? cur : 0, cur, in->csr_vals[r * nc + 1],
                         in->kv_seqs[r]};
            uint64_t last = 0;
            written = run_row(d, j, m, &ri, w, elems, &last) == 1;
            if (written && poisons && j->fault_row == (int64_t)r)
                poison(j, w, elems, vocab, last);
        }
        if (!written) {
            memset(w, 0, elems * 2);
            if (r < j->rows) j->row_failed[r] = 1;
        }
    }
    if (work != dst) {
        memcpy(dst, work, limit);
        free(work);
    }
    *nbytes = limit;
    return CALRT_STATUS_DONE_OK;
}

/* Run the job's graph: reads the host memory *now*. Sets *nbytes; returns the status. */
static int32_t run_job(device *d, job *j, uint64_t *nbytes) {
    const emu_model *m = &j->cfg->models[j->model_idx];
    *nbytes = 0;
    /* a row fault on a model of one row is the job's */
    int ccu = j->effect == CALRT_EMU_EFFECT_CCU_EXCEPTION ||
              (j->effect == CALRT_EMU_EFFECT_ROW_CCU_EXCEPTION && m->batch == 1);
    if (ccu || !computable(m)) return CALRT_STATUS_DONE_CCU_EXCEPTION;
    return m->batch > 1 ? run_batch(d, j, m, nbytes) : run_single(d, j, m, nbytes);
}

/* One job's timeline record: its phases, its status and when it ended. */
static void fill_record(const job *j, calrt_emu_job_record_t *r, int32_t status,
                        int64_t ended) {
    memset(r, 0, sizeof *r);
    r->job = j->id;
    r->engine = j->engine;
    r->status = status;
    r->has_tag = j->has_tag;
    r->tag = j->tag;
    memcpy(r->phase_ns, j->phase_ns, sizeof r->phase_ns);
    r->ended_ns = ended;
}

/* Append an ended job to the timeline ring (allocated on first use). */
static void timeline_add(device *d, const job *j, int32_t status, int64_t ended) {
    if (!d->tl_cap) return;
    if (!d->timeline) {
        d->timeline = calloc(d->tl_cap, sizeof *d->timeline);
        if (!d->timeline) return;  /* out of memory: the timeline is best effort */
    }
    fill_record(j, &d->timeline[d->tl_head], status, ended);
    d->tl_head = (d->tl_head + 1) % d->tl_cap;
    if (d->tl_len < d->tl_cap) d->tl_len++;
}

static void finish_job(device *d, job *j, int32_t status, uint64_t nbytes) {
    int64_t ended = j->finish_ns;
    if (status == CALRT_STATUS_DONE_ABORTED) {
        int64_t now = dev_now(d);
        if (now < ended) ended = now;
    }
    timeline_add(d, j, status, ended);
    job_unlink(d, j);
    emu_buf *out = j->out;
    if (out->job == j) {
        out->status = status;
        emu_model *m = buf_model(out);
        for (uint32_t t = 0; t < m->n_inputs + m->n_outputs; t++) out->produced[t] = 0;
        out->produced[m->n_inputs] = nbytes;
        out->has_bytes = 1;
        memset(out->row_failed, 0, out->batch);
        if (status == CALRT_STATUS_DONE_OK && j->row_failed)
            memcpy(out->row_failed, j->row_failed, out->batch);
    }
    job_release(j);
    pthread_cond_broadcast(&d->done_cv);
}

/* The job that executes next if device time is `now`: the head of the device queue, or a
 * ghost finishing strictly earlier (SimDriver._pump). NULL: none due. */
static job *due_at(device *d, int64_t now) {
    job *best = NULL;
    for (job *j = d->q_head; j; j = j->next) {
        if (!j->ghost) { best = j; break; }
    }
    if (best && best->finish_ns > now) best = NULL;
    for (job *g = d->q_head; g; g = g->next) {
        if (g->ghost && g->finish_ns <= now && (!best || g->finish_ns < best->finish_ns))
            best = g;
    }
    if (best && d->clock_mode == CALRT_EMU_CLOCK_VIRTUAL && best->id > d->released_id)
        return NULL;
    return best;
}

/* The earliest finish time among the jobs that may execute next (NEVER: none). */
static int64_t next_wake(device *d) {
    int64_t w = NEVER;
    for (job *j = d->q_head; j; j = j->next) {
        if (!j->ghost) { w = j->finish_ns; break; }
    }
    for (job *g = d->q_head; g; g = g->next)
        if (g->ghost && g->finish_ns < w) w = g->finish_ns;
    return w;
}

static void *worker_main(void *arg) {
    device *d = arg;
    pthread_mutex_lock(&d->mu);
    while (!d->stop) {
        job *j = due_at(d, dev_now(d));
        if (j) {
            uint64_t nbytes;
            int32_t st = run_job(d, j, &nbytes);
            d->st_executed++;
            finish_job(d, j, st, nbytes);
            continue;
        }
        int64_t wake = next_wake(d);
        if (wake == NEVER || d->clock_mode == CALRT_EMU_CLOCK_VIRTUAL) {
            pthread_cond_wait(&d->work_cv, &d->mu);
        } else {
            struct timespec ts;
            abs_ts(wake, &ts);
            pthread_cond_timedwait(&d->work_cv, &d->mu, &ts);
        }
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* Let the device thread execute every job whose finish time has come and wait until it
 * did (SimDriver._pump, executed on the device thread). May release the lock: callers
 * look their handles up again afterwards. */
static void drain_due(device *d) {
    if (!d->q_head) return;
    if (d->clock_mode == CALRT_EMU_CLOCK_VIRTUAL) d->released_id = d->last_job_id;
    int64_t now = dev_now(d);
    while (!d->stop && due_at(d, now)) {
        pthread_cond_signal(&d->work_cv);
        pthread_cond_wait(&d->done_cv, &d->mu);
    }
}

/* Reset or close: queued jobs end DONE_ABORTED, STALE ones become ghosts (reset), ghosts
 * are aborted too (close). */
static void abort_pending(device *d, int closing) {
    job *j = d->q_head;
    while (j) {
        job *next = j->next;
        if (!closing && j->effect == CALRT_EMU_EFFECT_STALE) {
            if (!j->ghost) {
                j->ghost = 1;
                d->n_queued--;
                d->st_ghosts++;
            }
        } else if (!closing && j->ghost) {
            /* ghosts of an earlier reset keep running */
        } else {
            d->st_aborted++;
            finish_job(d, j, CALRT_STATUS_DONE_ABORTED, 0);
        }
        j = next;
    }
    int64_t now = dev_now(d);
    d->comp_free = d->d2h_free = now;
    d->n_dma = 0;
    pthread_cond_broadcast(&d->done_cv);
    pthread_cond_signal(&d->work_cv);
}

/* ---- device table ------------------------------------------------------------------- */

static device *enter(calrt_device_t h) {
    uint64_t idx = h & IDX_MASK, serial = h >> IDX_BITS;
    device *d = NULL;
    pthread_mutex_lock(&g_lock);
    if (h && idx < MAX_DEVICES && g_devs[idx] && g_dev_serial[idx] == serial) {
        d = g_devs[idx];
        d->refs++;
    }
    pthread_mutex_unlock(&g_lock);
    if (!d) return NULL;
    pthread_mutex_lock(&d->mu);
    return d;
}

static void device_free(device *d);

static void unref(device *d) {
    pthread_mutex_lock(&g_lock);
    int last = --d->refs == 0 && !d->in_table;
    pthread_mutex_unlock(&g_lock);
    if (last) device_free(d);
}

static void leave(device *d) {
    pthread_mutex_unlock(&d->mu);
    unref(d);
}

#define ENTER(h)                                   \
    device *d = enter(h);                          \
    if (!d) return CALRT_INVALID_STATE;            \
    if (d->closed) { leave(d); return CALRT_INVALID_STATE; }

#define RETURN(rc) do { int32_t rc__ = (rc); leave(d); return rc__; } while (0)

/* ---- identity --------------------------------------------------------------------- */

uint32_t calrt_abi_version(void) { return CALRT_C_ABI_VERSION; }

int32_t calrt_runtime_version(char *buf, size_t cap) {
    static const char v[] = "0.7.6";
    if (!buf) return CALRT_INVALID_VALUE;
    if (cap < sizeof v) return CALRT_OUT_OF_RANGE;
    memcpy(buf, v, sizeof v);
    return CALRT_SUCCESS;
}

/* ---- device ------------------------------------------------------------------------ */

static void device_free(device *d) {
    /* only after the worker joined and nobody references the device */
    while (d->q_head) {
        job *j = d->q_head;
        d->q_head = j->next;
        job_release(j);
    }
    for (uint32_t i = 0; i < d->nbufs; i++) {
        if (d->bufs[i]) {
            d->bufs[i]->in_table = 0;
            buf_maybe_free(d->bufs[i]);
        }
    }
    free(d->bufs);
    free(d->buf_serial);
    cfg_unref(d->cfg);
    kv_clear(d);
    free(d->rules);
    free(d->timeline);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->work_cv);
    pthread_cond_destroy(&d->done_cv);
    free(d);
}

int32_t calrt_device_open(const char *options, calrt_device_t *out) {
    (void)options;
    if (!out) return CALRT_INVALID_VALUE;
    device *d = calloc(1, sizeof *d);
    if (!d) return CALRT_ALLOC_FAILED;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->work_cv, &ca);
    pthread_cond_init(&d->done_cv, &ca);
    pthread_condattr_destroy(&ca);
    d->caps.resets = CALRT_RESET_CCU | CALRT_RESET_CONFIGURATION | CALRT_RESET_FULL;
    d->caps.parallel_mode = 1;
    d->caps.fixed_engine_slots = 1;
    d->caps.engine_slots = 2;
    d->caps.batch_rows = 1;
    d->kv_capacity = 1u << 20;
    d->clock_mode = CALRT_EMU_CLOCK_REAL;
    d->comp_free = d->d2h_free = mono_ns();
    d->tl_cap = DEFAULT_TIMELINE_JOBS;
    d->refs = 1;  /* the table's */
    pthread_mutex_lock(&g_lock);
    int idx = -1;
    for (int i = 0; i < MAX_DEVICES; i++)
        if (!g_devs[i]) { idx = i; break; }
    uint64_t serial = next_serial();
    if (idx >= 0) {
        g_devs[idx] = d;
        g_dev_serial[idx] = serial;
        d->in_table = 1;
    }
    pthread_mutex_unlock(&g_lock);
    if (idx < 0) {
        device_free(d);
        return CALRT_ALLOC_FAILED;
    }
    if (pthread_create(&d->worker, NULL, worker_main, d) != 0) {
        pthread_mutex_lock(&g_lock);
        g_devs[idx] = NULL;
        pthread_mutex_unlock(&g_lock);
        device_free(d);
        return CALRT_ALLOC_FAILED;
    }
    *out = make_handle(serial, (uint32_t)idx);
    return CALRT_SUCCESS;
}

int32_t calrt_device_close(calrt_device_t h) {
    ENTER(h);
    drain_due(d);
    d->closed = 1;
    abort_pending(d, 1);
    d->stop = 1;
    pthread_cond_broadcast(&d->work_cv);
    pthread_cond_broadcast(&d->done_cv);
    pthread_mutex_unlock(&d->mu);
    /* the device thread stops touching host memory before close returns */
    pthread_join(d->worker, NULL);
    pthread_mutex_lock(&g_lock);
    uint64_t idx = h & IDX_MASK;
    if (g_devs[idx] == d) g_devs[idx] = NULL;
    d->in_table = 0;
    d->refs--;  /* the table's reference */
    pthread_mutex_unlock(&g_lock);
    unref(d);
    return CALRT_SUCCESS;
}

int32_t calrt_get_capabilities(calrt_device_t h, calrt_capabilities_t *out) {
    if (!out) return CALRT_INVALID_VALUE;
    ENTER(h);
    *out = d->caps;
    RETURN(CALRT_SUCCESS);
}

/* ---- configuration --------------------------------------------------------------------- */

int32_t calrt_configure(calrt_device_t h, const char *calbin, size_t nbytes) {
    if (!calbin) return CALRT_INVALID_VALUE;
    ENTER(h);
    drain_due(d);
    if (d->cfg) RETURN(CALRT_ALREADY_CONFIGURED);
    emu_config *cfg;
    int32_t rc = emu_calbin_parse(calbin, nbytes, &cfg);
    if (rc) RETURN(rc);
    rc = code_fault(d, CALRT_EMU_POINT_CONFIGURE, &NO_CTX);
    if (rc) {
        emu_config_free(cfg);
        RETURN(rc);
    }
    cfg->serial = next_serial();
    d->cfg = cfg;
    /* the most tokens (or embedding rows) of a non-decode model: of one row of a batch */
    cfg->max_seq = 0;
    for (uint32_t i = 0; i < cfg->n_models; i++) {
        emu_model *m = &cfg->models[i];
        if (m->kind == CALRT_KIND_DECODE) continue;
        int64_t e = (int64_t)(m->tensors[0].byte_size / m->batch / token_bytes(m));
        if (e > cfg->max_seq) cfg->max_seq = e;
    }
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_model_count(calrt_device_t h, uint32_t *out) {
    if (!out) return CALRT_INVALID_VALUE;
    ENTER(h);
    if (!d->cfg) RETURN(CALRT_MISSING_CONFIG);
    int32_t rc = code_fault(d, CALRT_EMU_POINT_GET_ALL_MODELS, &NO_CTX);
    if (rc) RETURN(rc);
    *out = d->cfg->n_models;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_model_at(calrt_device_t h, uint32_t index, calrt_model_t *out) {
    if (!out) return CALRT_INVALID_VALUE;
    ENTER(h);
    if (!d->cfg) RETURN(CALRT_MISSING_CONFIG);
    if (index >= d->cfg->n_models) RETURN(CALRT_OUT_OF_RANGE);
    *out = make_handle(d->cfg->serial, index);
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_model_lookup(calrt_device_t h, const char *name, calrt_model_t *out) {
    if (!out || !name) return CALRT_INVALID_VALUE;
    ENTER(h);
    if (!d->cfg) RETURN(CALRT_MISSING_CONFIG);
    for (uint32_t i = 0; i < d->cfg->n_models; i++) {
        if (strcmp(d->cfg->models[i].name, name) == 0) {
            match_ctx c = {-1, 0, 0, name, NULL, 0};
            int32_t rc = code_fault(d, CALRT_EMU_POINT_MODEL, &c);
            if (rc) RETURN(rc);
            *out = make_handle(d->cfg->serial, i);
            RETURN(CALRT_SUCCESS);
        }
    }
    RETURN(CALRT_NOT_FOUND);
}

int32_t calrt_model_info(calrt_device_t h, calrt_model_t model, calrt_model_info_t *out) {
    if (!out) return CALRT_INVALID_VALUE;
    ENTER(h);
    emu_model *m = model_lookup(d, model);
    if (!m) RETURN(CALRT_INVALID_STATE);
    memset(out, 0, sizeof *out);
    memcpy(out->name, m->name, sizeof out->name);
    out->kind = m->kind;
    out->tile_d0 = m->tile_d0;
    out->n_inputs = m->n_inputs;
    out->n_outputs = m->n_outputs;
    out->n_csrs = m->n_csrs;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_model_tensor(calrt_device_t h, calrt_model_t model, uint32_t index,
                           calrt_tensor_info_t *out) {
    if (!out) return CALRT_INVALID_VALUE;
    ENTER(h);
    emu_model *m = model_lookup(d, model);
    if (!m) RETURN(CALRT_INVALID_STATE);
    if (index >= m->n_inputs + m->n_outputs) RETURN(CALRT_OUT_OF_RANGE);
    const emu_tensor *t = &m->tensors[index];
    memset(out, 0, sizeof *out);
    memcpy(out->name, t->name, sizeof out->name);
    memcpy(out->dtype, t->dtype, sizeof out->dtype);
    out->direction = t->direction;
    out->ndim = t->ndim;
    memcpy(out->shape, t->shape, sizeof out->shape);
    out->byte_size = t->byte_size;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_model_csr(calrt_device_t h, calrt_model_t model, uint32_t index, char *buf,
                        size_t cap) {
    if (!buf) return CALRT_INVALID_VALUE;
    ENTER(h);
    emu_model *m = model_lookup(d, model);
    if (!m) RETURN(CALRT_INVALID_STATE);
    if (index >= m->n_csrs || strlen(m->csrs[index]) + 1 > cap) RETURN(CALRT_OUT_OF_RANGE);
    strcpy(buf, m->csrs[index]);
    RETURN(CALRT_SUCCESS);
}

/* ---- buffers ---------------------------------------------------------------------------- */

static emu_buf *buf_new(emu_config *cfg, uint32_t model_idx, int is_output, int32_t engine) {
    emu_model *m = &cfg->models[model_idx];
    uint32_t nt = m->n_inputs + m->n_outputs;
    size_t nc = m->n_csrs ? m->n_csrs : 1;
    emu_buf *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->batch = m->batch;
    b->maps = calloc(nt ? nt : 1, sizeof *b->maps);
    b->produced = calloc(nt ? nt : 1, sizeof *b->produced);
    b->csr_vals = calloc(m->batch, nc * sizeof *b->csr_vals);
    b->csr_set = calloc(m->batch, nc);
    b->kv_seqs = calloc(m->batch, sizeof *b->kv_seqs);
    b->kv_sets = calloc(m->batch, 1);
    b->row_failed = calloc(m->batch, 1);
    if (!b->maps || !b->produced || !b->csr_vals || !b->csr_set || !b->kv_seqs ||
        !b->kv_sets || !b->row_failed) {
        free(b->maps);
        free(b->produced);
        free(b->csr_vals);
        free(b->csr_set);
        free(b->kv_seqs);
        free(b->kv_sets);
        free(b->row_failed);
        free(b);
        return NULL;
    }
    b->rows = 1;
    b->last_rows = 1;
    b->is_output = is_output;
    b->cfg = cfg;
    cfg->refs++;
    b->model_idx = model_idx;
    b->engine = engine;
    b->status = CALRT_STATUS_IDLE;
    b->last_seq = -1;
    return b;
}

static int64_t buf_insert(device *d, emu_buf *b) {
    uint32_t idx = d->nbufs;
    for (uint32_t i = 0; i < d->nbufs; i++)
        if (!d->bufs[i]) { idx = i; break; }
    if (idx == d->nbufs) {
        if (d->nbufs >= MAX_BUFS) return -1;
        uint32_t n = d->nbufs ? d->nbufs * 2 : 16;
        if (n > MAX_BUFS) n = MAX_BUFS;
        emu_buf **nb = realloc(d->bufs, n * sizeof *nb);
        if (!nb) return -1;
        d->bufs = nb;
        uint64_t *ns = realloc(d->buf_serial, n * sizeof *ns);
        if (!ns) return -1;
        d->buf_serial = ns;
        for (uint32_t i = d->nbufs; i < n; i++) { nb[i] = NULL; ns[i] = 0; }
        d->nbufs = n;
    }
    uint64_t serial = next_serial();
    d->bufs[idx] = b;
    d->buf_serial[idx] = serial;
    b->in_table = 1;
    return (int64_t)make_handle(serial, idx);
}

/* Drop a handle from the table; the struct lives on while a job pins it. */
static void buf_remove(device *d, calrt_buf_t h) {
    uint64_t idx = h & IDX_MASK;
    emu_buf *b = d->bufs[idx];
    d->bufs[idx] = NULL;
    d->buf_serial[idx] = 0;
    b->in_table = 0;
    buf_maybe_free(b);
}

int32_t calrt_create_buffers(calrt_device_t h, calrt_model_t model, int32_t engine,
                             calrt_buf_t *inp, calrt_buf_t *out) {
    if (!inp || !out) return CALRT_INVALID_VALUE;
    ENTER(h);
    if (!model_lookup(d, model)) RETURN(CALRT_INVALID_STATE);
    if (engine != CALRT_ENGINE_AUTO && engine != CALRT_ENGINE_PING &&
        engine != CALRT_ENGINE_PONG)
        RETURN(CALRT_INVALID_VALUE);
    if (engine != CALRT_ENGINE_AUTO && !d->caps.fixed_engine_slots) RETURN(CALRT_UNSUPPORTED);
    int32_t rc = code_fault(d, CALRT_EMU_POINT_CREATE_BUFFERS, &NO_CTX);
    if (rc) RETURN(rc);
    uint32_t mi = (uint32_t)(model & IDX_MASK);
    emu_buf *bi = buf_new(d->cfg, mi, 0, engine), *bo = buf_new(d->cfg, mi, 1, engine);
    int64_t hi = -1, ho = -1;
    if (bi && bo) {
        hi = buf_insert(d, bi);
        if (hi >= 0) ho = buf_insert(d, bo);
    }
    if (hi < 0 || ho < 0) {
        if (hi >= 0) buf_remove(d, (calrt_buf_t)hi);
        else if (bi) buf_free(bi);
        if (bo) buf_free(bo);
        RETURN(CALRT_ALLOC_FAILED);
    }
    *inp = (calrt_buf_t)hi;
    *out = (calrt_buf_t)ho;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_destroy_buffers(calrt_device_t h, calrt_buf_t inp, calrt_buf_t out) {
    ENTER(h);
    emu_buf *bi = buf_lookup(d, inp), *bo = buf_lookup(d, out);
    if (!bi || !bo) RETURN(CALRT_INVALID_STATE);
    if (bi->is_output || !bo->is_output) RETURN(CALRT_WRONG_DIRECTION);
    drain_due(d);
    bi = buf_lookup(d, inp);
    bo = buf_lookup(d, out);
    if (!bi || !bo) RETURN(CALRT_INVALID_STATE);
    if (bi->job || bo->job) RETURN(CALRT_DEVICE_BUSY);
    match_ctx c = {buf_seq0(bi), 0, 0, NULL, NULL, 0};
    int32_t rc = code_fault(d, CALRT_EMU_POINT_DESTROY_BUFFERS, &c);
    if (rc) RETURN(rc);
    bi->destroyed = bo->destroyed = 1;
    for (uint32_t t = 0; t < buf_model(bi)->n_inputs + buf_model(bi)->n_outputs; t++)
        bi->maps[t].ptr = bo->maps[t].ptr = NULL;
    buf_remove(d, inp);
    buf_remove(d, out);
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_release_buffer(calrt_device_t h, calrt_buf_t buf) {
    ENTER(h);
    emu_buf *b = buf_any(d, buf);
    if (!b) RETURN(CALRT_INVALID_STATE);
    int busy = b->pins != 0;
    buf_remove(d, buf);
    RETURN(busy ? CALRT_DEVICE_BUSY : CALRT_SUCCESS);
}

/* Common prologue of the calls that change a buffer: handle, then after a drain the
 * busy check (SimDriver: checks, _pump, `buf.job is not None` -> DEVICE_BUSY). */
#define BUF_BUSY_CHECK(b, h)                                 \
    do {                                                     \
        drain_due(d);                                        \
        (b) = buf_lookup(d, (h));                            \
        if (!(b)) RETURN(CALRT_INVALID_STATE);               \
        if ((b)->job) RETURN(CALRT_DEVICE_BUSY);             \
    } while (0)

int32_t calrt_map_buf(calrt_device_t h, calrt_buf_t buf, const char *tensor, void *host,
                      uint64_t nbytes, const char *dtype) {
    if (!tensor || !dtype) return CALRT_INVALID_VALUE;
    ENTER(h);
    emu_buf *b;
    int t = buf_tensor(d, buf, tensor, &b);
    if (t < 0) RETURN(-t);
    const emu_tensor *ti = &buf_model(b)->tensors[t];
    if (strcmp(ti->dtype, dtype) != 0) RETURN(CALRT_DTYPE_MISMATCH);
    if (nbytes != ti->byte_size) RETURN(CALRT_SHAPE_MISMATCH);
    if (!host) RETURN(CALRT_INVALID_VALUE);
    BUF_BUSY_CHECK(b, buf);
    match_ctx c = {buf_seq0(b), 0, 0, tensor, NULL, 0};
    int32_t rc = code_fault(d, CALRT_EMU_POINT_MAP_BUFFER, &c);
    if (rc) RETURN(rc);
    b->maps[t].ptr = host;
    if (b->is_output) {
        b->status = CALRT_STATUS_IDLE;
        b->submitted = 0;
        b->has_bytes = 0;
    }
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_slice_tensor(calrt_device_t h, calrt_buf_t buf, const char *tensor,
                           int64_t offset, int64_t size) {
    if (!tensor) return CALRT_INVALID_VALUE;
    ENTER(h);
    emu_buf *b;
    int t = buf_tensor(d, buf, tensor, &b);
    if (t < 0) RETURN(-t);
    const emu_tensor *ti = &buf_model(b)->tensors[t];
    if (size <= 0 || offset < 0 || (uint64_t)offset > ti->byte_size ||
        (uint64_t)size > ti->byte_size - (uint64_t)offset)
        RETURN(CALRT_OUT_OF_RANGE);
    if (offset % ti->itemsize || size % ti->itemsize) RETURN(CALRT_INVALID_VALUE);
    BUF_BUSY_CHECK(b, buf);
    match_ctx c = {buf_seq0(b), 0, 0, tensor, NULL, 0};
    int32_t rc = code_fault(d, CALRT_EMU_POINT_SLICE_TENSOR, &c);
    if (rc) RETURN(rc);
    b->maps[t].sliced = 1;
    b->maps[t].off = (uint64_t)offset;
    b->maps[t].size = (uint64_t)size;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_undo_slice(calrt_device_t h, calrt_buf_t buf, const char *tensor) {
    if (!tensor) return CALRT_INVALID_VALUE;
    ENTER(h);
    emu_buf *b;
    int t = buf_tensor(d, buf, tensor, &b);
    if (t < 0) RETURN(-t);
    BUF_BUSY_CHECK(b, buf);
    match_ctx c = {buf_seq0(b), 0, 0, tensor, NULL, 0};
    int32_t rc = code_fault(d, CALRT_EMU_POINT_UNDO_SLICE, &c);
    if (rc) RETURN(rc);
    b->maps[t].sliced = 0;
    RETURN(CALRT_SUCCESS);
}

/* calrt_set_csr of row `row` (docs/driver-protocol.md, Batches: the single-row checks,
 * then the row, then busy and the fault point set_csr). */
static int32_t set_csr_row(device *d, calrt_buf_t inp, const char *name, uint64_t row,
                           int64_t value) {
    emu_buf *b = buf_lookup(d, inp);
    if (!b) return CALRT_INVALID_STATE;
    if (b->is_output) return CALRT_WRONG_DIRECTION;
    emu_model *m = buf_model(b);
    int c = -1;
    for (uint32_t i = 0; i < m->n_csrs; i++)
        if (strcmp(m->csrs[i], name) == 0) { c = (int)i; break; }
    if (c < 0) return CALRT_NOT_FOUND;
    if (value < 0 || value > 0xFFFFFFFFLL) return CALRT_INVALID_VALUE;
    if (row >= b->batch) return CALRT_INVALID_VALUE;
    drain_due(d);
    b = buf_lookup(d, inp);
    if (!b) return CALRT_INVALID_STATE;
    if (b->job) return CALRT_DEVICE_BUSY;
    match_ctx mc = {buf_seq0(b), 0, 0, name, NULL, 0};
    int32_t rc = code_fault(d, CALRT_EMU_POINT_SET_CSR, &mc);
    if (rc) return rc;
    /* every CSR of that name (a calbin may list one twice) */
    for (uint32_t i = 0; i < m->n_csrs; i++) {
        if (strcmp(m->csrs[i], name) == 0) {
            b->csr_vals[row * m->n_csrs + i] = (uint64_t)value;
            b->csr_set[row * m->n_csrs + i] = 1;
        }
    }
    return CALRT_SUCCESS;
}

int32_t calrt_set_csr(calrt_device_t h, calrt_buf_t inp, const char *name, int64_t value) {
    if (!name) return CALRT_INVALID_VALUE;
    ENTER(h);
    RETURN(set_csr_row(d, inp, name, 0, value));
}

/* calrt_set_kv_seq of row `row` (the single-row checks, then the row, then busy and the
 * fault point set_kv_seq, whose seq_id is the argument). */
static int32_t set_kv_seq_row(device *d, calrt_buf_t inp, uint64_t row, int64_t seq_id) {
    emu_buf *b = buf_lookup(d, inp);
    if (!b) return CALRT_INVALID_STATE;
    if (b->is_output) return CALRT_WRONG_DIRECTION;
    if (seq_id < 0 || seq_id > 0x7FFFFFFFLL) return CALRT_INVALID_VALUE;
    if (row >= b->batch) return CALRT_INVALID_VALUE;
    drain_due(d);
    b = buf_lookup(d, inp);
    if (!b) return CALRT_INVALID_STATE;
    if (b->job) return CALRT_DEVICE_BUSY;
    match_ctx mc = {seq_id, 0, 0, NULL, NULL, 0};
    int32_t rc = code_fault(d, CALRT_EMU_POINT_SET_KV_SEQ, &mc);
    if (rc) return rc;
    b->kv_seqs[row] = seq_id;
    b->kv_sets[row] = 1;
    return CALRT_SUCCESS;
}

int32_t calrt_set_kv_seq(calrt_device_t h, calrt_buf_t inp, int64_t seq_id) {
    ENTER(h);
    RETURN(set_kv_seq_row(d, inp, 0, seq_id));
}

/* ---- batches ------------------------------------------------------------------------ */

/* The batch setters exist only with the batch_rows capability (after the handle checks). */
static int32_t batch_calls(device *d, calrt_buf_t inp) {
    emu_buf *b = buf_lookup(d, inp);
    if (!b) return CALRT_INVALID_STATE;
    if (b->is_output) return CALRT_WRONG_DIRECTION;
    return d->caps.batch_rows ? CALRT_SUCCESS : CALRT_UNSUPPORTED;
}

int32_t calrt_set_batch_rows(calrt_device_t h, calrt_buf_t inp, uint32_t rows) {
    ENTER(h);
    int32_t rc = batch_calls(d, inp);
    if (rc) RETURN(rc);
    emu_buf *b = buf_lookup(d, inp);
    if (rows < 1 || rows > b->batch) RETURN(CALRT_INVALID_VALUE);
    BUF_BUSY_CHECK(b, inp);
    match_ctx mc = {buf_seq0(b), 0, 0, NULL, NULL, 0};
    rc = code_fault(d, CALRT_EMU_POINT_SET_BATCH_ROWS, &mc);
    if (rc) RETURN(rc);
    b->rows = rows;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_set_kv_seq_row(calrt_device_t h, calrt_buf_t inp, uint32_t row,
                             int64_t seq_id) {
    ENTER(h);
    int32_t rc = batch_calls(d, inp);
    RETURN(rc ? rc : set_kv_seq_row(d, inp, row, seq_id));
}

int32_t calrt_set_csr_row(calrt_device_t h, calrt_buf_t inp, const char *name, uint32_t row,
                          int64_t value) {
    if (!name) return CALRT_INVALID_VALUE;
    ENTER(h);
    int32_t rc = batch_calls(d, inp);
    RETURN(rc ? rc : set_csr_row(d, inp, name, row, value));
}

/* A row's outcome (calrt_get_row_status; docs/driver-protocol.md, Batches, Row status). */
static int32_t row_status(const emu_buf *b, uint32_t row) {
    if (b->status == CALRT_STATUS_IDLE || row >= b->batch || row >= b->last_rows)
        return CALRT_STATUS_IDLE;
    if (b->status == CALRT_STATUS_DONE_OK && b->row_failed[row])
        return CALRT_STATUS_DONE_CCU_EXCEPTION;
    return b->status;
}

int32_t calrt_get_row_status(calrt_device_t h, calrt_buf_t out, uint32_t row,
                             int32_t *status) {
    if (!status) return CALRT_INVALID_VALUE;
    ENTER(h);
    emu_buf *b = buf_any(d, out);
    if (!b || !b->is_output) RETURN(CALRT_INVALID_STATE);
    drain_due(d);
    b = buf_any(d, out);
    if (!b) RETURN(CALRT_INVALID_STATE);
    *status = row_status(b, row);
    RETURN(CALRT_SUCCESS);
}

/* ---- execution ------------------------------------------------------------------------ */

/* Book `len` ns of the DMA channel in its first free gap at or after `earliest`; returns
 * the start (SimDriver._book_dma). Bookings that ended by `now` are dropped first. */
static int64_t book_dma(device *d, int64_t now, int64_t earliest, int64_t len) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < d->n_dma; i++) {
        if (d->dma[i][1] > now) {
            d->dma[n][0] = d->dma[i][0];
            d->dma[n][1] = d->dma[i][1];
            n++;
        }
    }
    int64_t t = earliest;
    for (uint32_t i = 0; i < n; i++) {   /* sorted by start, never overlapping */
        if (d->dma[i][1] <= t) continue;
        if (d->dma[i][0] >= sat_add(t, len)) break;
        t = d->dma[i][1];
    }
    if (n == DMA_BOOKINGS) {   /* cannot happen with two jobs in flight; stay correct */
        for (uint32_t i = 0; i < n; i++) t = max64(t, d->dma[i][1]);
        n = 0;
    }
    uint32_t at = n;
    while (at > 0 && d->dma[at - 1][0] > t) {
        d->dma[at][0] = d->dma[at - 1][0];
        d->dma[at][1] = d->dma[at - 1][1];
        at--;
    }
    d->dma[at][0] = t;
    d->dma[at][1] = sat_add(t, len);
    d->n_dma = n + 1;
    return t;
}

/* Finish time of a job submitted now, booking DMA and compute (SimDriver._schedule). A
 * job of a B > 1 model moves each row's cur_seq tokens and positions and computes the
 * tokens of all its rows (prefill) or a decode step priced by batch_row_share. */
static int64_t schedule(device *d, job *j, emu_buf *bi, emu_model *m, int hang) {
    int64_t now = dev_now(d);
    uint64_t in_bytes = 0, n_tokens = 0, longest = 0, context = 0;
    if (m->batch > 1) {
        uint64_t tb = token_bytes(m), pb = m->tensors[1].itemsize;
        for (uint32_t r = 0; r < j->rows; r++) {
            uint64_t cur = bi->csr_vals[(uint64_t)r * m->n_csrs];
            n_tokens += cur;
            if (cur > longest) longest = cur;
            context += bi->csr_vals[(uint64_t)r * m->n_csrs + 1];
            in_bytes += cur * tb + cur * pb;
        }
    } else {
        for (uint32_t t = 0; t < m->n_inputs; t++)
            in_bytes += active_bytes(bi, t, &m->tensors[t]);
        n_tokens = longest = active_bytes(bi, 0, &m->tensors[0]) / 4;
        context = bi->csr_vals[1];
    }
    /* shape cost (LatencyModel.compute_s): a static graph pays for all its rows, padded
     * ones included, each as long as the longest and attending over the whole window */
    double paid_rows = (double)j->rows;
    if (d->shape_graph) {
        paid_rows = (double)(m->batch > j->rows ? m->batch : j->rows);
        n_tokens = (uint64_t)paid_rows * longest;
        context = (uint64_t)paid_rows * (uint64_t)(j->cfg->max_seq > 0 ? j->cfg->max_seq : 0);
    }
    double factor = 1.0;
    if (d->jitter != 0.0) {
        uint32_t u = ref_fmix32(d->seed ^ (uint32_t)(j->id * 0x9E3779B1u));
        factor = 1.0 + d->jitter * (2.0 * (double)u / 4294967296.0 - 1.0);
    }
    double comp_s = m->kind == CALRT_KIND_DECODE
        ? d->decode_per_step * (1.0 + d->batch_row_share * (paid_rows - 1.0))
              + d->context_per_token * (double)context
        : d->prefill_per_token * (double)n_tokens;
    double h2d_s = (double)in_bytes * d->h2d_per_byte * factor;
    comp_s *= factor;
    double d2h_s = (double)m->tensors[m->n_inputs].byte_size * d->d2h_per_byte * factor;
    if (d->transfer_share != 0.0) {  /* LatencyModel.transfer_share: same total, re-divided */
        double total = h2d_s + comp_s + d2h_s;
        h2d_s = d2h_s = total * d->transfer_share / 2;
        comp_s = total * (1.0 - d->transfer_share);
    }
    int64_t h2d = secs_to_ns(h2d_s);
    int64_t comp = secs_to_ns(comp_s);
    int64_t d2h = secs_to_ns(d2h_s);
    if (hang) comp = NEVER;
    int64_t h2d_start, comp_start, comp_end, d2h_start, fin;
    if (d->parallel) {
        /* one DMA channel for H2D and D2H, one compute unit, each taken in turn */
        h2d_start = book_dma(d, now, now, h2d);
        comp_start = max64(sat_add(h2d_start, h2d), d->comp_free);
        comp_end = sat_add(comp_start, comp);
        d->comp_free = comp_end;
        d2h_start = book_dma(d, now, comp_end, d2h);
        fin = sat_add(d2h_start, d2h);
        d->d2h_free = max64(d->d2h_free, fin);
    } else {
        h2d_start = max64(now, d->d2h_free);
        comp_start = sat_add(h2d_start, h2d);
        comp_end = sat_add(comp_start, comp);
        d2h_start = comp_end;
        fin = sat_add(d2h_start, d2h);
        d->comp_free = d->d2h_free = fin;
    }
    int64_t ph[6] = {h2d_start, sat_add(h2d_start, h2d), comp_start, comp_end, d2h_start, fin};
    memcpy(j->phase_ns, ph, sizeof ph);
    return fin;
}

static int32_t submit(device *d, calrt_model_t model, calrt_buf_t inp, calrt_buf_t out,
                      int32_t engine, const calrt_job_tag_t *tag) {
    if (!d->cfg) return CALRT_MISSING_CONFIG;
    emu_model *m = model_lookup(d, model);
    emu_buf *bi = buf_lookup(d, inp), *bo = buf_lookup(d, out);
    if (!m || !bi || !bo) return CALRT_INVALID_STATE;
    uint32_t mi = (uint32_t)(model & IDX_MASK);
    if (bi->model_idx != mi || bo->model_idx != mi || bi->is_output || !bo->is_output)
        return CALRT_INVALID_VALUE;
    if (engine >= 0 && bi->engine != CALRT_ENGINE_AUTO && bi->engine != engine)
        return CALRT_INVALID_VALUE;
    for (uint32_t t = 0; t < m->n_inputs; t++)
        if (!bi->maps[t].ptr) return CALRT_MISSING_CONFIG;
    if (m->n_outputs < 1 || m->n_csrs < 2 || !bo->maps[m->n_inputs].ptr || !bi->kv_sets[0] ||
        !bi->csr_set[0] || !bi->csr_set[1])
        return CALRT_MISSING_CONFIG;
    /* docs/driver-protocol.md, Batches: every row of the job set up, on its own sequence,
     * each reading its own prefix (no slices) */
    uint32_t rows = bi->rows;
    for (uint32_t r = 1; r < rows; r++) {
        const uint8_t *cs = &bi->csr_set[(uint64_t)r * m->n_csrs];
        if (!bi->kv_sets[r] || !cs[0] || !cs[1]) return CALRT_MISSING_CONFIG;
    }
    if (m->batch > 1) {
        for (uint32_t r = 1; r < rows; r++)
            for (uint32_t k = 0; k < r; k++)
                if (bi->kv_seqs[k] == bi->kv_seqs[r]) return CALRT_INVALID_VALUE;
        for (uint32_t t = 0; t < m->n_inputs; t++)
            if (bi->maps[t].sliced) return CALRT_INVALID_VALUE;
    }
    drain_due(d);
    m = model_lookup(d, model);
    bi = buf_lookup(d, inp);
    bo = buf_lookup(d, out);
    if (!m || !bi || !bo) return CALRT_INVALID_STATE;
    if (bo->job || bi->job) return CALRT_DEVICE_BUSY;
    int32_t eng = 0;
    if (d->parallel) {
        int busy[2] = {0, 0};
        for (job *j = d->q_head; j; j = j->next)
            if (!j->ghost && j->engine >= 0 && j->engine < 2) busy[j->engine] = 1;
        uint32_t slots = d->caps.engine_slots > 1 ? (uint32_t)d->caps.engine_slots : 1u;
        if (d->n_queued >= slots) return CALRT_DEVICE_BUSY;
        eng = engine >= 0 ? engine : (bi->engine >= 0 ? bi->engine : (busy[0] ? 1 : 0));
        if (busy[eng]) return CALRT_DEVICE_BUSY;
    } else if (d->n_queued) {
        return CALRT_DEVICE_BUSY;
    }
    int batch = m->batch > 1;
    match_ctx c = {tag ? tag->seq_id : bi->kv_seqs[0], tag != NULL, tag ? tag->job_id : 0,
                   NULL, batch ? bi->kv_seqs : NULL, batch ? rows : 0};
    const calrt_emu_rule_t *r = rules_hit(d, CALRT_EMU_POINT_INFER, &c);
    if (r && r->effect == CALRT_EMU_EFFECT_CODE) return r->code;
    job *j = calloc(1, sizeof *j);
    if (!j) return CALRT_ALLOC_FAILED;
    if (batch && !(j->row_failed = calloc(m->batch, 1))) {
        free(j);
        return CALRT_ALLOC_FAILED;
    }
    j->id = ++d->last_job_id;
    j->inp = bi;
    j->out = bo;
    bi->pins++;
    bo->pins++;
    j->cfg = d->cfg;
    d->cfg->refs++;
    j->model_idx = mi;
    j->engine = eng;
    j->seq = bi->kv_seqs[0];
    j->rows = rows;
    if (tag) {
        j->has_tag = 1;
        j->tag = *tag;
    }
    j->effect = r ? r->effect : -1;
    j->n_bytes = r ? r->n_bytes : -1;
    j->index = r ? r->index : 0;
    /* the row a NAN/INF/ROW_CCU_EXCEPTION rule hits: the one on the rule's sequence, row 0
     * without one; none when no row is on it (the rule matched the tag's sequence) */
    j->fault_row = r && r->seq_id < 0 ? 0 : -1;
    if (r && r->seq_id >= 0)
        for (uint32_t k = 0; k < rows; k++)
            if (bi->kv_seqs[k] == r->seq_id) j->fault_row = k;
    j->finish_ns = schedule(d, j, bi, m, j->effect == CALRT_EMU_EFFECT_HANG);
    if (d->q_tail) d->q_tail->next = j;
    else d->q_head = j;
    d->q_tail = j;
    d->n_queued++;
    bi->job = bo->job = j;
    bo->last_seq = j->seq;
    bo->last_has_tag = j->has_tag;
    bo->last_job_id = j->has_tag ? j->tag.job_id : 0;
    bo->last_rows = rows;
    bo->submitted = 1;
    bo->has_bytes = 0;
    bo->status = CALRT_STATUS_PENDING;
    pthread_cond_signal(&d->work_cv);
    return CALRT_SUCCESS;
}

int32_t calrt_infer(calrt_device_t h, calrt_model_t model, calrt_buf_t inp, calrt_buf_t out,
                    const calrt_job_tag_t *tag) {
    ENTER(h);
    RETURN(submit(d, model, inp, out, CALRT_ENGINE_AUTO, tag));
}

int32_t calrt_infer_fixed(calrt_device_t h, calrt_model_t model, calrt_buf_t inp,
                          calrt_buf_t out, int32_t engine, const calrt_job_tag_t *tag) {
    ENTER(h);
    if (!d->caps.fixed_engine_slots || !d->parallel) RETURN(CALRT_UNSUPPORTED);
    if (engine != CALRT_ENGINE_PING && engine != CALRT_ENGINE_PONG) RETURN(CALRT_INVALID_VALUE);
    RETURN(submit(d, model, inp, out, engine, tag));
}

int32_t calrt_wait(calrt_device_t h, calrt_buf_t out, int64_t timeout_ns) {
    ENTER(h);
    emu_buf *b = buf_lookup(d, out);
    if (!b || !b->is_output) RETURN(CALRT_INVALID_STATE);
    drain_due(d);
    b = buf_lookup(d, out);
    if (!b) RETURN(CALRT_INVALID_STATE);
    if (!b->submitted) RETURN(CALRT_INVALID_STATE);
    job *j = b->job;
    if (!j) RETURN(CALRT_SUCCESS);
    match_ctx c = {j->seq, j->has_tag, j->tag.job_id, NULL, NULL, 0};
    int32_t rc = code_fault(d, CALRT_EMU_POINT_WAIT, &c);
    if (rc) RETURN(rc);
    uint64_t id = j->id;
    if (d->clock_mode == CALRT_EMU_CLOCK_VIRTUAL) {
        int64_t deadline = timeout_ns < 0 ? NEVER : sat_add(d->vnow, timeout_ns);
        if (j->finish_ns != NEVER && j->finish_ns <= deadline) {   /* a hang never ends */
            d->vnow = max64(d->vnow, j->finish_ns);
            drain_due(d);
            RETURN(CALRT_SUCCESS);
        }
        if (deadline != NEVER) {
            d->vnow = max64(d->vnow, deadline);
            drain_due(d);
        }
        b = buf_lookup(d, out);
        RETURN(b && b->job && b->job->id == id ? CALRT_TIMEOUT : CALRT_SUCCESS);
    }
    int64_t deadline = timeout_ns < 0 ? NEVER : sat_add(mono_ns(), timeout_ns);
    for (;;) {
        /* every wake-up may follow a reset or close: never trust `b` across a wait */
        b = buf_any(d, out);
        if (!b || !b->job || b->job->id != id) RETURN(CALRT_SUCCESS);
        if (d->closed) RETURN(CALRT_SUCCESS);
        int64_t now = mono_ns();
        if (now >= deadline) RETURN(CALRT_TIMEOUT);
        if (deadline == NEVER) {
            pthread_cond_wait(&d->done_cv, &d->mu);
        } else {
            struct timespec ts;
            abs_ts(deadline, &ts);
            pthread_cond_timedwait(&d->done_cv, &d->mu, &ts);
        }
    }
}

int32_t calrt_get_status(calrt_device_t h, calrt_buf_t out, int32_t *status) {
    if (!status) return CALRT_INVALID_VALUE;
    ENTER(h);
    emu_buf *b = buf_any(d, out);
    if (!b || !b->is_output) RETURN(CALRT_INVALID_STATE);
    drain_due(d);
    b = buf_any(d, out);
    if (!b) RETURN(CALRT_INVALID_STATE);
    *status = b->status;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_output_bytes(calrt_device_t h, calrt_buf_t out, const char *tensor,
                           uint64_t *nbytes) {
    if (!tensor || !nbytes) return CALRT_INVALID_VALUE;
    ENTER(h);
    emu_buf *b;
    int t = buf_tensor(d, out, tensor, &b);
    if (t < 0) RETURN(-t);
    drain_due(d);
    b = buf_lookup(d, out);
    if (!b) RETURN(CALRT_INVALID_STATE);
    if (b->job || !b->has_bytes) RETURN(CALRT_INVALID_STATE);
    match_ctx c = {b->last_seq, b->last_has_tag, b->last_job_id, tensor, NULL, 0};
    int32_t rc = code_fault(d, CALRT_EMU_POINT_OUTPUT_BYTES, &c);
    if (rc) RETURN(rc);
    *nbytes = b->produced[t];
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_pending_jobs(calrt_device_t h, uint32_t *out) {
    if (!out) return CALRT_INVALID_VALUE;
    ENTER(h);
    drain_due(d);
    uint32_t n = 0;
    for (job *j = d->q_head; j; j = j->next) n++;
    *out = n;
    RETURN(CALRT_SUCCESS);
}

/* ---- KV manager ----------------------------------------------------------------------- */

int32_t calrt_kv_can_allocate(calrt_device_t h, uint64_t n, int32_t *ok) {
    if (!ok) return CALRT_INVALID_VALUE;
    ENTER(h);
    int honest = d->kv_capacity - d->kv_used >= n;
    if (honest && rules_hit(d, CALRT_EMU_POINT_KV_CAN_ALLOCATE, &NO_CTX)) honest = 0;
    *ok = honest;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_kv_apply(calrt_device_t h, int64_t seq_id, uint64_t target, int32_t *ok) {
    if (!ok) return CALRT_INVALID_VALUE;
    ENTER(h);
    if (seq_id < 0 || seq_id > 0x7FFFFFFFLL) RETURN(CALRT_INVALID_VALUE);
    kv_seq *s = kv_find(d, seq_id);
    uint64_t have = s ? s->alloc : 0;
    match_ctx c = {seq_id, 0, 0, NULL, NULL, 0};
    *ok = 0;
    if (target > have && target - have > d->kv_capacity - d->kv_used) RETURN(CALRT_SUCCESS);
    if (rules_hit(d, CALRT_EMU_POINT_KV_APPLY, &c)) RETURN(CALRT_SUCCESS);
    if (target > have) {
        if (!s) {
            if (d->n_seqs == d->cap_seqs) {
                uint32_t nc = d->cap_seqs ? d->cap_seqs * 2 : 16;
                kv_seq *ns = realloc(d->seqs, nc * sizeof *ns);
                if (!ns) RETURN(CALRT_ALLOC_FAILED);
                d->seqs = ns;
                d->cap_seqs = nc;
            }
            s = &d->seqs[d->n_seqs++];
            s->id = seq_id;
            s->alloc = 0;
            s->words = NULL;
        }
        uint32_t *w = realloc(s->words, target * sizeof *w);
        if (!w) {
            if (s->alloc == 0) *s = d->seqs[--d->n_seqs];
            RETURN(CALRT_ALLOC_FAILED);
        }
        memset(w + have, 0, (target - have) * sizeof *w);
        s->words = w;
        d->kv_used += target - have;
        s->alloc = target;
    }
    *ok = 1;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_kv_release(calrt_device_t h, int64_t seq_id, uint64_t keep_len) {
    ENTER(h);
    match_ctx c = {seq_id, 0, 0, NULL, NULL, 0};
    int32_t rc = code_fault(d, CALRT_EMU_POINT_KV_RELEASE, &c);
    if (rc) RETURN(rc);
    kv_seq *s = kv_find(d, seq_id);
    if (!s || keep_len >= s->alloc) RETURN(CALRT_SUCCESS);
    d->kv_used -= s->alloc - keep_len;
    s->alloc = keep_len;
    if (keep_len == 0) {
        free(s->words);
        *s = d->seqs[--d->n_seqs];
    }
    RETURN(CALRT_SUCCESS);
}

/* ---- device control ----------------------------------------------------------------- */

static int32_t do_reset(calrt_device_t h, uint32_t kind) {
    ENTER(h);
    if (!(d->caps.resets & kind)) RETURN(CALRT_UNSUPPORTED);
    drain_due(d);
    int32_t rc = code_fault(d, CALRT_EMU_POINT_RESET, &NO_CTX);
    if (rc) RETURN(rc);
    abort_pending(d, 0);
    d->parallel = 0;  /* every reset kind: the host enables parallel mode again */
    if (kind != CALRT_RESET_CCU) {
        /* models and buffers go stale: handles stay in the table (status stays readable,
         * everything else is INVALID_STATE) until released */
        cfg_unref(d->cfg);
        d->cfg = NULL;
    }
    if (kind == CALRT_RESET_FULL) kv_clear(d);
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_reset_ccu(calrt_device_t h) { return do_reset(h, CALRT_RESET_CCU); }
int32_t calrt_reset_configuration(calrt_device_t h) {
    return do_reset(h, CALRT_RESET_CONFIGURATION);
}
int32_t calrt_reset(calrt_device_t h) { return do_reset(h, CALRT_RESET_FULL); }

int32_t calrt_enable_parallel_mode(calrt_device_t h, int32_t on) {
    ENTER(h);
    if (!d->caps.parallel_mode) RETURN(CALRT_UNSUPPORTED);
    drain_due(d);
    if (d->n_queued) RETURN(CALRT_DEVICE_BUSY);
    int32_t rc = code_fault(d, CALRT_EMU_POINT_ENABLE_PARALLEL_MODE, &NO_CTX);
    if (rc) RETURN(rc);
    d->parallel = on != 0;
    RETURN(CALRT_SUCCESS);
}

/* ---- emulator control --------------------------------------------------------------- */

int32_t calrt_emu_set_clock(calrt_device_t h, int32_t mode) {
    ENTER(h);
    if (mode != CALRT_EMU_CLOCK_REAL && mode != CALRT_EMU_CLOCK_VIRTUAL)
        RETURN(CALRT_INVALID_VALUE);
    if (d->q_head) RETURN(CALRT_DEVICE_BUSY);
    if (mode != d->clock_mode) {
        d->clock_mode = mode;
        d->vnow = 0;
        d->comp_free = d->d2h_free = dev_now(d);
        d->n_dma = 0;
    }
    pthread_cond_signal(&d->work_cv);
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_now(calrt_device_t h, int64_t *now_ns) {
    if (!now_ns) return CALRT_INVALID_VALUE;
    ENTER(h);
    *now_ns = dev_now(d);
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_advance(calrt_device_t h, int64_t ns) {
    ENTER(h);
    if (ns < 0) RETURN(CALRT_INVALID_VALUE);
    if (d->clock_mode != CALRT_EMU_CLOCK_VIRTUAL) RETURN(CALRT_UNSUPPORTED);
    d->vnow = sat_add(d->vnow, ns);
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_advance_to(calrt_device_t h, int64_t t_ns) {
    ENTER(h);
    if (d->clock_mode != CALRT_EMU_CLOCK_VIRTUAL) RETURN(CALRT_UNSUPPORTED);
    d->vnow = max64(d->vnow, t_ns);
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_set_latency(calrt_device_t h, double h2d, double prefill, double decode,
                              double d2h, double jitter, uint32_t seed) {
    ENTER(h);
    if (!(h2d >= 0) || !(prefill >= 0) || !(decode >= 0) || !(d2h >= 0) || isinf(h2d) ||
        isinf(prefill) || isinf(decode) || isinf(d2h) || !(jitter >= 0) || !(jitter <= 1))
        RETURN(CALRT_INVALID_VALUE);
    d->jitter = jitter;
    d->seed = seed;
    d->h2d_per_byte = h2d;
    d->prefill_per_token = prefill;
    d->decode_per_step = decode;
    d->d2h_per_byte = d2h;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_set_transfer_share(calrt_device_t h, double share) {
    ENTER(h);
    if (!(share >= 0) || !(share < 1)) RETURN(CALRT_INVALID_VALUE);
    d->transfer_share = share;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_set_batch_row_share(calrt_device_t h, double share) {
    ENTER(h);
    if (!(share >= 0) || !(share < 1)) RETURN(CALRT_INVALID_VALUE);
    d->batch_row_share = share;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_set_shape_cost(calrt_device_t h, int32_t graph,
                                 double context_s_per_token) {
    ENTER(h);
    if ((graph != 0 && graph != 1) || !(context_s_per_token >= 0) ||
        !(context_s_per_token < 1e300)) RETURN(CALRT_INVALID_VALUE);
    d->shape_graph = graph;
    d->context_per_token = context_s_per_token;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_set_timeline(calrt_device_t h, uint32_t jobs) {
    ENTER(h);
    if (jobs > (1u << 20)) RETURN(CALRT_INVALID_VALUE);
    free(d->timeline);
    d->timeline = NULL;
    d->tl_cap = jobs;
    d->tl_len = d->tl_head = 0;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_timeline(calrt_device_t h, calrt_emu_job_record_t *out, uint32_t cap,
                           uint32_t *n) {
    if (!n || (cap && !out)) return CALRT_INVALID_VALUE;
    ENTER(h);
    drain_due(d);
    uint64_t pending = 0;
    for (job *j = d->q_head; j; j = j->next) pending++;
    uint64_t total = d->tl_len + pending;
    uint64_t skip = total > cap ? total - cap : 0;   /* the oldest go first */
    uint32_t first = d->tl_cap ? (d->tl_head + d->tl_cap - d->tl_len) % d->tl_cap : 0;
    uint32_t w = 0;
    for (uint64_t i = skip; i < d->tl_len; i++)
        out[w++] = d->timeline[(first + i) % d->tl_cap];
    uint64_t k = d->tl_len;
    for (job *j = d->q_head; j; j = j->next, k++)
        if (k >= skip) fill_record(j, &out[w++], CALRT_STATUS_PENDING, NEVER);
    *n = w;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_set_kv_capacity(calrt_device_t h, uint64_t positions) {
    ENTER(h);
    if (positions < d->kv_used) RETURN(CALRT_INVALID_VALUE);
    d->kv_capacity = positions;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_set_capabilities(calrt_device_t h, const calrt_capabilities_t *caps) {
    if (!caps) return CALRT_INVALID_VALUE;
    ENTER(h);
    if ((caps->resets & ~7u) || caps->engine_slots < 1 || caps->engine_slots > 2)
        RETURN(CALRT_INVALID_VALUE);
    d->caps = *caps;
    if (!caps->parallel_mode) d->parallel = 0;
    RETURN(CALRT_SUCCESS);
}

static int effect_valid(int32_t point, int32_t effect) {
    switch (point) {
    case CALRT_EMU_POINT_INFER:
        return effect == CALRT_EMU_EFFECT_CODE ||
               (effect >= CALRT_EMU_EFFECT_CCU_EXCEPTION &&
                effect <= CALRT_EMU_EFFECT_ROW_CCU_EXCEPTION);
    case CALRT_EMU_POINT_KV_CAN_ALLOCATE:
    case CALRT_EMU_POINT_KV_APPLY:
        return effect == CALRT_EMU_EFFECT_REFUSE;
    default:
        return point >= 0 && point < CALRT_EMU_POINT_COUNT && effect == CALRT_EMU_EFFECT_CODE;
    }
}

int32_t calrt_emu_add_rule(calrt_device_t h, const calrt_emu_rule_t *rule) {
    if (!rule) return CALRT_INVALID_VALUE;
    ENTER(h);
    if (!effect_valid(rule->point, rule->effect) || rule->nth < 1 || rule->every < 0 ||
        (rule->effect == CALRT_EMU_EFFECT_CODE && rule->code == 0) ||
        memchr(rule->name, 0, sizeof rule->name) == NULL)
        RETURN(CALRT_INVALID_VALUE);
    if (d->n_rules >= MAX_RULES) RETURN(CALRT_OUT_OF_RANGE);
    rule_state *nr = realloc(d->rules, (d->n_rules + 1) * sizeof *nr);
    if (!nr) RETURN(CALRT_ALLOC_FAILED);
    d->rules = nr;
    nr[d->n_rules].r = *rule;
    nr[d->n_rules].ordinal = nr[d->n_rules].fired = 0;
    d->n_rules++;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_clear_rules(calrt_device_t h) {
    ENTER(h);
    free(d->rules);
    d->rules = NULL;
    d->n_rules = 0;
    RETURN(CALRT_SUCCESS);
}

int32_t calrt_emu_stats(calrt_device_t h, uint64_t *executed, uint64_t *aborted,
                        uint64_t *ghosts) {
    if (!executed || !aborted || !ghosts) return CALRT_INVALID_VALUE;
    ENTER(h);
    *executed = d->st_executed;
    *aborted = d->st_aborted;
    *ghosts = d->st_ghosts;
    RETURN(CALRT_SUCCESS);
}
