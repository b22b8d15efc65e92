/* Helper threads for the decode step (cpu_step.c): an op's independent chunks (column
 * ranges of a matmul, rows of attention) shared between the calling thread and the helpers,
 * so a decode worker given two cores uses both when the other is free, and loses nothing
 * when it is not (the prefill worker computing on it, another process).
 *
 * Why not OpenMP: a parallel region waits at its end for every thread; a thread the OS has
 * descheduled (a busy machine: prefill and decode workers share cores) stalls the region for
 * a time slice, milliseconds, many times a step. Here the caller never waits on a helper
 * that is not running its chunk:
 *
 *   post(task)     the caller publishes the op (a sequence number `seq`, its chunk count)
 *   claim          caller and helpers take chunks in turn (a CAS on (seq, next): a helper
 *                  still looking at the last op cannot take one of this op's)
 *   caller's chunk computed in place, its state MAIN
 *   helper's chunk FREE -> HELPER (CAS), computed into the helper's scratch, then
 *                  HELPER -> COPYING (CAS), copied out (`commit`), then DONE
 *   end            the caller, out of chunks, looks at every chunk a helper took: DONE is
 *                  done; FREE (claimed, not started) or HELPER past a short wait (twice the
 *                  caller's own mean chunk time) it takes back (CAS to MAIN) and computes
 *                  itself; the helper's later CAS fails and its result is dropped; COPYING
 *                  it waits for (a copy of a few KB)
 *
 * Every state word carries the op's seq, so a late helper's CAS never matches a later op.
 * A chunk's values are the same whoever computes it (the same code on the same inputs), so
 * the step is bitwise that of one thread. Helpers spin a short while for the next op, then
 * sleep on a condition variable (the caller wakes them when it posts); between steps they
 * sleep. Tasks hold at most MAX_CHUNKS chunks (the caller sizes chunks to fit).
 */
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_CHUNKS 64
#define MAX_HELPERS 8
enum { C_FREE = 0, C_HELPER = 1, C_COPYING = 2, C_DONE = 3, C_MAIN = 4 };

#define CTX_BYTES 128

typedef struct {
    /* compute chunk c: into its place (scratch NULL) or packed into scratch (returns the
     * floats written, < 0 when its scratch memory could not be had: a helper's chunk is then
     * left to the caller); commit: scratch -> its place. ctx: the op's arguments, by value
     * (a helper works from its own copy) */
    long (*compute)(const void *ctx, int c, float *scratch);
    void (*commit)(const void *ctx, int c, const float *scratch);
    int nchunks;
    long scratch_floats;                      /* the most one chunk writes packed */
    _Alignas(16) unsigned char ctx[CTX_BYTES];
} pd_task;

typedef struct pd_pool {
    int helpers;
    pthread_t th[MAX_HELPERS];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic unsigned long long claim;         /* seq << 32 | next chunk */
    _Atomic unsigned state[MAX_CHUNKS];       /* seq << 3 | C_* */
    _Atomic unsigned seq;                     /* the op posted last (0: none yet) */
    _Atomic int quit, sleeping;
    _Atomic int busy;                         /* helpers looking at or computing a task */
    pd_task task;                             /* valid while seq is the posted op's */
    long spin_ns, steal_ns;
    float *ws;                                /* the step's buffers (cpu_step.c), kept: a */
    long ws_floats;                           /* late helper may still read them */
} pd_pool;

static inline long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

/* a wait for a helper that long spins did not end: 20 us off the core, which the helper,
 * at the lowest priority, may need */
static void pool_nap(void) {
    struct timespec t = {0, 20000};
    nanosleep(&t, NULL);
}

/* take the next chunk of op `seq`, or -1 when it has none left (or is no longer posted) */
static int pool_claim(pd_pool *p, unsigned seq, int nchunks) {
    unsigned long long cur = atomic_load(&p->claim);
    for (;;) {
        if ((unsigned)(cur >> 32) != seq || (int)(cur & 0xffffffffu) >= nchunks) return -1;
        if (atomic_compare_exchange_weak(&p->claim, &cur, cur + 1)) return (int)(cur & 0xffffffffu);
    }
}

static void *pool_helper(void *arg) {
    pd_pool *p = arg;
    unsigned seen = 0;
#if defined(__linux__)
    /* the lowest priority (nice 19, this thread alone): whatever else wants a core (the
     * worker's event loop sending tokens, the gateway, another worker) runs first, and the
     * caller takes back what this one holds. Not SCHED_IDLE: a thread of that class can
     * starve for as long as the cores are busy, and the caller does wait for a helper in two
     * places (a chunk half copied out, pool_quiesce) */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
#endif
    float *scratch = NULL;
    long have = 0;
    while (!atomic_load(&p->quit)) {
        unsigned seq = atomic_load(&p->seq);
        if (seq == seen) {                                   /* no new op: spin, then sleep */
            long t0 = now_ns();
            while (atomic_load(&p->seq) == seen && !atomic_load(&p->quit) && now_ns() - t0 < p->spin_ns)
                cpu_relax();
            if (atomic_load(&p->seq) == seen && !atomic_load(&p->quit)) {
                pthread_mutex_lock(&p->mu);
                atomic_fetch_add(&p->sleeping, 1);
                while (atomic_load(&p->seq) == seen && !atomic_load(&p->quit)) pthread_cond_wait(&p->cv, &p->mu);
                atomic_fetch_sub(&p->sleeping, 1);
                pthread_mutex_unlock(&p->mu);
            }
            continue;
        }
        seen = seq;
        atomic_fetch_add(&p->busy, 1);                       /* before the task is read */
        pd_task t = p->task;
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load(&p->seq) == seq && (t.scratch_floats <= have || (free(scratch),
                (scratch = amalloc(sizeof(float) * t.scratch_floats)) != NULL))) {
            have = t.scratch_floats > have ? t.scratch_floats : have;
            int c;
            while ((c = pool_claim(p, seq, t.nchunks)) >= 0) {
                unsigned free_ = seq << 3 | C_FREE;
                if (!atomic_compare_exchange_strong(&p->state[c], &free_, seq << 3 | C_HELPER)) continue;
                if (t.compute(t.ctx, c, scratch) < 0) continue;     /* the caller takes it back */
                unsigned mine = seq << 3 | C_HELPER;
                if (!atomic_compare_exchange_strong(&p->state[c], &mine, seq << 3 | C_COPYING)) continue;
                t.commit(t.ctx, c, scratch);
                atomic_store_explicit(&p->state[c], seq << 3 | C_DONE, memory_order_release);
            }
        } else if (!scratch) {
            have = 0;                                        /* no memory: the caller does all */
        }
        atomic_fetch_sub(&p->busy, 1);
    }
    free(scratch);
    return NULL;
}

/* Wait until no helper is inside a task: what a late helper (its chunk taken back) may still
 * read (the step's buffers and inputs) may then be freed or reused. The step calls it first:
 * the previous step's late helpers have had the time between steps to finish. */
static void pool_quiesce(pd_pool *p) {
    if (!p) return;
    for (long spins = 0; atomic_load(&p->busy); spins++)
        if (spins > 1000) pool_nap(); else cpu_relax();
}

/* A step's buffers of `floats` floats: the pool's, kept until it is freed (a helper whose
 * chunk was taken back may read them after the step); call after pool_quiesce. */
static float *pool_workspace(pd_pool *p, long floats) {
    if (floats > p->ws_floats) {
        free(p->ws);
        p->ws = amalloc(sizeof(float) * floats);
        p->ws_floats = p->ws ? floats : 0;
    }
    return p->ws;
}

/* Run `t` on the caller and the helpers; returns when every chunk is in place (0), or 1
 * when a chunk's scratch memory could not be had. A chunk taken back from a late helper
 * leaves that helper computing on the op's inputs after this returns (its result then
 * dropped): they must stay readable until pool_quiesce. */
static int pool_run(pd_pool *p, const pd_task *t) {
    int failed = 0;
    if (!p || p->helpers == 0 || t->nchunks < 2) {
        for (int c = 0; c < t->nchunks; c++) failed |= t->compute(t->ctx, c, NULL) < 0;
        return failed;
    }
    unsigned seq = (atomic_load(&p->seq) + 1) & 0x1fffffffu;
    if (seq == 0) seq = 1;
    p->task = *t;
    for (int c = 0; c < t->nchunks; c++) atomic_store(&p->state[c], seq << 3 | C_FREE);
    atomic_store(&p->claim, (unsigned long long)seq << 32);
    atomic_store(&p->seq, seq);                              /* publishes the task (seq_cst) */
    if (atomic_load(&p->sleeping)) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    int c, mine = 0;
    long start = now_ns();
    while ((c = pool_claim(p, seq, t->nchunks)) >= 0) {
        atomic_store(&p->state[c], seq << 3 | C_MAIN);       /* no helper can hold it */
        failed |= t->compute(t->ctx, c, NULL) < 0;
        mine++;
    }
    /* a helper's chunk is taken back once it has run twice as long as the caller's took on
     * average (or steal_ns, when the caller took none): its helper is not running */
    long patience = mine ? 2 * (now_ns() - start) / mine + 2000 : p->steal_ns;
    for (c = 0; c < t->nchunks; c++) {
        long t0 = 0;
        for (;;) {
            unsigned s = atomic_load_explicit(&p->state[c], memory_order_acquire);
            unsigned st = s & 7;
            if (st == C_DONE || st == C_MAIN) break;
            if (st == C_FREE || (st == C_HELPER && t0 && now_ns() - t0 > patience)) {
                if (atomic_compare_exchange_strong(&p->state[c], &s, seq << 3 | C_MAIN)) {
                    failed |= t->compute(t->ctx, c, NULL) < 0;   /* taken back: ours */
                    break;
                }
                continue;
            }
            if (!t0) t0 = now_ns();
            if (st == C_COPYING && now_ns() - t0 > 20000) pool_nap();   /* its copy stalled */
            else cpu_relax();
        }
    }
    return failed;
}

pd_pool *pd_pool_new(int helpers, long spin_ns, long steal_ns) {
    pd_pool *p = calloc(1, sizeof(pd_pool));
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->spin_ns = spin_ns;
    p->steal_ns = steal_ns;
    helpers = helpers > MAX_HELPERS ? MAX_HELPERS : helpers;
    for (int i = 0; i < helpers; i++) {
        if (pthread_create(&p->th[i], NULL, pool_helper, p)) break;
        p->helpers++;
    }
    return p;
}

void pd_pool_free(pd_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->quit, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->helpers; i++) pthread_join(p->th[i], NULL);
    free(p->ws);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}
