/*
 * Stress test of libcalrt_emu for the sanitizers (tests/native/test_sanitizers.py builds
 * it with -fsanitize=thread and with -fsanitize=address, and runs it).
 *
 * Phase 1: THREADS pthreads share one device in parallel mode (two engine slots). Each owns
 * a sequence and a buffer set (half of them bound to PING/PONG and submitted with
 * infer_fixed), and runs JOBS decode steps: write token/position, set CSRs, kv_apply,
 * submit (retrying DEVICE_BUSY), wait, status, output_bytes — and checks every logit
 * against the reference model. A poller thread reads statuses and KV state meanwhile.
 * Phase 2: jobs in flight while another thread resets (CCU, configuration) and releases
 * stale buffers, with STALE and HANG fault rules so ghosts and aborts happen concurrently.
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

/* ---- phase 2: resets racing with jobs --------------------------------------------- */

typedef struct {
    worker_t w;
    int rounds;
} racer_t;

static void *racer_main(void *arg) {
    racer_t *r = arg;
    for (int i = 0; i < r->rounds; i++) {
        worker_t *w = &r->w;
        calrt_model_t m;
        if (calrt_model_lookup(dev, "s_decode", &m) != 0) { sched_yield(); continue; }
        if (!w->inp) {
            if (calrt_create_buffers(dev, m, CALRT_ENGINE_AUTO, &w->inp, &w->out) != 0)
                continue;
            calrt_map_buf(dev, w->inp, "input_ids", &w->tok, 4, "S32");
            calrt_map_buf(dev, w->inp, "position_ids", &w->pos, 4, "S32");
            calrt_map_buf(dev, w->out, "logits", w->logits, sizeof w->logits, "BF16");
            calrt_set_kv_seq(dev, w->inp, w->id);
        }
        int32_t ok;
        calrt_kv_apply(dev, w->id, 1, &ok);
        w->tok = i % VOCAB;
        w->pos = 0;
        calrt_set_csr(dev, w->inp, "cur_seq", 1);
        calrt_set_csr(dev, w->inp, "total_seq", 1);
        int32_t rc = calrt_infer(dev, m, w->inp, w->out, NULL);
        if (rc == 0) {
            rc = calrt_wait(dev, w->out, 2000000);   /* 2 ms: hung jobs time out */
            CHECK(rc == 0 || rc == CALRT_TIMEOUT || rc == CALRT_INVALID_STATE,
                  "racer wait %d", rc);
        }
        if (rc == CALRT_INVALID_STATE) {  /* a configuration reset made them stale */
            int32_t st;
            CHECK(calrt_get_status(dev, w->out, &st) == 0, "stale status");
            calrt_release_buffer(dev, w->inp);
            calrt_release_buffer(dev, w->out);
            w->inp = w->out = 0;
        }
    }
    return NULL;
}

static void *resetter_main(void *arg) {
    (void)arg;
    static const char *cb = CALBIN;
    for (int i = 0; i < 60; i++) {
        int32_t rc = (i % 3 == 2) ? calrt_reset_configuration(dev) : calrt_reset_ccu(dev);
        CHECK(rc == 0, "reset %d", rc);
        if (i % 3 == 2) {
            /* wait for the ghosts: their old arrays belong to racers that keep them */
            CHECK(calrt_configure(dev, cb, strlen(cb)) == 0, "reconfigure");
        }
        sched_yield();
    }
    return NULL;
}

int main(void) {
    CHECK(calrt_abi_version() == CALRT_C_ABI_VERSION, "abi");
    CHECK(calrt_device_open(NULL, &dev) == 0, "open");
    CHECK(calrt_emu_set_latency(dev, 0, 0, 20e-6, 0, 0.5, 7) == 0, "latency");
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
    for (int i = 0; i < 3; i++) {
        memset(&rs[i], 0, sizeof rs[i]);
        rs[i].w.id = 100 + i;
        rs[i].rounds = 80;
        pthread_create(&rt[i], NULL, racer_main, &rs[i]);
    }
    pthread_create(&resetter, NULL, resetter_main, NULL);
    pthread_join(resetter, NULL);
    for (int i = 0; i < 3; i++) pthread_join(rt[i], NULL);

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
    CHECK(calrt_get_status(dev, rs[0].w.out, &st) == CALRT_INVALID_STATE, "after close");
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
