/*
 * Stress test of libcalrt_emu for the sanitizers (tests/native/test_sanitizers.py builds
 * it with -fsanitize=thread and with -fsanitize=address, and runs it).
 *
 * Phase 1: THREADS pthreads share one device in parallel mode (two engine slots). Each owns
 * a sequence and a buffer set (half of them bound to PING/PONG and submitted with
 * infer_fixed), and runs JOBS decode steps: write token/position, set CSRs, kv_apply,
 * submit (retrying DEVICE_BUSY), wait, status, output_bytes — and checks every logit
 * against the reference model. A poller thread reads statuses and KV state meanwhile.
 * Phase 1b: two pthreads run batch decode jobs (a B = 4 graph) on their own sequences,
 * 1..4 rows each, some with a row that fails its checks alone; every row's logits and
 * status are checked, padding rows must be zero.
 * Phase 2: jobs in flight while another thread resets (CCU, configuration; one reset per
 * submitted job) and the racers release stale buffers, with STALE and HANG fault rules so
 * ghosts and aborts happen concurrently. A racer writes a job's inputs only when no job
 * can read them (see "phase 2" below) and checks the logits of every job that ended OK.
 * Phase 3: close with jobs pending; every handle is stale afterwards.
 *
 * Exit status 0 when every check passed; the sanitizers add their own reports.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calrt_c.h"
#include "emu_refmodel.h"

#define THREADS 4
#define JOBS 150
#define VOCAB 256

static const char CALBIN[] =
    "calfsm-calbin 1\n"
    "model s_prefill_ids prefill_ids 16\n"
    "input input_ids S32 1024 2 1 256\n"
    "input position_ids S32 1024 2 1 256\n"
    "output logits BF16 8192 3 1 16 256\n"
    "csr cur_seq\ncsr total_seq\n"
    "model s_decode decode -\n"
    "input input_ids S32 4 2 1 1\n"
    "input position_ids S32 4 2 1 1\n"
    "output logits BF16 512 3 1 1 256\n"
    "csr cur_seq\ncsr total_seq\n"
    "model s_batch_decode decode -\n"
    "input input_ids S32 16 2 4 1\n"
    "input position_ids S32 16 2 4 1\n"
    "output logits BF16 2048 3 4 1 256\n"
    "csr cur_seq\ncsr total_seq\n"
    "end\n";

static calrt_device_t dev;
static calrt_model_t decode_model;
static int failures;  /* atomic */
static int stop_poller;  /* atomic */

#define CHECK(cond, ...)                                            \
    do {                                                            \
        if (!(cond)) {                                              \
            fprintf(stderr, "stress: %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                           \
            fputc('\n', stderr);                                    \
            __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);     \
        }                                                           \
    } while (0)

typedef struct {
    int id;
    calrt_buf_t inp, out;
    int32_t tok, pos;
    uint16_t logits[VOCAB];
    int32_t engine;
} worker_t;

static int32_t submit(worker_t *w) {
    calrt_job_tag_t tag = {w->pos, w->id, 0};
    for (;;) {
        int32_t rc = w->engine >= 0
            ? calrt_infer_fixed(dev, decode_model, w->inp, w->out, w->engine, &tag)
            : calrt_infer(dev, decode_model, w->inp, w->out, &tag);
        if (rc != CALRT_DEVICE_BUSY) return rc;
        sched_yield();
    }
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    uint32_t h = REF_H_INIT;
    uint16_t want[VOCAB];
    for (int i = 0; i < JOBS; i++) {
        w->tok = (w->id * 131 + i * 7) % VOCAB;
        w->pos = i;
        int32_t ok = 0;
        CHECK(calrt_kv_apply(dev, w->id, (uint64_t)i + 1, &ok) == 0 && ok, "kv_apply");
        CHECK(calrt_set_csr(dev, w->inp, "cur_seq", 1) == 0, "set_csr");
        CHECK(calrt_set_csr(dev, w->inp, "total_seq", i + 1) == 0, "set_csr");
        int32_t rc = submit(w);
        CHECK(rc == 0, "infer: %d", rc);
        rc = calrt_wait(dev, w->out, -1);
        CHECK(rc == 0, "wait: %d", rc);
        int32_t st = -1;
        CHECK(calrt_get_status(dev, w->out, &st) == 0 && st == CALRT_STATUS_DONE_OK,
              "status %d", st);
        uint64_t n = 0;
        CHECK(calrt_output_bytes(dev, w->out, "logits", &n) == 0 && n == sizeof w->logits,
              "output_bytes %llu", (unsigned long long)n);
        h = ref_step(h, (uint32_t)w->tok, (uint32_t)w->pos);
        ref_logits_row(h, want, VOCAB);
        CHECK(memcmp(want, w->logits, sizeof want) == 0, "thread %d job %d: wrong logits",
              w->id, i);
    }
    return NULL;
}

static void *poller_main(void *arg) {
    worker_t *ws = arg;
    while (!__atomic_load_n(&stop_poller, __ATOMIC_RELAXED)) {
        for (int i = 0; i < THREADS; i++) {
            int32_t st;
            CHECK(calrt_get_status(dev, ws[i].out, &st) == 0, "poll status");
            int32_t ok;
            CHECK(calrt_kv_can_allocate(dev, 1, &ok) == 0, "can_allocate");
            uint32_t pending;
            CHECK(calrt_pending_jobs(dev, &pending) == 0 && pending <= 2, "pending %u",
                  pending);
        }
        /* the phase timeline, read while jobs end: ordered, one DMA channel, one unit */
        static calrt_emu_job_record_t recs[64];
        uint32_t n = 0;
        CHECK(calrt_emu_timeline(dev, recs, 64, &n) == 0 && n <= 64, "timeline %u", n);
        for (uint32_t k = 0; k < n; k++) {
            const int64_t *p = recs[k].phase_ns;
            CHECK(p[0] <= p[1] && p[1] <= p[2] && p[2] <= p[3] && p[3] <= p[4] && p[4] <= p[5],
                  "job %llu phases out of order", (unsigned long long)recs[k].job);
            CHECK(k == 0 || recs[k].job > recs[k - 1].job || recs[k].status ==
                  CALRT_STATUS_PENDING, "timeline order");
        }
        sched_yield();
    }
    return NULL;
}

static void setup_worker(worker_t *w, int id, int32_t engine) {
    memset(w, 0, sizeof *w);
    w->id = id;
    w->engine = engine;
    CHECK(calrt_create_buffers(dev, decode_model, engine, &w->inp, &w->out) == 0, "create");
    CHECK(calrt_map_buf(dev, w->inp, "input_ids", &w->tok, 4, "S32") == 0, "map");
    CHECK(calrt_map_buf(dev, w->inp, "position_ids", &w->pos, 4, "S32") == 0, "map");
    CHECK(calrt_map_buf(dev, w->out, "logits", w->logits, sizeof w->logits, "BF16") == 0,
          "map");
    CHECK(calrt_set_kv_seq(dev, w->inp, id) == 0, "kv_seq");
}

/* ---- phase 1b: batch jobs -------------------------------------------------------- */

#define BATCH 4
#define BATCH_JOBS 60

typedef struct {
    int id;
    calrt_model_t model;
    calrt_buf_t inp, out;
    int32_t tok[BATCH], pos[BATCH];
    uint16_t logits[BATCH * VOCAB];
} batcher_t;

static void *batcher_main(void *arg) {
    batcher_t *b = arg;
    uint32_t h[BATCH];
    int32_t len[BATCH] = {0};
    uint16_t want[VOCAB], zero[VOCAB];
    memset(zero, 0, sizeof zero);
    for (int r = 0; r < BATCH; r++) h[r] = REF_H_INIT;
    for (int i = 0; i < BATCH_JOBS; i++) {
        uint32_t rows = 1 + (uint32_t)(i % BATCH);
        int bad = i % 5 == 4 ? (int)rows - 1 : -1;   /* a row that fails its checks alone */
        for (uint32_t r = 0; r < rows; r++) {
            int64_t seq = 1000 + 10 * b->id + r;
            int32_t ok = 0;
            b->tok[r] = (b->id * 31 + i * 7 + (int)r) % VOCAB;
            b->pos[r] = len[r];
            CHECK(calrt_kv_apply(dev, seq, (uint64_t)len[r] + 1, &ok) == 0 && ok, "kv_apply");
            CHECK(calrt_set_kv_seq_row(dev, b->inp, r, seq) == 0, "kv_seq_row");
            CHECK(calrt_set_csr_row(dev, b->inp, "cur_seq", r, 1) == 0, "csr_row");
            CHECK(calrt_set_csr_row(dev, b->inp, "total_seq", r,
                                    (int)r == bad ? len[r] + 7 : len[r] + 1) == 0, "csr_row");
        }
        for (uint32_t r = rows; r < BATCH; r++) b->tok[r] = b->pos[r] = 99999;  /* unread */
        CHECK(calrt_set_batch_rows(dev, b->inp, rows) == 0, "batch rows");
        memset(b->logits, 0xAA, sizeof b->logits);
        int32_t rc;
        while ((rc = calrt_infer(dev, b->model, b->inp, b->out, NULL)) == CALRT_DEVICE_BUSY)
            sched_yield();
        CHECK(rc == 0, "batch infer %d", rc);
        CHECK(calrt_wait(dev, b->out, -1) == 0, "batch wait");
        int32_t st = -1;
        CHECK(calrt_get_status(dev, b->out, &st) == 0 && st == CALRT_STATUS_DONE_OK,
              "batch status %d", st);
        for (uint32_t r = 0; r < BATCH + 1; r++) {
            int32_t want_st = r >= rows ? CALRT_STATUS_IDLE : (int)r == bad
                ? CALRT_STATUS_DONE_CCU_EXCEPTION : CALRT_STATUS_DONE_OK;
            CHECK(calrt_get_row_status(dev, b->out, r, &st) == 0 && st == want_st,
                  "batcher %d job %d row %u: status %d, want %d", b->id, i, r, st, want_st);
            if (r >= BATCH) continue;
            if (r < rows && (int)r != bad) {
                h[r] = ref_step(h[r], (uint32_t)b->tok[r], (uint32_t)b->pos[r]);
                len[r]++;
                ref_logits_row(h[r], want, VOCAB);
                CHECK(memcmp(want, &b->logits[r * VOCAB], sizeof want) == 0,
                      "batcher %d job %d row %u: wrong logits", b->id, i, r);
            } else {
                CHECK(memcmp(zero, &b->logits[r * VOCAB], sizeof zero) == 0,
                      "batcher %d job %d row %u: not zero", b->id, i, r);
            }
        }
    }
    return NULL;
}

static void run_batchers(void) {
    batcher_t bs[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        batcher_t *b = &bs[i];
        memset(b, 0, sizeof *b);
        b->id = i;
        CHECK(calrt_model_lookup(dev, "s_batch_decode", &b->model) == 0, "batch lookup");
        CHECK(calrt_create_buffers(dev, b->model, CALRT_ENGINE_AUTO, &b->inp, &b->out) == 0,
              "batch create");
        CHECK(calrt_map_buf(dev, b->inp, "input_ids", b->tok, sizeof b->tok, "S32") == 0,
              "map");
        CHECK(calrt_map_buf(dev, b->inp, "position_ids", b->pos, sizeof b->pos, "S32") == 0,
              "map");
        CHECK(calrt_map_buf(dev, b->out, "logits", b->logits, sizeof b->logits, "BF16") == 0,
              "map");
        pthread_create(&th[i], NULL, batcher_main, b);
    }
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++)
        CHECK(calrt_destroy_buffers(dev, bs[i].inp, bs[i].out) == 0, "batch destroy");
}

/* ---- phase 2: resets racing with jobs --------------------------------------------- */

/* The protocol (calrt_c.h, "Host memory mapped with calrt_map_buf()"): the device reads a
 * job's inputs when the job executes, on its own thread, so the host must not change them
 * until wait() reported the job finished — or, once its buffers went stale and were
 * released (a STALE job survives a reset as a ghost), until pending_jobs() is 0. A racer
 * therefore never writes the inputs of a job that has not finished: a job still pending
 * after a wait timeout keeps them, and the memory of released buffers whose job was still
 * pending is retired until the device has no pending job. Writing them anyway was a data
 * race with run_job (and made the job compute from whatever the host wrote meanwhile). */

#define AREAS 4

typedef struct {          /* host memory one buffer pair maps */
    int32_t tok, pos;
    uint16_t logits[VOCAB];
    int retired;          /* released under a pending (ghost) job: not reused yet */
} area_t;

typedef struct {
    int id, rounds;
    calrt_buf_t inp, out;
    area_t *area;         /* what inp/out map */
    int owned;            /* a job was submitted on inp/out and not reported finished */
    int32_t tok;          /* the token of that job */
    area_t areas[AREAS];
} racer_t;

static int racers_left;   /* atomic: racers still running (the resetter stops at 0) */
static int racer_submits; /* atomic: jobs the racers submitted (the resetter's pace) */

/* Drop the (stale) buffers; their memory stays the device's while their job is pending. */
static void racer_drop(racer_t *r) {
    int32_t st = -1;
    CHECK(calrt_get_status(dev, r->out, &st) == 0, "racer %d: stale status", r->id);
    if (st == CALRT_STATUS_PENDING) r->area->retired = 1;
    calrt_release_buffer(dev, r->inp);
    calrt_release_buffer(dev, r->out);
    r->inp = r->out = 0;
    r->area = NULL;
    r->owned = 0;
}

/* Fresh buffers on an area no job can touch; 0 when there is none yet. */
static int racer_buffers(racer_t *r, calrt_model_t m) {
    area_t *a = NULL;
    for (int k = 0; k < AREAS && !a; k++)
        if (!r->areas[k].retired) a = &r->areas[k];
    uint32_t pending = 1;
    if (!a && calrt_pending_jobs(dev, &pending) == 0 && pending == 0) {
        for (int k = 0; k < AREAS; k++) r->areas[k].retired = 0;
        a = &r->areas[0];
    }
    if (!a || calrt_create_buffers(dev, m, CALRT_ENGINE_AUTO, &r->inp, &r->out) != 0)
        return 0;
    r->area = a;
    calrt_map_buf(dev, r->inp, "input_ids", &a->tok, 4, "S32");
    calrt_map_buf(dev, r->inp, "position_ids", &a->pos, 4, "S32");
    calrt_map_buf(dev, r->out, "logits", a->logits, sizeof a->logits, "BF16");
    calrt_set_kv_seq(dev, r->inp, r->id);
    return 1;
}

/* Wait (2 ms: hung jobs time out) for the racer's job; 1 when it no longer owns the
 * inputs, and then a DONE_OK job's logits are checked. */
static int racer_finish(racer_t *r) {
    int32_t rc = calrt_wait(dev, r->out, 2000000);
    CHECK(rc == 0 || rc == CALRT_TIMEOUT || rc == CALRT_INVALID_STATE, "racer wait %d", rc);
    if (rc == CALRT_TIMEOUT) return 0;
    if (rc == CALRT_INVALID_STATE) {  /* a configuration reset made the buffers stale */
        racer_drop(r);
        return 1;
    }
    r->owned = 0;
    int32_t st = -1;
    CHECK(calrt_get_status(dev, r->out, &st) == 0 && st != CALRT_STATUS_PENDING,
          "racer %d: status %d after wait", r->id, st);
    if (st == CALRT_STATUS_DONE_OK) {
        uint16_t want[VOCAB];
        ref_logits_row(ref_step(REF_H_INIT, (uint32_t)r->tok, 0), want, VOCAB);
        CHECK(memcmp(want, r->area->logits, sizeof want) == 0, "racer %d: wrong logits",
              r->id);
    }
    return 1;
}

/* The only place a racer writes inputs: never while a job may read them. */
static void racer_write_inputs(racer_t *r, int32_t tok) {
    int32_t st = -1;
    CHECK(!r->owned && !r->area->retired && calrt_get_status(dev, r->out, &st) == 0 &&
          st != CALRT_STATUS_PENDING, "racer %d writes inputs a job owns (status %d)",
          r->id, st);
    r->tok = r->area->tok = tok;
    r->area->pos = 0;
}

static void *racer_main(void *arg) {
    racer_t *r = arg;
    for (int i = 0; i < r->rounds; i++) {
        if (r->owned && !racer_finish(r)) continue;  /* the last job still owns them */
        calrt_model_t m;
        if (calrt_model_lookup(dev, "s_decode", &m) != 0 || (!r->inp && !racer_buffers(r, m))) {
            sched_yield();
            continue;
        }
        int32_t ok;
        calrt_kv_apply(dev, r->id, 1, &ok);
        racer_write_inputs(r, i % VOCAB);
        calrt_set_csr(dev, r->inp, "cur_seq", 1);
        calrt_set_csr(dev, r->inp, "total_seq", 1);
        int32_t rc = calrt_infer(dev, m, r->inp, r->out, NULL);
        if (rc == 0) {
            r->owned = 1;
            __atomic_add_fetch(&racer_submits, 1, __ATOMIC_RELAXED);
            racer_finish(r);
        } else if (rc == CALRT_INVALID_STATE) {  /* stale before it was submitted */
            racer_drop(r);
        }
    }
    if (r->owned) racer_finish(r);
    __atomic_sub_fetch(&racers_left, 1, __ATOMIC_RELAXED);
    return NULL;
}

/* One reset per racer submission (CCU twice, then configuration) while racers run, so
 * every run has hung jobs aborted, ghosts and stale buffers, whatever the scheduling. */
static void *resetter_main(void *arg) {
    (void)arg;
    int seen = 0;
    for (int i = 0; __atomic_load_n(&racers_left, __ATOMIC_RELAXED) > 0;) {
        int now = __atomic_load_n(&racer_submits, __ATOMIC_RELAXED);
        if (now == seen) {
            sched_yield();
            continue;
        }
        seen = now;
        int32_t rc = (i % 3 == 2) ? calrt_reset_configuration(dev) : calrt_reset_ccu(dev);
        CHECK(rc == 0, "reset %d", rc);
        if (i % 3 == 2)
            CHECK(calrt_configure(dev, CALBIN, strlen(CALBIN)) == 0, "reconfigure");
        i++;
    }
    return NULL;
}

int main(void) {
    CHECK(calrt_abi_version() == CALRT_C_ABI_VERSION, "abi");
    CHECK(calrt_device_open(NULL, &dev) == 0, "open");
    CHECK(calrt_emu_set_latency(dev, 0, 0, 20e-6, 0, 0.5, 7) == 0, "latency");
    CHECK(calrt_emu_set_transfer_share(dev, 0.3) == 0, "transfer share");
    CHECK(calrt_configure(dev, CALBIN, strlen(CALBIN)) == 0, "configure");
    CHECK(calrt_model_lookup(dev, "s_decode", &decode_model) == 0, "lookup");
    CHECK(calrt_enable_parallel_mode(dev, 1) == 0, "parallel");

    /* phase 1 */
    worker_t ws[THREADS];
    pthread_t th[THREADS], poller;
    for (int i = 0; i < THREADS; i++)
        setup_worker(&ws[i], i, i % 2 == 0 ? CALRT_ENGINE_AUTO : (i / 2) % 2);
    for (int i = 0; i < THREADS; i++) pthread_create(&th[i], NULL, worker_main, &ws[i]);
    pthread_create(&poller, NULL, poller_main, ws);
    for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
    __atomic_store_n(&stop_poller, 1, __ATOMIC_RELAXED);
    pthread_join(poller, NULL);
    uint64_t ex, ab, gh;
    CHECK(calrt_emu_stats(dev, &ex, &ab, &gh) == 0 && ex == (uint64_t)THREADS * JOBS && ab == 0,
          "stats %llu %llu", (unsigned long long)ex, (unsigned long long)ab);
    for (int i = 0; i < THREADS; i++)
        CHECK(calrt_destroy_buffers(dev, ws[i].inp, ws[i].out) == 0, "destroy");

    /* phase 1b: batch jobs, still in parallel mode */
    CHECK(calrt_emu_set_batch_row_share(dev, 0.25) == 0, "batch row share");
    run_batchers();

    /* phase 2: resets racing with jobs, some stale (ghosts), some hung */
    CHECK(calrt_enable_parallel_mode(dev, 0) == 0, "serial");
    calrt_emu_rule_t stale = {.point = CALRT_EMU_POINT_INFER, .effect = CALRT_EMU_EFFECT_STALE,
                              .nth = 2, .every = 3, .limit = -1, .seq_id = -1, .n_bytes = -1};
    calrt_emu_rule_t hang = stale;
    hang.effect = CALRT_EMU_EFFECT_HANG;
    hang.nth = 3;
    hang.every = 7;
    CHECK(calrt_emu_add_rule(dev, &stale) == 0 && calrt_emu_add_rule(dev, &hang) == 0, "rules");
    racer_t rs[3];
    pthread_t rt[3], resetter;
    __atomic_store_n(&racers_left, 3, __ATOMIC_RELAXED);
    for (int i = 0; i < 3; i++) {
        memset(&rs[i], 0, sizeof rs[i]);
        rs[i].id = 100 + i;
        rs[i].rounds = 80;
        pthread_create(&rt[i], NULL, racer_main, &rs[i]);
    }
    pthread_create(&resetter, NULL, resetter_main, NULL);
    for (int i = 0; i < 3; i++) pthread_join(rt[i], NULL);
    pthread_join(resetter, NULL);

    uint64_t ex2, ab2, gh2;
    CHECK(calrt_emu_stats(dev, &ex2, &ab2, &gh2) == 0, "stats");
    printf("stress: phase 2 executed %llu, aborted %llu, ghosts %llu\n",
           (unsigned long long)(ex2 - ex), (unsigned long long)ab2, (unsigned long long)gh2);

    /* phase 3: close with work pending; everything is stale afterwards */
    CHECK(calrt_emu_clear_rules(dev) == 0, "clear");
    uint32_t pending = 0;
    CHECK(calrt_pending_jobs(dev, &pending) == 0, "pending");
    CHECK(calrt_device_close(dev) == 0, "close");
    int32_t st;
    CHECK(calrt_get_status(dev, rs[0].out, &st) == CALRT_INVALID_STATE, "after close");
    CHECK(calrt_device_close(dev) == CALRT_INVALID_STATE, "close twice");
    CHECK(calrt_get_status(0, 0, &st) == CALRT_INVALID_STATE, "null handle");

    /* many devices opened and closed concurrently-safe sequentially */
    for (int i = 0; i < 20; i++) {
        calrt_device_t d2;
        CHECK(calrt_device_open("", &d2) == 0, "reopen");
        CHECK(calrt_device_close(d2) == 0, "reclose");
    }
    if (failures) {
        fprintf(stderr, "stress: %d failures\n", failures);
        return 1;
    }
    printf("stress: ok (%llu jobs in phase 1, %u pending at close)\n",
           (unsigned long long)ex, pending);
    return 0;
}
