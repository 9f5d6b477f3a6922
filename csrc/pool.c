/* csrc/pool.c: the worker threads of rowcache.kernels._host's parallel calls.
 *
 * parallel(K, fn, arg, size) (rc_pool_parallel) runs fn(arg + k * size) for k in [0, K), on
 * the caller's thread and on up to K - 1 workers kept between calls. A call used to create
 * and join its threads itself (pthread_create per part and phase), which at a prefill
 * step's two phases of six parts cost more than the parts' work saved (one thread: 525 us,
 * eight: 396 us for 24,576 ids on the H200 host). Workers are started on first need, poll
 * for a new job for up to POOL_SPIN_NS after their last one (the next phase of the same
 * lru_hits call comes microseconds later), then sleep on a condition variable; the
 * caller polls for its job's last part the same way before it sleeps.
 *
 * There are two pools: the step's (`parallel`: the calls a step makes, on its path) and
 * the toucher's (csrc/lru_touch.c: the deferred touch of an earlier step), so that a
 * touch in the background and the step's own hash and scan run side by side instead of
 * taking turns: sharing one pool, the toucher waited for the step's jobs, and a graph
 * prefill step then waited for touches that took as long as the step's whole host part.
 *
 * One job runs at a time in a pool: a step's call that finds it busy (another Python
 * thread's call, the GIL being released) runs its parts on its own thread, in order.
 * Parts are handed out under the pool's mutex (a few per job, each tens of microseconds
 * of work), so a worker late for one job cannot take a part of the next. After fork()
 * the child has no workers: the pools are reset there (pthread_atfork) and restart on
 * first need.
 *
 * Owns the two pools (static: reached through rc_pool_get). libc only, no Python.
 */
#define _GNU_SOURCE /* clock_gettime, pthread_sigmask under -std=c11 (as Python.h does) */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#include "pool.h"

#define POOL_SPIN_NS 50000LL    /* a worker's (and a waiting caller's) poll before it sleeps */

static inline void pool_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long long pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

struct Pool {
    pthread_mutex_t busy; /* held by the one running job's caller */
    pthread_mutex_t mu;   /* guards the fields below */
    pthread_cond_t work, done;
    atomic_ulong gen;     /* bumped (under mu) for each job */
    int workers;          /* started so far */
    void *(*fn)(void *);
    char *arg;
    size_t size;
    int K, next;          /* parts, the next to hand out */
    atomic_int left;      /* parts not finished */
    int sleeping;         /* workers waiting on `work` */
};

#define POOL_INIT                                                                          \
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,        \
     PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0, 0, 0, 0}

static Pool pools[2] = {POOL_INIT, POOL_INIT};

/* Runs the parts of job `gen` that are still to hand out; returns when none is left. */
static void pool_run(Pool *p, unsigned long gen) {
    for (;;) {
        pthread_mutex_lock(&p->mu);
        if (atomic_load(&p->gen) != gen || p->next >= p->K) {
            pthread_mutex_unlock(&p->mu);
            return;
        }
        int k = p->next++;
        void *(*fn)(void *) = p->fn;
        char *arg = p->arg + (size_t)k * p->size;
        pthread_mutex_unlock(&p->mu);
        fn(arg);
        if (atomic_fetch_sub(&p->left, 1) == 1) { /* the last part: wake the caller */
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

static void *pool_worker(void *arg) {
    Pool *p = arg;
    unsigned long seen = atomic_load(&p->gen);
    for (;;) {
        long long until = pool_now_ns() + POOL_SPIN_NS;
        unsigned long g;
        int polls = 0;
        while ((g = atomic_load(&p->gen)) == seen) {
            pool_relax();
            if (++polls % 256 == 0 && pool_now_ns() > until) {
                break;
            }
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            p->sleeping++;
            while ((g = atomic_load(&p->gen)) == seen) {
                pthread_cond_wait(&p->work, &p->mu);
            }
            p->sleeping--;
            pthread_mutex_unlock(&p->mu);
        }
        seen = g;
        pool_run(p, g);
    }
    return NULL;
}

static void pool_after_fork(void) {
    for (int i = 0; i < 2; i++) {
        Pool *p = &pools[i];
        pthread_mutex_init(&p->busy, NULL);
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->work, NULL);
        pthread_cond_init(&p->done, NULL);
        p->workers = 0;
        p->sleeping = 0;
        p->K = p->next = 0;
        atomic_store(&p->left, 0);
    }
}

/* Starts p's workers until there are `want` (at most MAXT - 1); fewer if the system refuses. */
static void pool_grow(Pool *p, int want) {
    static int registered = 0;
    if (!registered) {
        registered = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    }
    /* workers block every signal (they inherit the mask they are made with): signals go to
     * the process's own threads, where Python handles them */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    while (p->workers < want && p->workers < MAXT - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&th, &attr, pool_worker, p) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) {
            break;
        }
        p->workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* Runs fn(arg + k * size) for k in [0, K): on the caller's thread and pool p's workers,
 * or all on the caller's when K == 1, the pool has no workers, or it is busy and `wait`
 * is 0. With `wait` a busy pool is waited for. */
void rc_pool_parallel_on(Pool *p, int K, void *(*fn)(void *), char *arg, size_t size, int wait) {
    if (K > 1 && (wait ? pthread_mutex_lock(&p->busy) : pthread_mutex_trylock(&p->busy)) == 0) {
        pool_grow(p, K - 1);
        if (p->workers > 0) {
            pthread_mutex_lock(&p->mu);
            p->fn = fn;
            p->arg = arg;
            p->size = size;
            p->K = K;
            p->next = 0;
            atomic_store(&p->left, K);
            unsigned long gen = atomic_load(&p->gen) + 1;
            atomic_store(&p->gen, gen);
            if (p->sleeping) {
                pthread_cond_broadcast(&p->work);
            }
            pthread_mutex_unlock(&p->mu);
            pool_run(p, gen);
            long long until = pool_now_ns() + POOL_SPIN_NS;
            for (int polls = 1; atomic_load(&p->left) > 0; polls++) {
                pool_relax();
                if (polls % 256 == 0 && pool_now_ns() > until) {
                    break;
                }
            }
            pthread_mutex_lock(&p->mu);
            while (atomic_load(&p->left) > 0) {
                pthread_cond_wait(&p->done, &p->mu);
            }
            pthread_mutex_unlock(&p->mu);
            pthread_mutex_unlock(&p->busy);
            return;
        }
        pthread_mutex_unlock(&p->busy);
    }
    for (int k = 0; k < K; k++) {
        fn(arg + (size_t)k * size);
    }
}

/* A call on the step's path: the step's pool, never waited for when busy. */
void rc_pool_parallel(int K, void *(*fn)(void *), char *arg, size_t size) {
    rc_pool_parallel_on(&pools[POOL_STEP], K, fn, arg, size, 0);
}

Pool *rc_pool_get(int which) { return &pools[which]; }
