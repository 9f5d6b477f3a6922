/* rowcache._rcio: one batch of positional reads with the GIL released, plus CRC32C.
 *
 * Owns the I/O engine of rowcache.reader.RowReader: a Reader object keeps one io_uring
 * (raw system calls, no liburing) or a persistent pool of pread threads, and runs a batch
 * of reads (fd, file offset, length, buffer offset, bytes needed) with min(n, queue_depth)
 * in flight, then verifies the CRC32C of every 4 KiB page read and cuts the records into
 * the caller's buffer, all in one GIL-free call. Planning and error messages stay in
 * Python. Only libc and the kernel's io_uring ABI are used.
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
#include <unistd.h>

#define PAGE 4096
#define RETRIES 1000 /* EINTR/EAGAIN retries of one read before it counts as failed */

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
} batch_t;

/* After got > 0 bytes of a read: is the rest worth asking for? (An O_DIRECT read that
 * stops off a 512-byte boundary stopped at end of file; another request would be EINVAL.) */
static int more(const batch_t *b, Py_ssize_t i, int64_t got) {
    return got < b->len[i] && !(b->direct && (got & 511));
}

static void finish(batch_t *b, Py_ssize_t i, int64_t got, int err) {
    if (!err && got < b->need[i]) err = -1;
    b->got[i] = got;
    b->err[i] = err;
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
    int nth, tickets, busy, stop;
    batch_t *b;
    Py_ssize_t next;
} pool_t;

static void pool_share(pool_t *p, batch_t *b) {
    for (;;) {
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

/* Returns 0, or -errno when io_uring_enter itself fails (reads may then still be in flight:
 * the caller must never reuse `buf`). */
static int uring_run(uring_t *u, batch_t *b, int qd) {
    Py_ssize_t next = 0, done = 0, nres = 0;
    int inflight = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) b->got[i] = b->err[i] = 0;
    while (done < b->n) {
        unsigned tail = *u->sq_tail, mask = *u->sq_mask;
        while (inflight < qd && (nres || next < b->n)) {
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
        if (syscall(__NR_io_uring_enter, u->fd, pending, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0 &&
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

/* ---- the Python object ---- */
typedef struct {
    PyObject_HEAD
    int qd, use_uring, broken;
    uring_t ring;
    pool_t pool;
    pthread_mutex_t lock; /* one batch at a time per reader */
} Reader;

static int Reader_init(Reader *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"queue_depth", "engine", NULL};
    int qd = 32;
    const char *engine = "auto";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|is", names, &qd, &engine)) return -1;
    if (qd < 1 || qd > 1024) {
        PyErr_Format(PyExc_ValueError, "queue_depth=%d: give 1..1024", qd);
        return -1;
    }
    int want_uring = !strcmp(engine, "uring"), auto_ = !strcmp(engine, "auto");
    if (!want_uring && !auto_ && strcmp(engine, "threads")) {
        PyErr_Format(PyExc_ValueError, "engine=%s: allowed: auto, uring, threads", engine);
        return -1;
    }
    self->qd = qd;
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

static void Reader_dealloc(Reader *self) {
    if (self->pool.th) {
        pthread_mutex_lock(&self->pool.mu);
        self->pool.stop = 1;
        pthread_cond_broadcast(&self->pool.go);
        pthread_mutex_unlock(&self->pool.mu);
        for (int k = 0; k < self->pool.nth; k++) pthread_join(self->pool.th[k], NULL);
        PyMem_RawFree(self->pool.th);
    }
    if (self->ring.fd >= 0 && !self->broken) uring_close(&self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A C-contiguous buffer of exactly n items of `size` bytes (or None when optional). */
static int getbuf(PyObject *o, Py_buffer *v, Py_ssize_t size, Py_ssize_t n, int writable,
                  const char *name) {
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (n >= 0 && v->len != size * n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", name, v->len, size * n);
        PyBuffer_Release(v);
        v->obj = NULL;
        return -1;
    }
    return 0;
}

static PyObject *Reader_run(Reader *self, PyObject *args) {
    PyObject *o[14];
    int direct, rec;
    if (!PyArg_ParseTuple(args, "OOOOOOOOpOOOOOOi", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &o[7], &direct, &o[8], &o[9], &o[10], &o[11], &o[12], &o[13],
                          &rec))
        return NULL;
    /* fd, off, len, pos, need, got, err, buf | page_pos, page_read, page_crc, page_bad | src, out */
    static const char *nm[] = {"fd", "off", "len", "pos", "need", "got", "err", "buf",
                               "page_pos", "page_read", "page_crc", "page_bad", "src", "out"};
    static const Py_ssize_t sz[] = {4, 8, 8, 8, 8, 8, 4, 1, 8, 4, 4, 1, 8, 1};
    Py_buffer v[14];
    memset(v, 0, sizeof v);
    PyObject *ret = NULL;
    Py_ssize_t n = PyObject_Length(o[0]), np_ = 0, nc = 0;
    if (n < 0) return NULL;
    int checks = o[8] != Py_None, cut = o[12] != Py_None;
    if (checks) np_ = PyObject_Length(o[8]);
    if (cut) nc = PyObject_Length(o[12]);
    if (np_ < 0 || nc < 0 || rec < 0) goto out;
    for (int k = 0; k < 14; k++) {
        if ((k >= 8 && k < 12 && !checks) || (k >= 12 && !cut)) continue;
        Py_ssize_t want = k < 7 ? n : k == 7 || k == 13 ? -1 : k < 12 ? np_ : nc;
        if (getbuf(o[k], &v[k], sz[k], want, k == 5 || k == 6 || k == 7 || k == 11 || k == 13,
                   nm[k]) < 0)
            goto out;
    }
    batch_t b = {n, v[0].buf, v[1].buf, v[2].buf, v[3].buf, v[4].buf, v[5].buf, v[6].buf,
                 v[7].buf, direct};
    for (Py_ssize_t i = 0; i < n; i++) /* every read inside buf: the plan is Python's, trust none */
        if (b.pos[i] < 0 || b.len[i] < 0 || b.pos[i] + b.len[i] > v[7].len) {
            PyErr_Format(PyExc_ValueError, "read %zd lies outside buf", i);
            goto out;
        }
    if (cut && (Py_ssize_t)rec * nc > v[13].len) {
        PyErr_SetString(PyExc_ValueError, "out is too small for src");
        goto out;
    }
    if (cut)
        for (Py_ssize_t i = 0; i < nc; i++)
            if (((int64_t *)v[12].buf)[i] < 0 || ((int64_t *)v[12].buf)[i] + rec > v[7].len) {
                PyErr_Format(PyExc_ValueError, "src[%zd] lies outside buf", i);
                goto out;
            }
    for (Py_ssize_t j = 0; j < np_; j++) {
        int32_t r = ((int32_t *)v[9].buf)[j];
        int64_t p = ((int64_t *)v[8].buf)[j];
        if (r < 0 || r >= n || p < b.pos[r] || p >= b.pos[r] + b.len[r]) {
            PyErr_Format(PyExc_ValueError, "page %zd lies outside its read", j);
            goto out;
        }
    }
    int rc = 0;
    Py_ssize_t failed = 0, bad = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    if (self->use_uring && !self->broken) {
        rc = uring_run(&self->ring, &b, self->qd);
        /* Never reuse a ring that may hold reads in flight; later batches use the threads. */
        if (rc) self->broken = 1;
    } else {
        pool_run(&self->pool, &b, self->qd);
    }
    pthread_mutex_unlock(&self->lock);
    if (!rc) {
        for (Py_ssize_t i = 0; i < n; i++) failed += b.err[i] != 0;
        const int64_t *pp = v[8].buf;
        const int32_t *pr = v[9].buf;
        const uint32_t *pc = v[10].buf;
        uint8_t *pb = v[11].buf;
        for (Py_ssize_t j = 0; j < np_; j++) {
            int32_t r = pr[j];
            int64_t end = b.pos[r] + b.got[r], L = end - pp[j];
            if (L > PAGE) L = PAGE;
            pb[j] = 0;
            if (b.err[r]) continue; /* reported as a failed read */
            pb[j] = L <= 0 || crc32c(0, b.buf + pp[j], (size_t)L) != pc[j];
            bad += pb[j];
        }
        if (!failed && !bad && cut) {
            const int64_t *src = v[12].buf;
            uint8_t *dst = v[13].buf;
            for (Py_ssize_t i = 0; i < nc; i++) memcpy(dst + i * rec, b.buf + src[i], (size_t)rec);
        }
    }
    Py_END_ALLOW_THREADS
    if (rc) {
        errno = -rc;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, "io_uring_enter");
        goto out;
    }
    ret = Py_BuildValue("nn", failed, bad);
out:
    for (int k = 0; k < 14; k++)
        if (v[k].obj) PyBuffer_Release(&v[k]);
    return ret;
}

static PyObject *Reader_engine(Reader *self, void *closure) {
    (void)closure;
    return PyUnicode_FromString(self->use_uring && !self->broken ? "uring" : "threads");
}

static PyMethodDef Reader_methods[] = {
    {"run", (PyCFunction)Reader_run, METH_VARARGS,
     "run(fd, off, len, pos, need, got, err, buf, direct, page_pos, page_read, page_crc, "
     "page_bad, src, out, rec) -> (failed_reads, bad_pages)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Reader_getset[] = {
    {"engine", (getter)Reader_engine, NULL, "'uring' or 'threads'", NULL}, {NULL}};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "rowcache._rcio.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reader(queue_depth=32, engine='auto'): batches of reads, GIL released.",
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

static PyMethodDef module_methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, value=0, software=False) -> int (Castagnoli; software: the table path)"},
    {"page_crcs", py_page_crcs, METH_VARARGS,
     "page_crcs(data, out): out[j] = crc32c of 4096-byte page j of data (the last may be short)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_rcio",
                                       "Batched positional reads (io_uring or pread threads) "
                                       "and CRC32C, the GIL released.",
                                       -1, module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rcio(void) {
    crc_init();
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddIntConstant(m, "HAVE_SSE42", have_sse42) < 0 ||
        PyModule_AddIntConstant(m, "PAGE", PAGE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
