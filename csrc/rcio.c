/* rowcache.io._rcio (csrc/rcio.c): one batch of row reads, planned and run with the GIL
 * released, plus CRC32C. One file: the engine and the module that holds it (see below).
 *
 * Owns the I/O engine of rowcache.io.reader.RowReader: a Reader object keeps its store's
 * layout (set once: tables, shard files' descriptors, page checksums, merge options), one
 * io_uring (raw system calls, no liburing) or a persistent pool of pread threads, and runs
 * a batch of rows in one GIL-free call: it locates each row in its shard file, plans the
 * extents (whole 4 KiB pages, sorted by file and offset, neighbours within merge_gap
 * merged, no extent across a max_extent window: the same plan as rowcache.io.plan's
 * ReadPlanner, which is its reference), reads them with min(n, queue_depth) in flight,
 * verifies the CRC32C of every page read and cuts the records into the caller's buffer.
 * A batch's result is a BatchResult (a struct sequence) whose status and fields are
 * csrc/rcio_status.h's; the error messages are worded in Python (rowcache.io.pyengine),
 * from those fields, on the same plan. Only libc and the kernel's io_uring ABI are used.
 *
 * The engine (CRC32C, the pread pool, io_uring) and the Python object are not split into
 * files: the Reader starts and stops the pool's threads on the pool's own fields, and the
 * process-wide count of foreground batches (demand_batches) is kept by both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "rcio_status.h" /* a batch's status and result fields, shared with Python */

#define PAGE 4096
#define RETRIES 1000 /* EINTR/EAGAIN retries of one read before it counts as failed */
#define YIELD_NS 20000 /* a background batch with nothing in flight rechecks this often */

/* Foreground batches (any Reader of the process made without `background`) reading now.
 * A background Reader (prefetch) submits no new read while it is > 0: its reads already in
 * flight finish, and the demand fault gets the disk's queue to itself. */
static int demand_batches;

static int demand_reading(int background) {
    return background && __atomic_load_n(&demand_batches, __ATOMIC_ACQUIRE) > 0;
}

static void yield_pause(void) {
    struct timespec t = {0, YIELD_NS};
    nanosleep(&t, NULL);
}

/* ---- CRC32C (Castagnoli, reflected 0x82F63B78; crc32c(data, 0) of the crc32c package) ---- */
static uint32_t crc_table[256];
static int have_sse42;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        crc_table[i] = c;
    }
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_sse42 = !!__builtin_cpu_supports("sse4.2");
#endif
}

static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
    while (n--) crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p,
                                                           size_t n) {
    uint64_t c = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return ~c32;
}
#endif

static uint32_t crc32c(uint32_t crc, const uint8_t *p, size_t n) {
#if defined(__x86_64__)
    if (have_sse42) return crc_hw(crc, p, n);
#endif
    return crc_sw(crc, p, n);
}

/* ---- one batch ---- */
typedef struct {
    Py_ssize_t n;
    const int32_t *fd;
    const int64_t *off, *len, *pos, *need;
    int64_t *got;
    int32_t *err; /* 0 ok, errno, or -1: end of file before `need` bytes */
    uint8_t *buf;
    int direct;
    const uint32_t *crc; /* expected crc32c of buffer page k (pos / PAGE), or NULL: no checks */
    uint8_t *bad;        /* set for each page whose crc32c differs */
} batch_t;

/* After got > 0 bytes of a read: is the rest worth asking for? (An O_DIRECT read that
 * stops off a 512-byte boundary stopped at end of file; another request would be EINVAL.) */
static int more(const batch_t *b, Py_ssize_t i, int64_t got) {
    return got < b->len[i] && !(b->direct && (got & 511));
}

/* A read is done: its status, and its pages checked right away (by the thread that read
 * them, or between io_uring completions), so the checks overlap the reads still in flight. */
static void finish(batch_t *b, Py_ssize_t i, int64_t got, int err) {
    if (!err && got < b->need[i]) err = -1;
    b->got[i] = got;
    b->err[i] = err;
    if (err || !b->crc) return;
    for (int64_t q = 0; q < b->len[i]; q += PAGE) {
        int64_t L = got - q < PAGE ? got - q : PAGE, k = (b->pos[i] + q) / PAGE;
        b->bad[k] |= L <= 0 || crc32c(0, b->buf + b->pos[i] + q, (size_t)L) != b->crc[k];
    }
}

static void pread_one(batch_t *b, Py_ssize_t i) {
    int64_t got = 0;
    int err = 0, tries = 0;
    for (;;) {
        ssize_t r = pread(b->fd[i], b->buf + b->pos[i] + got, (size_t)(b->len[i] - got),
                          b->off[i] + got);
        if (r < 0) {
            if ((errno == EINTR || errno == EAGAIN) && ++tries < RETRIES) continue;
            err = errno;
            break;
        }
        if (r == 0) break;
        got += r;
        if (!more(b, i, got)) break;
    }
    finish(b, i, got, err);
}

/* ---- the pread thread pool (persistent; the calling thread works too) ---- */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    pthread_t *th;
    int nth, tickets, busy, stop, background;
    batch_t *b;
    Py_ssize_t next;
} pool_t;

static void pool_share(pool_t *p, batch_t *b) {
    for (;;) {
        while (demand_reading(p->background)) yield_pause();
        Py_ssize_t i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (i >= b->n) return;
        pread_one(b, i);
    }
}

static void *pool_worker(void *arg) {
    pool_t *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->tickets && !p->stop) pthread_cond_wait(&p->go, &p->mu);
        if (p->stop) break;
        p->tickets--;
        batch_t *b = p->b;
        pthread_mutex_unlock(&p->mu);
        pool_share(p, b);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_run(pool_t *p, batch_t *b, int qd) {
    int want = (int)(b->n < qd ? b->n : qd) - 1; /* helpers besides the caller */
    while (p->nth < want) {
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setstacksize(&a, 1 << 16);
        int rc = pthread_create(&p->th[p->nth], &a, pool_worker, p);
        pthread_attr_destroy(&a);
        if (rc) {
            want = p->nth; /* run with the threads we have (the caller alone, at worst) */
            break;
        }
        p->nth++;
    }
    p->next = 0;
    if (want > 0) {
        pthread_mutex_lock(&p->mu);
        p->b = b;
        p->tickets = p->busy = want;
        if (want == p->nth) pthread_cond_broadcast(&p->go);
        else
            for (int k = 0; k < want; k++) pthread_cond_signal(&p->go);
        pthread_mutex_unlock(&p->mu);
    }
    pool_share(p, b);
    if (want > 0) {
        pthread_mutex_lock(&p->mu);
        while (p->busy) pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

/* ---- io_uring through raw system calls ---- */
typedef struct {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz, sqes_sz;
    Py_ssize_t *resub; /* reads to submit again (short or interrupted), <= queue depth */
} uring_t;

static void uring_close(uring_t *u) {
    if (u->sqes) munmap(u->sqes, u->sqes_sz);
    if (u->cq_ptr && u->cq_ptr != u->sq_ptr) munmap(u->cq_ptr, u->cq_sz);
    if (u->sq_ptr) munmap(u->sq_ptr, u->sq_sz);
    if (u->fd >= 0) close(u->fd);
    PyMem_RawFree(u->resub);
    memset(u, 0, sizeof *u);
    u->fd = -1;
}

static int uring_open(uring_t *u, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    memset(u, 0, sizeof *u);
    u->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (u->fd < 0) return -errno;
    u->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    u->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) u->sq_sz = u->cq_sz = u->sq_sz > u->cq_sz ? u->sq_sz : u->cq_sz;
    u->sq_ptr = mmap(0, u->sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, u->fd,
                     IORING_OFF_SQ_RING);
    if (u->sq_ptr == MAP_FAILED) goto fail;
    u->cq_ptr = u->sq_ptr;
    if (!(p.features & IORING_FEAT_SINGLE_MMAP)) {
        u->cq_ptr = mmap(0, u->cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, u->fd,
                         IORING_OFF_CQ_RING);
        if (u->cq_ptr == MAP_FAILED) goto fail;
    }
    u->sqes_sz = p.sq_entries * sizeof(struct io_uring_sqe);
    u->sqes = mmap(0, u->sqes_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, u->fd,
                   IORING_OFF_SQES);
    if (u->sqes == MAP_FAILED) goto fail;
    char *sq = u->sq_ptr, *cq = u->cq_ptr;
    u->sq_head = (unsigned *)(sq + p.sq_off.head);
    u->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    u->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    u->sq_array = (unsigned *)(sq + p.sq_off.array);
    u->cq_head = (unsigned *)(cq + p.cq_off.head);
    u->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    u->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    u->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    u->resub = PyMem_RawMalloc(p.sq_entries * sizeof(Py_ssize_t));
    if (!u->resub) {
        errno = ENOMEM;
        goto fail;
    }
    return 0;
fail: {
    int e = errno;
    if (u->sq_ptr == MAP_FAILED) u->sq_ptr = NULL;
    if (u->cq_ptr == MAP_FAILED) u->cq_ptr = NULL;
    if (u->sqes == MAP_FAILED) u->sqes = NULL;
    uring_close(u);
    return -e;
}
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Runs batch b with min(n, qd) reads in flight. Returns 0, or -errno when io_uring_enter
 * itself fails (reads may then still be in flight: the caller must never reuse `buf`).
 * spin_ns > 0 and a batch of one wave (n <= qd): after submitting, wait for the next
 * completion by polling the completion ring for up to spin_ns before sleeping in
 * io_uring_enter. A sleeping caller pays the wake-up on every completion (~5-16 us a
 * read on the measured machines, and the code after it runs on a cooled core). A longer
 * batch sleeps: completions that arrive while the caller runs in user space each kick it
 * into the kernel, and a k = 192 batch at queue depth 64 read slower polling than
 * sleeping on the H200 machine (docs/benchmarks.md, "Figures the code cites"). A
 * background batch submits nothing while a foreground batch reads (demand_batches): it
 * reaps what it has in flight and waits. */
static int uring_run(uring_t *u, batch_t *b, int qd, int64_t spin_ns, int background) {
    if (b->n > qd) spin_ns = 0;
    Py_ssize_t next = 0, done = 0, nres = 0;
    int inflight = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) b->got[i] = b->err[i] = 0;
    while (done < b->n) {
        unsigned tail = *u->sq_tail, mask = *u->sq_mask;
        int paused = demand_reading(background);
        if (paused && !inflight) { /* nothing of ours in flight: wait out the demand batch */
            yield_pause();
            continue;
        }
        while (!paused && inflight < qd && (nres || next < b->n)) {
            Py_ssize_t i = nres ? u->resub[--nres] : next++;
            unsigned idx = tail & mask;
            struct io_uring_sqe *s = &u->sqes[idx];
            memset(s, 0, sizeof *s);
            s->opcode = IORING_OP_READ;
            s->fd = b->fd[i];
            s->off = (uint64_t)(b->off[i] + b->got[i]);
            s->addr = (uint64_t)(uintptr_t)(b->buf + b->pos[i] + b->got[i]);
            s->len = (uint32_t)(b->len[i] - b->got[i]);
            s->user_data = (uint64_t)i;
            u->sq_array[idx] = idx;
            tail++;
            inflight++;
        }
        __atomic_store_n(u->sq_tail, tail, __ATOMIC_RELEASE);
        unsigned pending = tail - __atomic_load_n(u->sq_head, __ATOMIC_ACQUIRE);
        int wait = 1;
        if (spin_ns > 0) {
            if (pending && syscall(__NR_io_uring_enter, u->fd, pending, 0, 0, NULL, 0) < 0 &&
                errno != EINTR && errno != EAGAIN && errno != EBUSY)
                return -errno;
            int64_t t0 = now_ns();
            while (__atomic_load_n(u->cq_tail, __ATOMIC_ACQUIRE) == *u->cq_head &&
                   now_ns() - t0 < spin_ns)
                cpu_relax();
            wait = __atomic_load_n(u->cq_tail, __ATOMIC_ACQUIRE) == *u->cq_head;
            pending = tail - __atomic_load_n(u->sq_head, __ATOMIC_ACQUIRE);
        }
        if (wait && syscall(__NR_io_uring_enter, u->fd, pending, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0 &&
            errno != EINTR && errno != EAGAIN && errno != EBUSY)
            return -errno;
        unsigned head = *u->cq_head, ctail = __atomic_load_n(u->cq_tail, __ATOMIC_ACQUIRE);
        for (; head != ctail; head++) {
            struct io_uring_cqe *c = &u->cqes[head & *u->cq_mask];
            Py_ssize_t i = (Py_ssize_t)c->user_data;
            int res = c->res;
            inflight--;
            if (res == -EINTR || res == -EAGAIN) {
                if (++b->err[i] < RETRIES) { /* err counts retries until the read ends */
                    u->resub[nres++] = i;
                    continue;
                }
                b->err[i] = 0;
                finish(b, i, b->got[i], -res);
            } else if (res < 0) {
                finish(b, i, b->got[i], -res);
            } else if (res > 0 && more(b, i, b->got[i] + res)) {
                b->got[i] += res;
                u->resub[nres++] = i;
                continue;
            } else {
                finish(b, i, b->got[i] + res, 0);
            }
            done++;
        }
        __atomic_store_n(u->cq_head, head, __ATOMIC_RELEASE);
    }
    return 0;
}

/* ---- the Python object: layout, scratch, and one fault per call ---- */
enum { L_ROWS, L_RPP, L_PPS, L_PGB, L_REC, L_FBASE, L_FDS, L_CRC, L_CRCBASE, NL };

typedef struct {
    int64_t file, off;
    Py_ssize_t i; /* index in the caller's order */
} rowref_t;

/* One batch's arguments, checked (read_runs and read_runs_start). */
typedef struct {
    Py_buffer v[5]; /* rows, bounds, tables, bases, out: held until the batch ends */
    const int64_t *rows, *bounds, *bases;
    const int32_t *tables;
    uint8_t *out;
    Py_ssize_t n, P;
    int64_t rec;
    int verify;
} runargs_t;

/* A batch run on the reader's own thread (read_runs_start .. read_runs_join). */
typedef struct {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    int started, stop, state; /* state: 0 none, 1 running, 2 finished (not joined) */
    runargs_t args;
    Py_buffer ctlv;
    int32_t *ctl, seq;
    int64_t st[RC_B_N];
} async_t;

typedef struct {
    PyObject_HEAD
    int qd, use_uring, split, broken, have_layout, direct, background;
    int64_t merge_gap, max_extent, spin_ns;
    Py_buffer lay[NL]; /* held for the reader's life; fds is Python's, updated in place */
    uring_t ring;
    pool_t pool;
    pthread_mutex_t lock; /* one batch at a time per reader */
    rowref_t *rr;
    int32_t *e_fd, *p_read, *e_err;
    int64_t *e_off, *e_len, *e_pos, *e_need, *e_got, *src, *p_pos;
    uint32_t *p_crc;
    uint8_t *p_bad, *buf;
    Py_ssize_t cap_rows, cap_pages, cap_buf;
    async_t async;
} Reader;

static int Reader_init(Reader *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"queue_depth", "engine", "spin_us", "background", NULL};
    int qd = 32, spin_us = 0, background = 0;
    const char *engine = "auto";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|isip", names, &qd, &engine, &spin_us, &background))
        return -1;
    if (qd < 1 || qd > 1024) {
        PyErr_Format(PyExc_ValueError, "queue_depth=%d: give 1..1024", qd);
        return -1;
    }
    if (spin_us < 0 || spin_us > 100000) {
        PyErr_Format(PyExc_ValueError, "spin_us=%d: give 0..100000", spin_us);
        return -1;
    }
    self->spin_ns = (int64_t)spin_us * 1000;
    /* uring+threads: io_uring for a batch of at most qd reads (one wave: its latency), the
     * pread threads for a longer one (on a multi-queue virtio disk, threads submitting from
     * several cores read it 1.2-1.4x faster than one thread's ring: docs/qwen4.md) */
    int split = !strcmp(engine, "uring+threads");
    int want_uring = split || !strcmp(engine, "uring"), auto_ = !strcmp(engine, "auto");
    if (!want_uring && !auto_ && strcmp(engine, "threads")) {
        PyErr_Format(PyExc_ValueError, "engine=%s: allowed: auto, uring, threads, uring+threads",
                     engine);
        return -1;
    }
    if (self->pool.th) {
        PyErr_SetString(PyExc_RuntimeError, "Reader is already initialised");
        return -1;
    }
    self->qd = qd;
    self->split = split;
    self->background = self->pool.background = background;
    self->ring.fd = -1;
    pthread_mutex_init(&self->lock, NULL);
    pthread_mutex_init(&self->pool.mu, NULL);
    pthread_cond_init(&self->pool.go, NULL);
    pthread_cond_init(&self->pool.done, NULL);
    self->pool.th = PyMem_RawCalloc((size_t)qd, sizeof(pthread_t));
    if (!self->pool.th) {
        PyErr_NoMemory();
        return -1;
    }
    if (want_uring || auto_) {
        int rc = uring_open(&self->ring, (unsigned)qd);
        if (rc == 0) self->use_uring = 1;
        else if (want_uring || (rc != -ENOSYS && rc != -EPERM)) {
            errno = -rc;
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, "io_uring_setup");
            return -1;
        }
    }
    return 0;
}

static void scratch_free(Reader *s) {
    void *p[] = {s->rr, s->e_fd, s->e_err, s->e_off, s->e_len, s->e_pos, s->e_need, s->e_got,
                 s->src, s->p_pos, s->p_read, s->p_crc, s->p_bad};
    for (size_t k = 0; k < sizeof p / sizeof *p; k++) free(p[k]);
    if (!s->broken) free(s->buf); /* a broken ring may still write into buf: leak it */
}

static void async_wait(async_t *j);
static void runargs_release(runargs_t *a);

static void Reader_dealloc(Reader *self) {
    async_t *j = &self->async;
    if (j->started) { /* a batch in flight writes into its buffers: wait, then stop */
        Py_BEGIN_ALLOW_THREADS
        async_wait(j);
        Py_END_ALLOW_THREADS
        pthread_mutex_lock(&j->mu);
        j->stop = 1;
        pthread_cond_broadcast(&j->go);
        pthread_mutex_unlock(&j->mu);
        pthread_join(j->th, NULL);
        runargs_release(&j->args);
        if (j->ctlv.obj) PyBuffer_Release(&j->ctlv);
    }
    if (self->pool.th) {
        pthread_mutex_lock(&self->pool.mu);
        self->pool.stop = 1;
        pthread_cond_broadcast(&self->pool.go);
        pthread_mutex_unlock(&self->pool.mu);
        for (int k = 0; k < self->pool.nth; k++) pthread_join(self->pool.th[k], NULL);
        PyMem_RawFree(self->pool.th);
    }
    if (self->ring.fd >= 0 && !self->broken) uring_close(&self->ring);
    for (int k = 0; k < NL; k++)
        if (self->lay[k].obj) PyBuffer_Release(&self->lay[k]);
    scratch_free(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A C-contiguous buffer of exactly n items of `size` bytes (n < 0: any length). */
static int getbuf(PyObject *o, Py_buffer *v, Py_ssize_t size, Py_ssize_t n, int writable,
                  const char *name) {
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if ((n >= 0 && v->len != size * n) || v->len % size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", name, v->len, size * n);
        PyBuffer_Release(v);
        v->obj = NULL;
        return -1;
    }
    return 0;
}

#define L64(s, k) ((const int64_t *)(s)->lay[k].buf)

/* set_layout(rows, rows_per_page, pages_per_shard, page_bytes, record_bytes [int64 per
 * table], file_base int64[T + 1], fds int32[F] (kept, read at every call), crc uint32[] or
 * None, crc_base int64[F + 1] or None, merge_gap, max_extent, direct) */
static PyObject *Reader_set_layout(Reader *self, PyObject *args) {
    PyObject *o[NL];
    long long gap, maxe;
    int direct;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOLLp", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                          &o[7], &o[8], &gap, &maxe, &direct))
        return NULL;
    if (self->have_layout) {
        PyErr_SetString(PyExc_RuntimeError, "set_layout: the layout is already set");
        return NULL;
    }
    static const char *nm[NL] = {"rows", "rows_per_page", "pages_per_shard", "page_bytes",
                                 "record_bytes", "file_base", "fds", "crc", "crc_base"};
    Py_ssize_t T = PyObject_Length(o[0]);
    if (T < 1 || maxe < PAGE || gap < 0) {
        PyErr_SetString(PyExc_ValueError, "set_layout: bad table count, merge_gap or max_extent");
        return NULL;
    }
    for (int k = 0; k < NL; k++) {
        if (o[k] == Py_None && k >= L_CRC) continue;
        Py_ssize_t want = k < L_FBASE ? T : k == L_FBASE ? T + 1 : -1;
        if (getbuf(o[k], &self->lay[k], k == L_FDS || k == L_CRC ? 4 : 8, want, k == L_FDS, nm[k]) < 0)
            goto fail;
    }
    Py_ssize_t F = self->lay[L_FDS].len / 4;
    if (L64(self, L_FBASE)[T] != F || (self->lay[L_CRC].obj && self->lay[L_CRCBASE].len != 8 * (F + 1)) ||
        (self->lay[L_CRC].obj && L64(self, L_CRCBASE)[F] != self->lay[L_CRC].len / 4)) {
        PyErr_SetString(PyExc_ValueError, "set_layout: file_base, fds, crc and crc_base disagree");
        goto fail;
    }
    for (Py_ssize_t t = 0; t < T; t++)
        if (L64(self, L_RPP)[t] < 1 || L64(self, L_PPS)[t] < 1 || L64(self, L_REC)[t] < 1 ||
            L64(self, L_PGB)[t] % PAGE || L64(self, L_REC)[t] > L64(self, L_PGB)[t] ||
            L64(self, L_RPP)[t] > L64(self, L_PGB)[t] / L64(self, L_REC)[t]) {
            PyErr_Format(PyExc_ValueError, "set_layout: table %zd has a bad page layout", t);
            goto fail;
        }
    /* every row's file index (file_base[t] + its shard) must name one of the fds: the
     * bases rise from 0 and each table has a file for every shard its rows fill */
    const int64_t *fb = L64(self, L_FBASE);
    for (Py_ssize_t t = 0; t < T; t++) {
        int64_t nr = L64(self, L_ROWS)[t], rpp = L64(self, L_RPP)[t], pps = L64(self, L_PPS)[t];
        int64_t pages = nr / rpp + (nr % rpp != 0), shards = pages / pps + (pages % pps != 0);
        if ((t == 0 && fb[0] != 0) || nr < 0 || fb[t + 1] < fb[t] || fb[t + 1] - fb[t] < shards) {
            PyErr_Format(PyExc_ValueError,
                         "set_layout: table %zd's files (file_base) do not cover its %lld rows", t,
                         (long long)nr);
            goto fail;
        }
    }
    if (self->lay[L_CRC].obj) { /* each file's page checksums: a rising range of crc */
        const int64_t *cb = L64(self, L_CRCBASE);
        for (Py_ssize_t f = 0; f < F; f++)
            if ((f == 0 && cb[0] != 0) || cb[f + 1] < cb[f]) {
                PyErr_SetString(PyExc_ValueError, "set_layout: crc_base does not rise from 0");
                goto fail;
            }
    }
    self->merge_gap = gap, self->max_extent = maxe, self->direct = direct, self->have_layout = 1;
    Py_RETURN_NONE;
fail:
    for (int k = 0; k < NL; k++)
        if (self->lay[k].obj) PyBuffer_Release(&self->lay[k]);
    memset(self->lay, 0, sizeof self->lay);
    return NULL;
}

static int grow(void **p, Py_ssize_t *cap, Py_ssize_t n, size_t size) {
    if (n <= *cap) return 0;
    void *q = realloc(*p, (size_t)n * size);
    if (!q) return -1;
    *p = q;
    return 0;
}

static int scratch(Reader *s, Py_ssize_t n) {
    if (n <= s->cap_rows) return 0;
    Py_ssize_t c = s->cap_rows, m = n < 2 * c ? 2 * c : n;
    if (grow((void **)&s->rr, &c, m, sizeof(rowref_t)) || grow((void **)&s->e_fd, &c, m, 4) ||
        grow((void **)&s->e_err, &c, m, 4) || grow((void **)&s->e_off, &c, m, 8) ||
        grow((void **)&s->e_len, &c, m, 8) || grow((void **)&s->e_pos, &c, m, 8) ||
        grow((void **)&s->e_need, &c, m, 8) || grow((void **)&s->e_got, &c, m, 8) ||
        grow((void **)&s->src, &c, m, 8))
        return -1;
    s->cap_rows = m;
    return 0;
}

static int cmp_row(const void *a, const void *b) {
    const rowref_t *x = a, *y = b;
    if (x->file != y->file) return x->file < y->file ? -1 : 1;
    if (x->off != y->off) return x->off < y->off ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}


static void runargs_release(runargs_t *a) {
    for (int k = 0; k < 5; k++)
        if (a->v[k].obj) PyBuffer_Release(&a->v[k]);
    memset(a->v, 0, sizeof a->v);
}

/* Parse and check read_runs' arguments into a (its buffers held); 0, or -1 with an
 * exception set and nothing held. */
static int runargs_parse(Reader *self, PyObject *const *o, int verify, runargs_t *a) {
    memset(a, 0, sizeof *a);
    if (!self->have_layout) {
        PyErr_SetString(PyExc_RuntimeError, "read_runs: call set_layout first");
        return -1;
    }
    Py_buffer *v = a->v;
    Py_ssize_t P = PyObject_Length(o[2]);
    if (P < 0 || getbuf(o[0], &v[0], 8, -1, 0, "rows") || getbuf(o[1], &v[1], 8, P + 1, 0, "bounds") ||
        getbuf(o[2], &v[2], 4, P, 0, "tables") || getbuf(o[3], &v[3], 8, P, 0, "bases") ||
        getbuf(o[4], &v[4], 1, -1, 1, "out"))
        goto fail;
    a->rows = v[0].buf, a->bounds = v[1].buf, a->bases = v[3].buf, a->tables = v[2].buf;
    a->out = v[4].buf, a->n = v[0].len / 8, a->P = P, a->verify = verify;
    Py_ssize_t T = self->lay[L_ROWS].len / 8;
    int64_t rec = -1;
    if (P ? (a->bounds[0] != 0 || a->bounds[P] != a->n) : a->n != 0) goto bad_args; /* rows need parts */
    for (Py_ssize_t k = 0; k < P; k++) {
        int32_t t = a->tables[k];
        if (t < 0 || t >= T || a->bounds[k + 1] < a->bounds[k]) goto bad_args;
        if (rec < 0) rec = L64(self, L_REC)[t];
        if (L64(self, L_REC)[t] != rec) goto bad_args;
    }
    if (a->n && v[4].len < a->n * rec) goto bad_args;
    a->rec = rec;
    return 0;
bad_args:
    PyErr_SetString(PyExc_ValueError, "read_runs: bounds, tables or out do not fit the rows");
fail:
    runargs_release(a);
    return -1;
}

/* Run one checked batch, without the GIL: st as read_runs returns it (st[RC_B_STATUS] < 0: -errno of
 * a failed allocation or io_uring_enter). */
static void run_batch(Reader *self, const runargs_t *a, int64_t st[RC_B_N]) {
    const int64_t *rows = a->rows, *bounds = a->bounds, *bases = a->bases;
    const int32_t *tables = a->tables;
    Py_ssize_t n = a->n, P = a->P;
    int64_t rec = a->rec;
    int checks = a->verify && self->lay[L_CRC].obj;
    const int32_t *fds = self->lay[L_FDS].buf;
    memset(st, 0, RC_B_N * sizeof *st);
    pthread_mutex_lock(&self->lock);
    if (scratch(self, n)) st[RC_B_STATUS] = -ENOMEM;
    /* locate every row; sorted already when the parts come in file order */
    int sorted = 1;
    for (Py_ssize_t k = 0; k < P && !st[RC_B_STATUS]; k++) {
        Py_ssize_t t = tables[k];
        int64_t rpp = L64(self, L_RPP)[t], pps = L64(self, L_PPS)[t], pgb = L64(self, L_PGB)[t],
                nr = L64(self, L_ROWS)[t], fb = L64(self, L_FBASE)[t];
        for (Py_ssize_t i = bounds[k]; i < bounds[k + 1]; i++) {
            int64_t r = rows[i] - bases[k];
            if (r < 0 || r >= nr) {
                st[RC_B_STATUS] = RC_READ_BAD_ROW, st[RC_B_AT] = i, st[RC_B_ROW] = r;
                break;
            }
            int64_t page = r / rpp;
            rowref_t *x = &self->rr[i];
            x->file = fb + page / pps;
            x->off = (page % pps) * pgb + (r % rpp) * rec;
            x->i = i;
            if (i && (x->file < x[-1].file || (x->file == x[-1].file && x->off < x[-1].off))) sorted = 0;
        }
    }
    if (!st[RC_B_STATUS] && !sorted) qsort(self->rr, (size_t)n, sizeof(rowref_t), cmp_row);
    /* extents: whole pages, merged within merge_gap, capped by max_extent windows */
    Py_ssize_t E = 0, total = 0;
    for (Py_ssize_t i = 0; i < n && !st[RC_B_STATUS]; i++) {
        rowref_t *x = &self->rr[i];
        int64_t s0 = x->off - x->off % PAGE, e0 = (x->off + rec + PAGE - 1) / PAGE * PAGE;
        int joined = 0;
        if (i) {
            rowref_t *y = x - 1;
            int64_t ye = (y->off + rec + PAGE - 1) / PAGE * PAGE, ys = y->off - y->off % PAGE;
            joined = x->file == y->file && s0 - ye <= self->merge_gap &&
                     (e0 - 1) / self->max_extent == ys / self->max_extent;
        }
        if (!joined) {
            if (fds[x->file] < 0) {
                st[RC_B_STATUS] = RC_READ_NOT_OPEN, st[RC_B_FILE] = x->file;
                break;
            }
            if (E) total += self->e_len[E - 1];
            self->e_fd[E] = fds[x->file], self->e_off[E] = s0, self->e_pos[E] = total;
            self->e_got[E] = x->file; /* the file id, until the reads overwrite it */
            E++;
        }
        self->e_len[E - 1] = e0 - self->e_off[E - 1];
        self->e_need[E - 1] = x->off + rec - self->e_off[E - 1];
        self->src[x->i] = self->e_pos[E - 1] + x->off - self->e_off[E - 1];
    }
    if (E) total += self->e_len[E - 1];
    Py_ssize_t npg = checks ? total / PAGE : 0;
    int64_t *efile = NULL;
    if (!st[RC_B_STATUS] && (grow((void **)&self->p_pos, &self->cap_pages, npg, 8) ||
                   grow((void **)&self->p_read, &self->cap_pages, npg, 4) ||
                   grow((void **)&self->p_crc, &self->cap_pages, npg, 4) ||
                   grow((void **)&self->p_bad, &self->cap_pages, npg, 1) ||
                   !(efile = malloc(sizeof(int64_t) * (size_t)(E ? E : 1)))))
        st[RC_B_STATUS] = -ENOMEM;
    if (!st[RC_B_STATUS]) {
        if (npg > self->cap_pages) self->cap_pages = npg;
        memcpy(efile, self->e_got, sizeof(int64_t) * (size_t)E);
        const uint32_t *crc = checks ? self->lay[L_CRC].buf : NULL;
        const int64_t *cb = checks ? L64(self, L_CRCBASE) : NULL;
        for (Py_ssize_t e = 0, j = 0; e < E && checks; e++)
            for (int64_t q = 0; q < self->e_len[e] / PAGE; q++, j++) {
                int64_t at = cb[efile[e]] + self->e_off[e] / PAGE + q;
                self->p_pos[j] = self->e_pos[e] + q * PAGE;
                self->p_read[j] = (int32_t)e;
                self->p_bad[j] = at >= cb[efile[e] + 1]; /* a page the store has no crc for */
                self->p_crc[j] = self->p_bad[j] ? 0 : crc[at];
            }
        if (total > self->cap_buf) {
            if (!self->broken) free(self->buf);
            self->buf = NULL;
            Py_ssize_t c = total < 2 * self->cap_buf ? 2 * self->cap_buf : total;
            if (posix_memalign((void **)&self->buf, PAGE, (size_t)c)) st[RC_B_STATUS] = -ENOMEM, c = 0;
            self->cap_buf = c;
        }
    }
    if (!st[RC_B_STATUS] && E) {
        batch_t b = {E, self->e_fd, self->e_off, self->e_len, self->e_pos, self->e_need,
                     self->e_got, self->e_err, self->buf, self->direct,
                     npg ? self->p_crc : NULL, self->p_bad};
        int rc = 0;
        if (!self->background) __atomic_add_fetch(&demand_batches, 1, __ATOMIC_RELEASE);
        if (self->use_uring && !self->broken && !(self->split && E > self->qd)) {
            rc = uring_run(&self->ring, &b, self->qd, self->spin_ns, self->background);
            /* Never reuse a ring (or buffer) that may hold reads in flight: threads from now. */
            if (rc) self->broken = 1, self->cap_buf = 0, st[RC_B_STATUS] = rc;
        } else {
            pool_run(&self->pool, &b, self->qd);
        }
        if (!self->background) __atomic_sub_fetch(&demand_batches, 1, __ATOMIC_RELEASE);
        for (Py_ssize_t e = 0; e < E && !rc; e++)
            if (self->e_err[e] && !st[RC_B_READS]++)
                st[RC_B_STATUS] = RC_READ_FAILED, st[RC_B_AT] = e, st[RC_B_FILE] = efile[e],
                st[RC_B_OFFSET] = self->e_off[e], st[RC_B_GOT] = self->e_got[e],
                st[RC_B_WANT] = self->e_need[e], st[RC_B_CODE] = self->e_err[e];
        for (Py_ssize_t j = 0; j < npg && !st[RC_B_STATUS]; j++) {
            if (!self->p_bad[j]) continue;
            int32_t r = self->p_read[j];
            if (!st[RC_B_CODE]++) {
                int64_t L = self->e_pos[r] + self->e_got[r] - self->p_pos[j];
                L = L > PAGE ? PAGE : L;
                st[RC_B_AT] = r, st[RC_B_FILE] = efile[r];
                st[RC_B_OFFSET] = self->e_off[r] + self->p_pos[j] - self->e_pos[r];
                st[RC_B_GOT] = L > 0 ? crc32c(0, self->buf + self->p_pos[j], (size_t)L) : 0;
                st[RC_B_WANT] = self->p_crc[j];
            }
        }
        if (!st[RC_B_STATUS] && st[RC_B_CODE]) st[RC_B_STATUS] = RC_READ_BAD_PAGE;
        else if (!st[RC_B_STATUS]) {
            uint8_t *dst = a->out;
            for (Py_ssize_t i = 0; i < n; i++) memcpy(dst + i * rec, self->buf + self->src[i], (size_t)rec);
        }
    }
    if (st[RC_B_STATUS] != RC_READ_FAILED) st[RC_B_READS] = E;
    st[RC_B_NBYTES] = total;
    free(efile);
    pthread_mutex_unlock(&self->lock);
}

/* A batch's result: a BatchResult, fields as csrc/rcio_status.h's RC_B_*. */
static PyTypeObject *BatchResultType;
static PyStructSequence_Field batch_fields[] = {
    {"status", "READ_OK, READ_FAILED, READ_BAD_PAGE, READ_NOT_OPEN or READ_BAD_ROW"},
    {"reads", "read ops of the plan (READ_FAILED: the reads that failed, in all)"},
    {"nbytes", "bytes of the plan's extents"},
    {"at", "READ_FAILED, READ_BAD_PAGE: the extent; READ_BAD_ROW: the row's index in rows"},
    {"file", "READ_FAILED, READ_BAD_PAGE, READ_NOT_OPEN: the file's index in the layout"},
    {"offset", "READ_FAILED: the extent's file offset; READ_BAD_PAGE: the page's"},
    {"got", "READ_FAILED: bytes read of the extent; READ_BAD_PAGE: the page's CRC32C as read"},
    {"want", "READ_FAILED: bytes it needed; READ_BAD_PAGE: the CRC32C the store holds"},
    {"code", "READ_FAILED: errno, or -1 short; READ_BAD_PAGE: the bad pages, in all"},
    {"row", "READ_BAD_ROW: the row, of its table"},
    {NULL, NULL}};
static PyStructSequence_Desc batch_desc = {
    "rowcache.io._rcio.BatchResult", "What a batch of read_runs did (csrc/rcio_status.h).",
    batch_fields, RC_B_N};

/* The result of a batch: a BatchResult, or OSError for st[RC_B_STATUS] < 0. */
static PyObject *batch_result(const int64_t st[RC_B_N]) {
    if (st[RC_B_STATUS] < 0) {
        errno = (int)-st[RC_B_STATUS];
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, st[RC_B_STATUS] == -ENOMEM ? "read_runs" : "io_uring_enter");
        return NULL;
    }
    PyObject *r = PyStructSequence_New(BatchResultType);
    if (!r) return NULL;
    for (int k = 0; k < RC_B_N; k++) {
        PyObject *v = PyLong_FromLongLong(st[k]);
        if (!v) {
            Py_DECREF(r);
            return NULL;
        }
        PyStructSequence_SetItem(r, k, v);
    }
    return r;
}

/* read_runs(rows int64[n], bounds int64[P+1], tables int32[P], bases int64[P], out, verify)
 * Rows bounds[k]..bounds[k+1] minus bases[k] are rows of table tables[k]. Returns a
 * BatchResult: its status and fields are csrc/rcio_status.h's. */
static PyObject *Reader_read_runs(Reader *self, PyObject *args) {
    PyObject *o[5];
    int verify;
    if (!PyArg_ParseTuple(args, "OOOOOp", &o[0], &o[1], &o[2], &o[3], &o[4], &verify)) return NULL;
    runargs_t a; /* (a batch started apart and still running holds the lock: this one waits) */
    if (runargs_parse(self, o, verify, &a)) return NULL;
    int64_t st[RC_B_N];
    Py_BEGIN_ALLOW_THREADS
    run_batch(self, &a, st);
    Py_END_ALLOW_THREADS
    runargs_release(&a);
    return batch_result(st);
}

/* The reader's async worker: runs the batch read_runs_start handed it, then writes the
 * caller's flag (ctl[1] = seq when the batch read cleanly, then ctl[0] = seq, each store
 * released after the records it covers), then wakes read_runs_join. */
static void *async_worker(void *arg) {
    Reader *self = arg;
    async_t *j = &self->async;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        while (j->state != 1 && !j->stop) pthread_cond_wait(&j->go, &j->mu);
        if (j->stop) break;
        pthread_mutex_unlock(&j->mu);
        run_batch(self, &j->args, j->st);
        if (j->ctl) {
            __atomic_store_n(&j->ctl[1], j->st[RC_B_STATUS] == RC_READ_OK ? j->seq : j->seq - 1, __ATOMIC_RELEASE);
            __atomic_store_n(&j->ctl[0], j->seq, __ATOMIC_SEQ_CST);
        }
        pthread_mutex_lock(&j->mu);
        j->state = 2;
        pthread_cond_broadcast(&j->done);
    }
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

/* read_runs_start(rows, bounds, tables, bases, out, verify, ctl, seq) -> None
 * read_runs' batch, run on the reader's own thread while the caller goes on; the buffers
 * are held until read_runs_join. ctl (int32[2], e.g. pinned memory a GPU polls) or None:
 * when the batch ends, ctl[1] = seq if it read cleanly (else seq - 1), then ctl[0] = seq. */
static PyObject *Reader_read_runs_start(Reader *self, PyObject *args) {
    PyObject *o[5], *o_ctl;
    int verify, seq;
    if (!PyArg_ParseTuple(args, "OOOOOpOi", &o[0], &o[1], &o[2], &o[3], &o[4], &verify, &o_ctl, &seq))
        return NULL;
    async_t *j = &self->async;
    if (j->state != 0) {
        PyErr_SetString(PyExc_RuntimeError, "read_runs_start: the last batch started is not joined");
        return NULL;
    }
    Py_buffer cv;
    memset(&cv, 0, sizeof cv);
    if (o_ctl != Py_None && getbuf(o_ctl, &cv, 4, 2, 1, "ctl")) return NULL;
    if (runargs_parse(self, o, verify, &j->args)) {
        if (cv.obj) PyBuffer_Release(&cv);
        return NULL;
    }
    if (!j->started) {
        pthread_mutex_init(&j->mu, NULL);
        pthread_cond_init(&j->go, NULL);
        pthread_cond_init(&j->done, NULL);
        if (pthread_create(&j->th, NULL, async_worker, self)) {
            runargs_release(&j->args);
            if (cv.obj) PyBuffer_Release(&cv);
            PyErr_SetString(PyExc_OSError, "read_runs_start: cannot start the reader's thread");
            return NULL;
        }
        j->started = 1;
    }
    j->ctlv = cv;
    j->ctl = cv.obj ? cv.buf : NULL;
    j->seq = seq;
    pthread_mutex_lock(&j->mu);
    j->state = 1;
    pthread_cond_signal(&j->go);
    pthread_mutex_unlock(&j->mu);
    Py_RETURN_NONE;
}

/* Wait for the batch read_runs_start started (the GIL released); release its buffers. */
static void async_wait(async_t *j) {
    pthread_mutex_lock(&j->mu);
    while (j->state == 1) pthread_cond_wait(&j->done, &j->mu);
    pthread_mutex_unlock(&j->mu);
}

/* read_runs_join() -> read_runs' result for the batch read_runs_start started */
static PyObject *Reader_read_runs_join(Reader *self, PyObject *noargs) {
    (void)noargs;
    async_t *j = &self->async;
    if (j->state == 0) {
        PyErr_SetString(PyExc_RuntimeError, "read_runs_join: no batch was started");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    async_wait(j);
    Py_END_ALLOW_THREADS
    j->state = 0;
    runargs_release(&j->args);
    if (j->ctlv.obj) PyBuffer_Release(&j->ctlv);
    j->ctl = NULL;
    return batch_result(j->st);
}

static PyObject *Reader_engine(Reader *self, void *closure) {
    (void)closure;
    if (!self->use_uring || self->broken) return PyUnicode_FromString("threads");
    return PyUnicode_FromString(self->split ? "uring+threads" : "uring");
}

static PyMethodDef Reader_methods[] = {
    {"read_runs_start", (PyCFunction)Reader_read_runs_start, METH_VARARGS,
     "read_runs_start(rows, bounds, tables, bases, out, verify, ctl, seq): read_runs' batch "
     "on the reader's own thread; ctl int32[2] or None: ctl[1] = seq if clean (else seq - 1), "
     "then ctl[0] = seq, when it ends"},
    {"read_runs_join", (PyCFunction)Reader_read_runs_join, METH_NOARGS,
     "read_runs_join() -> read_runs' result of the batch read_runs_start started"},
    {"set_layout", (PyCFunction)Reader_set_layout, METH_VARARGS,
     "set_layout(rows, rows_per_page, pages_per_shard, page_bytes, record_bytes, file_base, "
     "fds, crc, crc_base, merge_gap, max_extent, direct)"},
    {"read_runs", (PyCFunction)Reader_read_runs, METH_VARARGS,
     "read_runs(rows, bounds, tables, bases, out, verify) -> BatchResult"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Reader_getset[] = {
    {"engine", (getter)Reader_engine, NULL, "'uring', 'threads' or 'uring+threads'", NULL}, {NULL}};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "rowcache.io._rcio.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reader(queue_depth=32, engine='auto', spin_us=0, background=False): batches of "
              "reads, GIL released; io_uring completions polled for up to spin_us before "
              "sleeping; a background reader submits no read while a foreground batch reads.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
};

/* crc32c(data, value=0, software=False) -> int; software=True: the table (for tests) */
static PyObject *py_crc32c(PyObject *m, PyObject *args) {
    (void)m;
    Py_buffer v;
    unsigned int value = 0;
    int sw = 0;
    if (!PyArg_ParseTuple(args, "y*|Ip", &v, &value, &sw)) return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = sw ? crc_sw(value, v.buf, (size_t)v.len) : crc32c(value, v.buf, (size_t)v.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *py_page_crcs(PyObject *m, PyObject *args) {
    (void)m;
    PyObject *data, *outo;
    if (!PyArg_ParseTuple(args, "OO", &data, &outo)) return NULL;
    Py_buffer d, o;
    if (getbuf(data, &d, 1, -1, 0, "data") < 0) return NULL;
    Py_ssize_t pages = (d.len + PAGE - 1) / PAGE;
    if (getbuf(outo, &o, 4, pages, 1, "out") < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *p = d.buf;
    for (Py_ssize_t j = 0; j < pages; j++) {
        Py_ssize_t L = d.len - j * PAGE < PAGE ? d.len - j * PAGE : PAGE;
        ((uint32_t *)o.buf)[j] = crc32c(0, p + j * PAGE, (size_t)L);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

/* demand_hold(delta) -> int: add delta to the count of foreground batches reading (for
 * tests of the background yield: a held count pauses every background reader) */
static PyObject *py_demand_hold(PyObject *m, PyObject *args) {
    (void)m;
    int delta;
    if (!PyArg_ParseTuple(args, "i", &delta)) return NULL;
    return PyLong_FromLong(__atomic_add_fetch(&demand_batches, delta, __ATOMIC_ACQ_REL));
}

static PyMethodDef module_methods[] = {
    {"demand_hold", py_demand_hold, METH_VARARGS,
     "demand_hold(delta) -> int: add delta to the foreground batches reading (tests: a held "
     "count pauses background readers)"},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, value=0, software=False) -> int (Castagnoli; software: the table path)"},
    {"page_crcs", py_page_crcs, METH_VARARGS,
     "page_crcs(data, out): out[j] = crc32c of 4096-byte page j of data (the last may be short)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "rowcache.io._rcio",
                                       "Batched positional reads (io_uring or pread threads) "
                                       "and CRC32C, the GIL released.",
                                       -1, module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rcio(void) {
    crc_init();
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    if (!BatchResultType && !(BatchResultType = PyStructSequence_NewType(&batch_desc))) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddObjectRef(m, "BatchResult", (PyObject *)BatchResultType) < 0 ||
        PyModule_AddIntConstant(m, "READ_OK", RC_READ_OK) < 0 ||
        PyModule_AddIntConstant(m, "READ_FAILED", RC_READ_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "READ_BAD_PAGE", RC_READ_BAD_PAGE) < 0 ||
        PyModule_AddIntConstant(m, "READ_NOT_OPEN", RC_READ_NOT_OPEN) < 0 ||
        PyModule_AddIntConstant(m, "READ_BAD_ROW", RC_READ_BAD_ROW) < 0 ||
        PyModule_AddIntConstant(m, "HAVE_SSE42", have_sse42) < 0 ||
        PyModule_AddIntConstant(m, "PAGE", PAGE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
