/* kernels._host: the per-step host kernels of a cached embedding step.
 *
 * hash_packed: LongCat n-gram ids of the embedded positions of a packed batch
 *   (docs/ngram-spec.md), with an optional per-table offset added (global ids of a
 *   shared arena). Tokens come checked (embed.batch.NgramBatch checks them once).
 * lru_hits: the all-hits path of NgramRowCache.resolve: map ids to slots, and when
 *   every row is resident, pin and touch the call's unique slots in ascending row
 *   order (the cache's tie rule) in the LRU log.
 * lru_plan, lru_commit: the bookkeeping of a resolve with misses, around its read:
 *   dedup, exhaustion test and victims (changing nothing), then, once the reads
 *   succeeded, the maps, pins, LRU log and per-part miss counts (kernels/_lru_miss.h).
 * lru_compact: the LRU log's compaction.
 *
 * All are bit-exact with their references (embed.batch.hash_positions and
 * NgramRowCache's Python paths), checked by tests/kernels/test_host.py and
 * tests/rowcache/test_miss_native.py. Arrays come in through the buffer protocol
 * (C-contiguous, checked item sizes); the GIL is released for the whole call. No
 * library beyond libc and Python.
 *
 * lru_hits and hash_packed take an optional thread count: a large call (a prefill
 * step's tens of thousands of ids) is split over up to that many threads (the caller's
 * and the workers of kernels/_pool.h, kept between calls). lru_hits gives each a
 * contiguous part of the ids (the parts of a shared arena's step are its tables, whose
 * global ids are disjoint ranges); hash_packed gives each a run of tables. Results are
 * identical whatever the count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_pool.h" /* parallel(): the worker threads kept between calls */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static int get_buf(PyObject *obj, Buf *b, Py_ssize_t itemsize, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    b->held = 0;
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) {
        return -1;
    }
    b->held = 1;
    if (b->view.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected %zd-byte items, got %zd", name, itemsize,
                     b->view.itemsize);
        return -1;
    }
    return 0;
}

static void release(Buf *bufs, int n) {
    for (int i = 0; i < n; i++) {
        if (bufs[i].held) {
            PyBuffer_Release(&bufs[i].view);
            bufs[i].held = 0;
        }
    }
}

#define COUNT(b) ((b).view.len / (b).view.itemsize)
#define PF 16 /* software prefetch distance (iterations) of the random-access loops */
/* Threads for `work` items given `threads` wanted, at least `grain` items each. */
static int split_count(int threads, Py_ssize_t work, Py_ssize_t grain) {
    Py_ssize_t k = work / grain;
    if (k > threads) {
        k = threads;
    }
    if (k > MAXT) {
        k = MAXT;
    }
    return k < 1 ? 1 : (int)k;
}

typedef struct {
    const int64_t *tok, *ctx, *seq, *mult, *rows, *off;
    int64_t *out;
    Py_ssize_t S, N, n, T;
    long long eos;
    Py_ssize_t t0, t1; /* this part's tables */
} HashJob;

#define HASH_GRAIN 4096 /* ids (positions x tables) a hash_packed thread at least */

/* The ids of tables [t0, t1) at every embedded position. */
static void *hash_tables(void *arg) {
    const HashJob *h = arg;
    const int64_t *tok = h->tok, *ctx = h->ctx, *seq = h->seq, *mult = h->mult, *rows = h->rows;
    const int64_t *off = h->off;
    int64_t *out = h->out;
    Py_ssize_t S = h->S, N = h->N, n = h->n;
    long long eos = h->eos;
    Py_ssize_t begin = 0, r = 0;
    int64_t xs[16];
    for (Py_ssize_t s = 0; s < S; s++) {
        for (Py_ssize_t t = begin + ctx[s] - seq[s]; t < begin + ctx[s]; t++, r++) {
            /* j = 0 always counts; j >= 1 until the sequence start or an EOS in t-j..t-1 */
            xs[0] = tok[t];
            int live = 1;
            for (Py_ssize_t j = 1; j < N; j++) {
                if (live && (t - j < begin || tok[t - j] == eos)) {
                    live = 0; /* an EOS at t-j (or the start) stops terms >= j */
                }
                xs[j] = live ? tok[t - j] : 0;
            }
            for (Py_ssize_t i = h->t0; i < h->t1; i++) {
                int64_t acc = 0;
                const int64_t *m = mult + i * N;
                for (Py_ssize_t j = 0; j < N; j++) {
                    acc += m[j] * xs[j];
                }
                acc %= rows[i];
                out[i * n + r] = off ? acc + off[i] : acc;
            }
        }
        begin += ctx[s];
    }
    return NULL;
}

/* hash_packed(tokens i64[L], ctx_lens i64[S], seq_lens i64[S], mult i64[T, N],
 *             rows i64[T], N, offsets i64[T] | None, eos, out i64[T, n][, threads]) -> None
 * threads (default 1): the tables are split into up to that many runs (each at least
 * HASH_GRAIN ids), hashed in parallel. */
static PyObject *hash_packed(PyObject *self, PyObject *args) {
    PyObject *o_tok, *o_ctx, *o_seq, *o_mult, *o_rows, *o_off, *o_out;
    long long eos;
    Py_ssize_t N;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOnOLO|i", &o_tok, &o_ctx, &o_seq, &o_mult, &o_rows, &N,
                          &o_off, &eos, &o_out, &threads)) {
        return NULL;
    }
    Buf b[7];
    memset(b, 0, sizeof b);
    int has_off = o_off != Py_None;
    if (get_buf(o_tok, &b[0], 8, 0, "tokens") || get_buf(o_ctx, &b[1], 8, 0, "ctx_lens") ||
        get_buf(o_seq, &b[2], 8, 0, "seq_lens") || get_buf(o_mult, &b[3], 8, 0, "mult") ||
        get_buf(o_rows, &b[4], 8, 0, "rows") ||
        (has_off && get_buf(o_off, &b[5], 8, 0, "offsets")) ||
        get_buf(o_out, &b[6], 8, 1, "out")) {
        release(b, 7);
        return NULL;
    }
    const int64_t *tok = b[0].view.buf, *ctx = b[1].view.buf, *seq = b[2].view.buf;
    const int64_t *mult = b[3].view.buf, *rows = b[4].view.buf;
    const int64_t *off = has_off ? b[5].view.buf : NULL;
    int64_t *out = b[6].view.buf;
    Py_ssize_t L = COUNT(b[0]), S = COUNT(b[1]), T = COUNT(b[4]);
    if (COUNT(b[2]) != S || N < 1 || N > 16 || COUNT(b[3]) != T * N ||
        (has_off && COUNT(b[5]) != T)) {
        release(b, 7);
        PyErr_SetString(PyExc_ValueError, "hash_packed: inconsistent shapes");
        return NULL;
    }
    Py_ssize_t n = 0, total = 0;
    for (Py_ssize_t s = 0; s < S; s++) {
        if (ctx[s] < 0 || seq[s] < 0 || seq[s] > ctx[s]) {
            release(b, 7);
            PyErr_SetString(PyExc_ValueError, "hash_packed: bad ctx_lens/seq_lens");
            return NULL;
        }
        n += seq[s];
        total += ctx[s];
    }
    if (total != L || COUNT(b[6]) != T * n) {
        release(b, 7);
        PyErr_SetString(PyExc_ValueError, "hash_packed: lengths do not match tokens/out");
        return NULL;
    }
    HashJob job[MAXT];
    int K = split_count(threads < T ? threads : (int)T, n * T, HASH_GRAIN);
    for (int k = 0; k < K; k++) {
        job[k] = (HashJob){tok, ctx, seq, mult, rows, off, out, S, N, n, T, eos,
                           T * k / K, T * (k + 1) / K};
    }
    Py_BEGIN_ALLOW_THREADS
    parallel(K, hash_tables, (char *)job, sizeof job[0]);
    Py_END_ALLOW_THREADS
    release(b, 7);
    Py_RETURN_NONE;
}

/* LSD radix sort of n non-negative int32 keys (< 2**31) in a, using tmp[n]. */
static void radix_sort(int32_t *a, int32_t *tmp, Py_ssize_t n) {
    if (n <= 32) {
        for (Py_ssize_t i = 1; i < n; i++) {
            int32_t v = a[i];
            Py_ssize_t j = i - 1;
            while (j >= 0 && a[j] > v) {
                a[j + 1] = a[j];
                j--;
            }
            a[j + 1] = v;
        }
        return;
    }
    int32_t max = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (a[i] > max) {
            max = a[i];
        }
    }
    size_t count[2048];
    int32_t *src = a, *dst = tmp;
    for (int shift = 0; shift < 31 && (max >> shift) > 0; shift += 11) {
        memset(count, 0, sizeof count);
        for (Py_ssize_t i = 0; i < n; i++) {
            count[(src[i] >> shift) & 2047]++;
        }
        size_t sum = 0;
        for (int k = 0; k < 2048; k++) {
            size_t c = count[k];
            count[k] = sum;
            sum += c;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            dst[count[(src[i] >> shift) & 2047]++] = src[i];
        }
        int32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) {
        memcpy(a, src, (size_t)n * sizeof *a);
    }
}

/* keys[0:n] = ids[0:n] (in range: < 2**31) as int32, sorted, with tmp[n] as the buffer. */
static void sort_ids(const int64_t *ids, int32_t *keys, int32_t *tmp, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        keys[i] = (int32_t)ids[i];
    }
    radix_sort(keys, tmp, n);
}

#define HITS_GRAIN 4096 /* ids an lru_hits thread at least */

typedef struct {
    const int64_t *ids;
    const int32_t *row_slot;
    int64_t *last_used;
    int32_t *log, *log_pos, *out, *scr;
    Py_ssize_t n, S;
    long long rows, batch;
    Py_ssize_t lo, hi;      /* this part's ids */
    int status;             /* 0, 1 (a miss) or 2 (ids[bad] out of range) */
    Py_ssize_t bad, n_u;    /* first bad id; distinct ids of the part */
    Py_ssize_t base, fresh; /* its first log position; slots newly pinned */
    int keys_only;          /* the scan of lru_scan: keys copied for a later sort */
} HitsPart;

/* Phase 1 of a part: range check, slots of its ids, and its ids sorted (scr[lo:hi],
 * scr[n + lo: n + hi] as the sort's buffer) with their distinct count. */
static void *hits_scan(void *arg) {
    HitsPart *h = arg;
    const int64_t *ids = h->ids;
    const int32_t *row_slot = h->row_slot;
    Py_ssize_t lo = h->lo, hi = h->hi;
    h->status = 0;
    h->n_u = 0;
    for (Py_ssize_t i = lo; i < hi; i++) {
        if ((uint64_t)ids[i] >= (uint64_t)h->rows) {
            h->status = 2;
            h->bad = i;
            return NULL;
        }
    }
    /* random reads of a table-sized map: prefetch a few iterations ahead */
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (i + PF < hi) {
            __builtin_prefetch(&row_slot[ids[i + PF]]);
        }
        int32_t s = row_slot[ids[i]];
        h->out[i] = s;
        if (s < 0) {
            h->status = 1;
        }
    }
    if (h->status) {
        return NULL;
    }
    int32_t *scr = h->scr + lo;
    if (h->keys_only) { /* the deferred touch sorts them (kernels/_touch.h) */
        for (Py_ssize_t i = lo; i < hi; i++) {
            h->scr[i] = (int32_t)ids[i];
        }
        return NULL;
    }
    sort_ids(ids + lo, scr, h->scr + h->n + lo, hi - lo);
    Py_ssize_t n_u = hi > lo;
    for (Py_ssize_t i = 1; i < hi - lo; i++) {
        n_u += scr[i] != scr[i - 1];
    }
    h->n_u = n_u;
    return NULL;
}

/* Phase 2 of a part: pin its distinct slots and log them from log[base], ascending. */
static void *hits_touch(void *arg) {
    HitsPart *h = arg;
    const int32_t *row_slot = h->row_slot, *scr = h->scr + h->lo;
    int64_t *last_used = h->last_used;
    int32_t *log = h->log, *log_pos = h->log_pos;
    Py_ssize_t m = h->hi - h->lo, c = h->base, fresh = 0, S = h->S;
    long long batch = h->batch;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + PF < m) {
            __builtin_prefetch(&row_slot[scr[i + PF]]);
        }
        if (i + PF / 2 < m) {
            int32_t q = row_slot[scr[i + PF / 2]];
            if (q >= 0 && q < S) {
                __builtin_prefetch(&last_used[q], 1);
                __builtin_prefetch(&log_pos[q], 1);
            }
        }
        if (i > 0 && scr[i] == scr[i - 1]) {
            continue;
        }
        int32_t s = row_slot[scr[i]];
        if (s < 0 || s >= S) {
            continue; /* cannot happen: checked by the scan */
        }
        if (last_used[s] != batch) {
            fresh++;
            last_used[s] = batch;
        }
        log[c] = s;
        log_pos[s] = (int32_t)c;
        c++;
    }
    h->fresh = fresh;
    return NULL;
}

/* The status of a scan split into K parts: 2 with *bad the first bad id (as a serial scan
 * finds it), else 1 when a part has a miss, else 0. */
static int scan_status(const HitsPart *part, int K, Py_ssize_t *bad) {
    int status = 0;
    for (int k = 0; k < K; k++) {
        if (part[k].status == 2) {
            *bad = part[k].bad;
            return 2;
        }
        status |= part[k].status == 1;
    }
    return status;
}

/* lru_hits(ids i64[n], rows, row_slot i32[R], last_used i64[S], log i32[C], log_pos i32[S],
 *          tail, batch, out i32[n], scratch i32[2n][, threads]) -> (status, a, b)
 * status 0: every row resident; out = slots; the unique slots were pinned (last_used =
 *   batch) and logged at tail in ascending row order; a = fresh (slots not used in this
 *   batch before), b = new tail.
 * status 1: a row is not resident; out = slots (-1 where missing); nothing changed.
 * status 2: ids[a] is outside [0, rows); nothing changed.
 * status 3: the log has no room at tail for the call's distinct slots; nothing changed
 *   (compact first).
 * threads (default 1): the ids are split into up to that many contiguous parts (each at
 * least HITS_GRAIN ids), scanned and sorted in parallel; when the parts' sorted ids are
 * disjoint ascending ranges (a shared arena's step: one part per table, or within one),
 * they are logged in parallel too, else the whole call is sorted and logged by one. */
static PyObject *lru_hits(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_rs, *o_lu, *o_log, *o_lp, *o_out, *o_scr;
    long long rows, batch;
    Py_ssize_t tail;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLOOOOnLOO|i", &o_ids, &rows, &o_rs, &o_lu, &o_log, &o_lp,
                          &tail, &batch, &o_out, &o_scr, &threads)) {
        return NULL;
    }
    Buf b[7];
    memset(b, 0, sizeof b);
    if (get_buf(o_ids, &b[0], 8, 0, "ids") || get_buf(o_rs, &b[1], 4, 0, "row_slot") ||
        get_buf(o_lu, &b[2], 8, 1, "last_used") || get_buf(o_log, &b[3], 4, 1, "log") ||
        get_buf(o_lp, &b[4], 4, 1, "log_pos") || get_buf(o_out, &b[5], 4, 1, "out") ||
        get_buf(o_scr, &b[6], 4, 1, "scratch")) {
        release(b, 7);
        return NULL;
    }
    Py_ssize_t n = COUNT(b[0]), R = COUNT(b[1]), S = COUNT(b[2]), cap = COUNT(b[3]);
    if (COUNT(b[4]) != S || COUNT(b[5]) < n || COUNT(b[6]) < 2 * n || rows > R || tail < 0 ||
        tail > cap) {
        release(b, 7);
        PyErr_SetString(PyExc_ValueError, "lru_hits: inconsistent shapes");
        return NULL;
    }
    HitsPart part[MAXT];
    int K = split_count(threads, n, HITS_GRAIN);
    for (int k = 0; k < K; k++) {
        part[k] = (HitsPart){b[0].view.buf, b[1].view.buf, b[2].view.buf, b[3].view.buf,
                             b[4].view.buf, b[5].view.buf, b[6].view.buf, n, S, rows, batch,
                             n * k / K, n * (k + 1) / K, 0, 0, 0, 0, 0, 0};
    }
    int status = 0;
    Py_ssize_t a = 0, c = tail;
    Py_BEGIN_ALLOW_THREADS
    parallel(K, hits_scan, (char *)part, sizeof part[0]);
    status = scan_status(part, K, &a);
    if (status == 0 && K > 1) {
        int32_t *scr = b[6].view.buf;
        int disjoint = 1;
        for (int k = 1; k < K; k++) {
            disjoint &= scr[part[k].lo - 1] < scr[part[k].lo]; /* last of k-1 < first of k */
        }
        if (!disjoint) { /* one part over the whole call */
            part[0].lo = 0;
            part[0].hi = n;
            K = 1;
            hits_scan(&part[0]);
        }
    }
    if (status == 0) {
        Py_ssize_t n_u = 0;
        for (int k = 0; k < K; k++) {
            part[k].base = tail + n_u;
            n_u += part[k].n_u;
        }
        if (tail + n_u > cap) { /* the Python path's test: room for the distinct slots */
            status = 3;
        } else {
            parallel(K, hits_touch, (char *)part, sizeof part[0]);
            for (int k = 0; k < K; k++) {
                a += part[k].fresh;
            }
            c = tail + n_u;
        }
    }
    Py_END_ALLOW_THREADS
    release(b, 7);
    return Py_BuildValue("(inn)", status, a, c);
}

/* Moves the live entries of log[head:tail] (log_pos[slot] == position) to the front, in
 * order, and points log_pos at their new positions; returns the new tail. */
static Py_ssize_t compact_serial(int32_t *log, int32_t *log_pos, Py_ssize_t S, Py_ssize_t head,
                                 Py_ssize_t tail) {
    Py_ssize_t k = 0;
    for (Py_ssize_t p = head; p < tail; p++) {
        if (p + PF < tail && log[p + PF] >= 0 && log[p + PF] < S) {
            __builtin_prefetch(&log_pos[log[p + PF]], 1);
        }
        int32_t s = log[p];
        if (s >= 0 && s < S && log_pos[s] == (int32_t)p) {
            log[k] = s;
            log_pos[s] = (int32_t)k;
            k++;
        }
    }
    return k;
}

#define COMPACT_GRAIN (1 << 18) /* log entries a compaction thread at least */

typedef struct {
    int32_t *log, *log_pos, *tmp; /* tmp: this part's live slots, in order */
    Py_ssize_t S, lo, hi;         /* this part's log positions */
    Py_ssize_t live, base;        /* its live entries; their first new position */
} CompactPart;

/* Phase 1 (reads only): the part's live slots, in log order, into its tmp. */
static void *compact_gather(void *arg) {
    CompactPart *c = arg;
    const int32_t *log = c->log, *log_pos = c->log_pos;
    Py_ssize_t S = c->S, hi = c->hi, n = 0;
    for (Py_ssize_t p = c->lo; p < hi; p++) {
        if (p + PF < hi && log[p + PF] >= 0 && log[p + PF] < S) {
            __builtin_prefetch(&log_pos[log[p + PF]]);
        }
        int32_t s = log[p];
        if (s >= 0 && s < S && log_pos[s] == (int32_t)p) {
            c->tmp[n++] = s;
        }
    }
    c->live = n;
    return NULL;
}

/* Phase 2: the part's live slots written from log[base], log_pos pointed at them (the
 * parts' ranges are disjoint and each slot has one live entry: no two parts write the
 * same word, and no part reads the log). */
static void *compact_scatter(void *arg) {
    CompactPart *c = arg;
    int32_t *log = c->log, *log_pos = c->log_pos;
    const int32_t *tmp = c->tmp;
    Py_ssize_t base = c->base, n = c->live;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PF < n) {
            __builtin_prefetch(&log_pos[tmp[i + PF]], 1);
        }
        log[base + i] = tmp[i];
        log_pos[tmp[i]] = (int32_t)(base + i);
    }
    return NULL;
}

/* compact_serial's result, on up to `threads` threads of pool `pool` (waited for when
 * busy with `wait`): the log is split into parts, each part's live slots gathered into
 * a temporary buffer (tail - head int32: freed before returning), then written to their
 * places. Serial where the log is short, one thread is asked for, or the buffer cannot be
 * had. A full arena's log of 2 S entries took 16 ms serially on the H200 host for S =
 * 3.1M (bench/host_threads.py), once every ~128 prefill steps: a stall of the toucher
 * that the steps behind it waited out. */
static Py_ssize_t compact_log(int32_t *log, int32_t *log_pos, Py_ssize_t S, Py_ssize_t head,
                              Py_ssize_t tail, int threads, Pool *pool, int wait) {
    int K = split_count(threads, tail - head, COMPACT_GRAIN);
    int32_t *tmp = K > 1 ? malloc((size_t)(tail - head) * sizeof *tmp) : NULL;
    if (tmp == NULL) {
        return compact_serial(log, log_pos, S, head, tail);
    }
    CompactPart part[MAXT];
    for (int k = 0; k < K; k++) {
        Py_ssize_t lo = head + (tail - head) * k / K, hi = head + (tail - head) * (k + 1) / K;
        part[k] = (CompactPart){log, log_pos, tmp + (lo - head), S, lo, hi, 0, 0};
    }
    parallel_on(pool, K, compact_gather, (char *)part, sizeof part[0], wait);
    Py_ssize_t base = 0;
    for (int k = 0; k < K; k++) {
        part[k].base = base;
        base += part[k].live;
    }
    parallel_on(pool, K, compact_scatter, (char *)part, sizeof part[0], wait);
    free(tmp);
    return base;
}

/* lru_compact(log i32[C], log_pos i32[S], head, tail[, threads]) -> new tail
 * Moves the live entries of log[head:tail] (log_pos[slot] == position) to the front, in
 * order, and points log_pos at their new positions: NgramRowCache._compact's loop, on up
 * to `threads` threads (default 1) of the step's pool. */
static PyObject *lru_compact(PyObject *self, PyObject *args) {
    PyObject *o_log, *o_lp;
    Py_ssize_t head, tail;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnn|i", &o_log, &o_lp, &head, &tail, &threads)) {
        return NULL;
    }
    Buf b[2];
    memset(b, 0, sizeof b);
    if (get_buf(o_log, &b[0], 4, 1, "log") || get_buf(o_lp, &b[1], 4, 1, "log_pos")) {
        release(b, 2);
        return NULL;
    }
    int32_t *log = b[0].view.buf, *log_pos = b[1].view.buf;
    Py_ssize_t cap = COUNT(b[0]), S = COUNT(b[1]);
    if (head < 0 || head > tail || tail > cap) {
        release(b, 2);
        PyErr_SetString(PyExc_ValueError, "lru_compact: bad head/tail");
        return NULL;
    }
    Py_ssize_t k = 0;
    Py_BEGIN_ALLOW_THREADS
    k = compact_log(log, log_pos, S, head, tail, threads, &pools[POOL_STEP], 0);
    Py_END_ALLOW_THREADS
    release(b, 2);
    return PyLong_FromSsize_t(k);
}

#include "_lru_miss.h" /* lru_plan, lru_commit: the miss path */
#include "_touch.h"    /* lru_scan, lru_touch_start, lru_touch_wait: the deferred touch */

static PyMethodDef methods[] = {
    {"lru_compact", lru_compact, METH_VARARGS, "Compact NgramRowCache's LRU log in place."},
    {"hash_packed", hash_packed, METH_VARARGS, "LongCat ids of a packed batch's embedded positions."},
    {"lru_hits", lru_hits, METH_VARARGS, "The all-hits path of NgramRowCache.resolve."},
    {"lru_plan", lru_plan, METH_VARARGS, "Victims of a resolve with misses (changes nothing)."},
    {"lru_commit", lru_commit, METH_VARARGS, "Commit a planned resolve once its reads succeeded."},
    {"lru_scan", lru_scan, METH_VARARGS, "lru_hits' scan alone: slots, misses, keys."},
    {"lru_touch_start", lru_touch_start, METH_VARARGS, "lru_hits' touch on a background thread."},
    {"lru_touch_wait", lru_touch_wait, METH_VARARGS, "Wait for a touch started by lru_touch_start."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kernels._host", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__host(void) { return PyModule_Create(&module); }
