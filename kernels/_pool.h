/* kernels/_pool.h: the worker threads of kernels._host's parallel calls (included once,
 * by _host.c).
 *
 * parallel(K, fn, arg, size) runs fn(arg + k * size) for k in [0, K), on the caller's
 * thread and on up to K - 1 workers kept between calls. A call used to create and join
 * its threads itself (pthread_create per part and phase), which at a prefill step's two
 * phases of six parts cost more than the parts' work saved (one thread: 525 us, eight:
 * 396 us for 24,576 ids on the H200 host). Workers are started on first need, poll for a
 * new job for up to POOL_SPIN_NS after their last one (the next phase of the same
 * lru_hits call comes microseconds later), then sleep on a condition variable; the
 * caller polls for its job's last part the same way before it sleeps.
 *
 * One job runs at a time: a call that finds the pool busy (another Python thread's call,
 * the GIL being released) runs its parts on its own thread, in order. Parts are handed
 * out under the pool's mutex (a few per job, each tens of microseconds of work), so a
 * worker late for one job cannot take a part of the next. After fork() the child has no
 * workers: the pool is reset there (pthread_atfork) and restarts on first need.
 */
#ifndef ROWCACHE_POOL_H
#define ROWCACHE_POOL_H

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#define MAXT 16                 /* threads of one call at most (the caller's included) */
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

static struct {
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
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0, 0, 0, 0};

/* Runs the parts of job `gen` that are still to hand out; returns when none is left. */
static void pool_run(unsigned long gen) {
    for (;;) {
        pthread_mutex_lock(&pool.mu);
        if (atomic_load(&pool.gen) != gen || pool.next >= pool.K) {
            pthread_mutex_unlock(&pool.mu);
            return;
        }
        int k = pool.next++;
        void *(*fn)(void *) = pool.fn;
        char *arg = pool.arg + (size_t)k * pool.size;
        pthread_mutex_unlock(&pool.mu);
        fn(arg);
        if (atomic_fetch_sub(&pool.left, 1) == 1) { /* the last part: wake the caller */
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
}

static void *pool_worker(void *unused) {
    (void)unused;
    unsigned long seen = atomic_load(&pool.gen);
    for (;;) {
        long long until = pool_now_ns() + POOL_SPIN_NS;
        unsigned long g;
        int polls = 0;
        while ((g = atomic_load(&pool.gen)) == seen) {
            pool_relax();
            if (++polls % 256 == 0 && pool_now_ns() > until) {
                break;
            }
        }
        if (g == seen) {
            pthread_mutex_lock(&pool.mu);
            pool.sleeping++;
            while ((g = atomic_load(&pool.gen)) == seen) {
                pthread_cond_wait(&pool.work, &pool.mu);
            }
            pool.sleeping--;
            pthread_mutex_unlock(&pool.mu);
        }
        seen = g;
        pool_run(g);
    }
    return NULL;
}

static void pool_after_fork(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0;
    pool.sleeping = 0;
    pool.K = pool.next = 0;
    atomic_store(&pool.left, 0);
}

/* Starts workers until there are `want` (at most MAXT - 1); fewer if the system refuses. */
static void pool_grow(int want) {
    static int registered = 0;
    if (!registered) {
        registered = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    }
    /* workers block every signal (they inherit the mask they are made with): signals go to
     * the process's own threads, where Python handles them */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    while (pool.workers < want && pool.workers < MAXT - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&th, &attr, pool_worker, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) {
            break;
        }
        pool.workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* Runs fn(arg + k * size) for k in [0, K): on the caller's thread and the pool's
 * workers, or all on the caller's when K == 1, the pool has no workers, or it is busy
 * and `wait` is 0. With `wait` (a background caller: kernels/_touch.h's toucher) a busy
 * pool is waited for: the job in it is a step's short one, and running six parts alone
 * took the toucher longer than the wait. */
static void parallel_pool(int K, void *(*fn)(void *), char *arg, size_t size, int wait) {
    if (K > 1 && (wait ? pthread_mutex_lock(&pool.busy) : pthread_mutex_trylock(&pool.busy)) == 0) {
        pool_grow(K - 1);
        if (pool.workers > 0) {
            pthread_mutex_lock(&pool.mu);
            pool.fn = fn;
            pool.arg = arg;
            pool.size = size;
            pool.K = K;
            pool.next = 0;
            atomic_store(&pool.left, K);
            unsigned long gen = atomic_load(&pool.gen) + 1;
            atomic_store(&pool.gen, gen);
            if (pool.sleeping) {
                pthread_cond_broadcast(&pool.work);
            }
            pthread_mutex_unlock(&pool.mu);
            pool_run(gen);
            long long until = pool_now_ns() + POOL_SPIN_NS;
            for (int polls = 1; atomic_load(&pool.left) > 0; polls++) {
                pool_relax();
                if (polls % 256 == 0 && pool_now_ns() > until) {
                    break;
                }
            }
            pthread_mutex_lock(&pool.mu);
            while (atomic_load(&pool.left) > 0) {
                pthread_cond_wait(&pool.done, &pool.mu);
            }
            pthread_mutex_unlock(&pool.mu);
            pthread_mutex_unlock(&pool.busy);
            return;
        }
        pthread_mutex_unlock(&pool.busy);
    }
    for (int k = 0; k < K; k++) {
        fn(arg + (size_t)k * size);
    }
}

/* parallel_pool for a caller on the step's path: a busy pool is never waited for. */
static void parallel(int K, void *(*fn)(void *), char *arg, size_t size) {
    parallel_pool(K, fn, arg, size, 0);
}

#endif
