/* csrc/lru_touch.c: the deferred touch of an all-hits resolve in rowcache.kernels._host; owns
 * the toucher thread and its queue of jobs (static `touch`).
 *
 * Of lru_hits' time on a large call, the scan (range check, the map's lookups) is about
 * a tenth; the rest is the touch: sorting the ids, pinning and logging the distinct
 * slots. Only the scan decides what the caller gets back (the slots, or a miss), so a
 * large all-hits call can return after it and leave the touch to a background thread:
 *
 * LruState.scan(ids i64[n], out i32[n], scratch i32[2n][, threads]) -> (status, a)
 *   status (csrc/lru_status.h) RC_LRU_OK: every row resident; out = slots; scratch[:n] =
 *   the ids as int32 keys (the touch's input). RC_LRU_MISS: a row is not resident (out =
 *   slots, -1 where missing). RC_LRU_BAD_ID: ids[a] is outside [0, R). Changes no cache
 *   state.
 * LruState.touch_start(scratch, n, head, tail, batch[, threads[, after]]) -> handle (an int)
 *   hits' RC_LRU_OK work on the keys of scan, run by the toucher thread: sort, pin the
 *   distinct slots (last_used = batch) and log them from tail in ascending row order, the
 *   log compacted first when it has no room. The job holds a reference to the state and
 *   the scratch's buffer until the wait; the caller must not read or write last_used, the
 *   log or log_pos before it (the row map no touch writes). When MAX_TOUCH touches are
 *   pending, the call runs the touch itself and returns its result tuple instead of a
 *   handle. `after`: the handle of a touch of the same cache not yet waited for; this one
 *   runs after it and starts from the log bounds it leaves (head and tail are then
 *   ignored), or gives RC_LRU_LOG_FULL without running when that one did.
 * lru_touch_wait(handle) -> (status, fresh, head, tail)
 *   Waits for the touch (GIL released) and releases its arrays. status RC_LRU_OK, or RC_LRU_LOG_FULL: no room
 *   in the log even after compaction (cannot happen with C >= 2 S; nothing logged).
 *
 * The result is the state lru_hits would leave (tests/kernels/test_touch.py). One
 * toucher thread runs the touches in the order they were started, its parallel parts on
 * csrc/pool.c's touch pool (the step's calls have a pool of their own); fork()
 * waits until it is idle, and the child starts its own on first need.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#include "lru_hits.h"
#include "lru_state.h"
#include "lru_touch.h"
#include "pool.h"
#include "pybuf.h"

#define MAX_TOUCH 32 /* touches pending at once (more: run by their caller) */

typedef struct {
    LruState *st; /* the arrays it touches (a reference, dropped at the wait) */
    Buf scr;      /* the keys: scratch i32[2n] */
    Py_ssize_t n, head, tail, fresh;
    long long batch;
    int threads, status;
    int state; /* 0 free, 1 queued or running, 2 done */
    int after; /* a queued job: the job whose log bounds it starts from, or -1 */
} TouchJob;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    TouchJob jobs[MAX_TOUCH];
    int queue[MAX_TOUCH]; /* job indices, oldest first, from qhead */
    int qhead, qlen, running, started;
} touch = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

/* Sorts one part's keys (scr[lo:hi], with scr[n + lo: n + hi] as the buffer) and counts
 * its distinct keys. */
static void *hits_sort(void *arg) {
    HitsPart *h = arg;
    Py_ssize_t m = h->hi - h->lo;
    int32_t *scr = h->scr + h->lo;
    rc_radix_sort(scr, h->scr + h->n + h->lo, m);
    Py_ssize_t n_u = m > 0;
    for (Py_ssize_t i = 1; i < m; i++) {
        n_u += scr[i] != scr[i - 1];
    }
    h->n_u = n_u;
    return NULL;
}

/* hits' work after its scan, on scan's keys (GIL not needed); `wait`: the toucher,
 * on the touch pool; 0: the caller itself, on the step's pool (not waited for if busy). */
static void touch_run(TouchJob *j, int wait) {
    const RowMap *map = j->st->map;
    int32_t *log = j->st->log, *log_pos = j->st->log_pos;
    int32_t *scr = j->scr.view.buf;
    int64_t *last_used = j->st->last_used;
    Py_ssize_t n = j->n, S = j->st->S, cap = j->st->cap, R = j->st->R;
    HitsPart part[MAXT];
    int K = rc_split_count(j->threads, n, HITS_GRAIN);
    for (int k = 0; k < K; k++) {
        part[k] = (HitsPart){NULL, map, last_used, log, log_pos, NULL, scr, n, S, 0,
                             j->batch, n * k / K, n * (k + 1) / K, 0, 0, 0, 0, 0, 0};
    }
    Pool *pool = rc_pool_get(wait ? POOL_TOUCH : POOL_STEP);
    rc_pool_parallel_on(pool, K, hits_sort, (char *)part, sizeof part[0], wait);
    int disjoint = 1;
    for (int k = 1; k < K; k++) {
        disjoint &= scr[part[k].lo - 1] < scr[part[k].lo]; /* last of k-1 < first of k */
    }
    if (!disjoint) { /* one part over the whole call, as lru_hits does */
        part[0].lo = 0;
        part[0].hi = n;
        K = 1;
        hits_sort(&part[0]);
    }
    Py_ssize_t n_u = 0;
    j->fresh = 0;
    for (int k = 0; k < K; k++) {
        n_u += part[k].n_u;
        /* the keys (row ids) are the map's rows: each part is sorted, so its ends bound it (a
         * check per part, not per key); a key out of range touches nothing (a ValueError) */
        if (part[k].hi > part[k].lo && (scr[part[k].lo] < 0 || scr[part[k].hi - 1] >= R)) {
            j->status = RC_LRU_BAD_ID;
            return;
        }
    }
    j->status = RC_LRU_OK;
    if (j->tail + n_u > cap) { /* lru_hits' RC_LRU_LOG_FULL, which the caller answers by compacting */
        j->tail = rc_compact_log(log, log_pos, S, j->head, j->tail, j->threads, pool, wait);
        j->head = 0;
        if (j->tail + n_u > cap) {
            j->status = RC_LRU_LOG_FULL;
            return;
        }
    }
    Py_ssize_t base = j->tail;
    for (int k = 0; k < K; k++) {
        part[k].base = base;
        base += part[k].n_u;
    }
    rc_pool_parallel_on(pool, K, rc_hits_touch, (char *)part, sizeof part[0], wait);
    for (int k = 0; k < K; k++) {
        j->fresh += part[k].fresh;
    }
    j->tail = base;
}

/* Job f starts from the log bounds of job j, which is done (under touch.mu). */
static void chain_from(TouchJob *f, const TouchJob *j) {
    f->head = j->head;
    f->tail = j->tail;
    f->status = j->status ? RC_LRU_LOG_FULL : RC_LRU_OK;
    f->after = -1;
}

static void *toucher(void *unused) {
    (void)unused;
    pthread_mutex_lock(&touch.mu);
    for (;;) {
        while (touch.qlen == 0) {
            pthread_cond_wait(&touch.work, &touch.mu);
        }
        TouchJob *j = &touch.jobs[touch.queue[touch.qhead]];
        touch.qhead = (touch.qhead + 1) % MAX_TOUCH;
        touch.qlen--;
        touch.running = 1;
        pthread_mutex_unlock(&touch.mu);
        if (j->status == RC_LRU_OK) { /* not a follower of a touch that failed */
            touch_run(j, 1);
        }
        pthread_mutex_lock(&touch.mu);
        /* a job queued after this one starts from the log bounds it leaves: handed over
         * before this one is done (and can be waited for, and its slot reused) */
        for (int q = 0; q < touch.qlen; q++) {
            TouchJob *f = &touch.jobs[touch.queue[(touch.qhead + q) % MAX_TOUCH]];
            if (f->after == j - touch.jobs) {
                chain_from(f, j);
            }
        }
        j->state = 2;
        touch.running = 0;
        pthread_cond_broadcast(&touch.done);
    }
    return NULL;
}

/* fork(): the parent waits until no touch is queued or running (the child has no
 * toucher, and its arrays must hold a finished touch); the child starts afresh. */
static void touch_prepare(void) {
    pthread_mutex_lock(&touch.mu);
    while (touch.qlen || touch.running) {
        pthread_cond_wait(&touch.done, &touch.mu);
    }
}

static void touch_parent(void) { pthread_mutex_unlock(&touch.mu); }

static void touch_child(void) {
    pthread_mutex_init(&touch.mu, NULL);
    pthread_cond_init(&touch.work, NULL);
    pthread_cond_init(&touch.done, NULL);
    touch.started = 0;
}

/* Starts the toucher (under touch.mu); 0 when the system refuses a thread. */
static int touch_start_thread(void) {
    if (touch.started) {
        return 1;
    }
    static int registered = 0;
    if (!registered) {
        registered = pthread_atfork(touch_prepare, touch_parent, touch_child) == 0;
    }
    sigset_t all, old; /* as the pool's workers: every signal blocked */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    touch.started = pthread_create(&th, &attr, toucher, NULL) == 0;
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return touch.started;
}

PyObject *rc_state_scan(LruState *st, PyObject *args) {
    PyObject *o_ids, *o_out, *o_scr;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOO|i", &o_ids, &o_out, &o_scr, &threads)) {
        return NULL;
    }
    Buf b[3];
    memset(b, 0, sizeof b);
    if (rc_buf_get(o_ids, &b[0], 8, 0, "ids") || rc_buf_get(o_out, &b[1], 4, 1, "out") ||
        rc_buf_get(o_scr, &b[2], 4, 1, "scratch")) {
        rc_buf_release(b, 3);
        return NULL;
    }
    Py_ssize_t n = COUNT(b[0]);
    if (COUNT(b[1]) < n || COUNT(b[2]) < 2 * n) {
        rc_buf_release(b, 3);
        PyErr_SetString(PyExc_ValueError, "LruState.scan: inconsistent shapes");
        return NULL;
    }
    HitsPart part[MAXT];
    int K = rc_split_count(threads, n, HITS_GRAIN);
    for (int k = 0; k < K; k++) {
        part[k] = (HitsPart){b[0].view.buf, st->map, NULL, NULL, NULL, b[1].view.buf,
                             b[2].view.buf, n, 0, st->R, 0, n * k / K, n * (k + 1) / K,
                             0, 0, 0, 0, 0, 1};
    }
    int status = RC_LRU_OK;
    Py_ssize_t a = 0;
    Py_BEGIN_ALLOW_THREADS
    rc_pool_parallel(K, rc_hits_scan, (char *)part, sizeof part[0]);
    Py_END_ALLOW_THREADS
    status = rc_scan_status(part, K, &a);
    rc_buf_release(b, 3);
    return Py_BuildValue("(in)", status, a);
}

static PyObject *touch_result(TouchJob *j) {
    if (j->status == RC_LRU_BAD_ID) {
        PyErr_SetString(PyExc_ValueError,
                        "LruState.touch_start: a key in scratch is not a row id (0 <= key < rows)");
        return NULL;
    }
    return Py_BuildValue("(innn)", j->status, j->fresh, j->head, j->tail);
}

/* Releases what a finished (or refused) job holds: its keys and its state (GIL held). */
static void job_release(TouchJob *j) {
    rc_buf_release(&j->scr, 1);
    Py_CLEAR(j->st);
}

PyObject *rc_state_touch_start(LruState *st, PyObject *args) {
    PyObject *o_scr;
    Py_ssize_t n, head, tail;
    long long batch;
    int threads = 1, after = -1;
    if (!PyArg_ParseTuple(args, "OnnnL|ii", &o_scr, &n, &head, &tail, &batch, &threads,
                          &after)) {
        return NULL;
    }
    if (after < -1 || after >= MAX_TOUCH) {
        PyErr_Format(PyExc_ValueError, "LruState.touch_start: no touch %d to follow", after);
        return NULL;
    }
    TouchJob job;
    memset(&job, 0, sizeof job);
    if (rc_buf_get(o_scr, &job.scr, 4, 1, "scratch")) {
        rc_buf_release(&job.scr, 1);
        return NULL;
    }
    if (n < 1 || COUNT(job.scr) < 2 * n || head < 0 || head > tail || tail > st->cap) {
        rc_buf_release(&job.scr, 1);
        PyErr_SetString(PyExc_ValueError, "LruState.touch_start: inconsistent shapes");
        return NULL;
    }
    Py_INCREF(st);
    job.st = st;
    job.n = n;
    job.head = head;
    job.tail = tail;
    job.batch = batch;
    job.threads = threads;
    job.state = 1;
    job.after = -1;
    int slot = -1, bad = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&touch.mu);
    if (after >= 0 && touch.jobs[after].state == 0) {
        bad = 1; /* nothing to follow: waited for already, or never started */
    } else if (after >= 0 && touch.jobs[after].state == 2) {
        chain_from(&job, &touch.jobs[after]);
    } else if (after >= 0) {
        job.after = after; /* handed over by the toucher when that one is done */
    }
    if (!bad && touch.qlen < MAX_TOUCH && touch_start_thread()) {
        for (int i = 0; i < MAX_TOUCH; i++) {
            if (touch.jobs[i].state == 0) {
                slot = i;
                break;
            }
        }
    }
    if (slot >= 0) {
        touch.jobs[slot] = job;
        touch.queue[(touch.qhead + touch.qlen) % MAX_TOUCH] = slot;
        touch.qlen++;
        pthread_cond_signal(&touch.work);
    }
    if (!bad && slot < 0 && job.after >= 0) { /* the caller touches: after that one */
        while (touch.jobs[after].state == 1) {
            pthread_cond_wait(&touch.done, &touch.mu);
        }
        chain_from(&job, &touch.jobs[after]);
    }
    pthread_mutex_unlock(&touch.mu);
    if (!bad && slot < 0 && job.status == RC_LRU_OK) { /* every slot pending (or no thread) */
        touch_run(&job, 0);
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        job_release(&job);
        PyErr_Format(PyExc_ValueError, "LruState.touch_start: no touch %d to follow", after);
        return NULL;
    }
    if (slot >= 0) {
        return PyLong_FromLong(slot);
    }
    PyObject *res = touch_result(&job);
    job_release(&job);
    return res;
}

PyObject *rc_lru_touch_wait(PyObject *self, PyObject *args) {
    int slot;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &slot)) {
        return NULL;
    }
    if (slot < 0 || slot >= MAX_TOUCH) {
        PyErr_Format(PyExc_ValueError, "lru_touch_wait: no touch %d", slot);
        return NULL;
    }
    TouchJob *j = &touch.jobs[slot];
    int state;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&touch.mu);
    while (j->state == 1) {
        pthread_cond_wait(&touch.done, &touch.mu);
    }
    state = j->state;
    pthread_mutex_unlock(&touch.mu);
    Py_END_ALLOW_THREADS
    if (state != 2) {
        PyErr_Format(PyExc_ValueError, "lru_touch_wait: no touch %d", slot);
        return NULL;
    }
    PyObject *res = touch_result(j);
    job_release(j); /* under the GIL; the slot is then free */
    pthread_mutex_lock(&touch.mu);
    j->state = 0;
    pthread_mutex_unlock(&touch.mu);
    return res;
}
