/* csrc/lru_hits.c: LruState.hits and LruState.compact of rowcache.kernels._host
 * (csrc/lru_state.h), and the pieces of the row cache's LRU that the miss path and the
 * deferred touch reuse.
 *
 * hits: the all-hits path of NgramRowCache.resolve (rowcache.cache.lru.Lru.hits; its
 *   Python reference is the faulter's Python path): map ids to slots, and when every
 *   row is resident, pin and touch the call's unique slots in ascending row order (the
 *   cache's tie rule) in the LRU log. A large call is split into contiguous parts of the
 *   ids on the step's pool (csrc/pool.c): the parts of a shared arena's step are its
 *   tables, whose global ids are disjoint ranges.
 * compact: the LRU log's compaction (rc_compact_log, also the miss path's and the
 *   toucher's; its reference: Lru.compact without the native module).
 * The sort of a call's ids (rc_radix_sort, rc_sort_ids) and a part's scan and touch
 * (rc_hits_scan, rc_hits_touch) are the miss path's and the toucher's too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lru_hits.h"
#include "lru_state.h"
#include "pool.h"
#include "pybuf.h"

/* LSD radix sort of n non-negative int32 keys (< 2**31) in a, using tmp[n]. */
void rc_radix_sort(int32_t *a, int32_t *tmp, Py_ssize_t n) {
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
void rc_sort_ids(const int64_t *ids, int32_t *keys, int32_t *tmp, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        keys[i] = (int32_t)ids[i];
    }
    rc_radix_sort(keys, tmp, n);
}

/* Phase 1 of a part: range check, slots of its ids, and its ids sorted (scr[lo:hi],
 * scr[n + lo: n + hi] as the sort's buffer) with their distinct count. */
void *rc_hits_scan(void *arg) {
    HitsPart *h = arg;
    const int64_t *ids = h->ids;
    const RowMap *map = h->map;
    Py_ssize_t lo = h->lo, hi = h->hi;
    h->status = RC_LRU_OK;
    h->n_u = 0;
    for (Py_ssize_t i = lo; i < hi; i++) {
        if ((uint64_t)ids[i] >= (uint64_t)h->rows) {
            h->status = RC_LRU_BAD_ID;
            h->bad = i;
            return NULL;
        }
    }
    /* random reads of a table-sized map: prefetch a few iterations ahead */
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (i + PF < hi) {
            rm_prefetch(map, (int32_t)ids[i + PF]);
        }
        int32_t s = rm_get(map, (int32_t)ids[i]);
        h->out[i] = s;
        if (s < 0) {
            h->status = RC_LRU_MISS;
        }
    }
    if (h->status) {
        return NULL;
    }
    int32_t *scr = h->scr + lo;
    if (h->keys_only) { /* the deferred touch sorts them (csrc/lru_touch.c) */
        for (Py_ssize_t i = lo; i < hi; i++) {
            h->scr[i] = (int32_t)ids[i];
        }
        return NULL;
    }
    rc_sort_ids(ids + lo, scr, h->scr + h->n + lo, hi - lo);
    Py_ssize_t n_u = hi > lo;
    for (Py_ssize_t i = 1; i < hi - lo; i++) {
        n_u += scr[i] != scr[i - 1];
    }
    h->n_u = n_u;
    return NULL;
}

/* Phase 2 of a part: pin its distinct slots and log them from log[base], ascending. The
 * slots of its sorted ids are looked up once, into the sort's buffer (free after the sort:
 * scr[n + lo: n + hi]), then pinned and logged. */
void *rc_hits_touch(void *arg) {
    HitsPart *h = arg;
    const RowMap *map = h->map;
    const int32_t *scr = h->scr + h->lo;
    int32_t *sl = h->scr + h->n + h->lo;
    int64_t *last_used = h->last_used;
    int32_t *log = h->log, *log_pos = h->log_pos;
    Py_ssize_t m = h->hi - h->lo, c = h->base, fresh = 0, S = h->S;
    long long batch = h->batch;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + PF < m) {
            rm_prefetch(map, scr[i + PF]);
        }
        sl[i] = (i > 0 && scr[i] == scr[i - 1]) ? -1 : rm_get(map, scr[i]);
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + PF < m) {
            int32_t q = sl[i + PF];
            if (q >= 0 && q < S) {
                __builtin_prefetch(&last_used[q], 1);
                __builtin_prefetch(&log_pos[q], 1);
            }
        }
        int32_t s = sl[i];
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

/* The status of a scan split into K parts: RC_LRU_BAD_ID with *bad the first bad id (as a
 * serial scan finds it), else RC_LRU_MISS when a part has a miss, else RC_LRU_OK. */
int rc_scan_status(const HitsPart *part, int K, Py_ssize_t *bad) {
    int status = RC_LRU_OK;
    for (int k = 0; k < K; k++) {
        if (part[k].status == RC_LRU_BAD_ID) {
            *bad = part[k].bad;
            return RC_LRU_BAD_ID;
        }
        if (part[k].status == RC_LRU_MISS) {
            status = RC_LRU_MISS;
        }
    }
    return status;
}

/* LruState.hits(ids i64[n], tail, batch, out i32[n], scratch i32[2n][, threads])
 *     -> (status, a, b)
 * On the state's row map, last_used, log and log_pos:
 * status (csrc/lru_status.h) RC_LRU_OK: every row resident; out = slots; the unique slots were pinned (last_used =
 *   batch) and logged at tail in ascending row order; a = fresh (slots not used in this
 *   batch before), b = new tail.
 * RC_LRU_MISS: a row is not resident; out = slots (-1 where missing); nothing changed.
 * RC_LRU_BAD_ID: ids[a] is outside [0, R); nothing changed.
 * RC_LRU_LOG_FULL: the log has no room at tail for the call's distinct slots; nothing changed
 *   (compact first).
 * threads (default 1): the ids are split into up to that many contiguous parts (each at
 * least HITS_GRAIN ids), scanned and sorted in parallel; when the parts' sorted ids are
 * disjoint ascending ranges (a shared arena's step: one part per table, or within one),
 * they are logged in parallel too, else the whole call is sorted and logged by one. */
PyObject *rc_state_hits(LruState *st, PyObject *args) {
    PyObject *o_ids, *o_out, *o_scr;
    long long batch;
    Py_ssize_t tail;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OnLOO|i", &o_ids, &tail, &batch, &o_out, &o_scr, &threads)) {
        return NULL;
    }
    Buf b[3];
    memset(b, 0, sizeof b);
    if (rc_buf_get(o_ids, &b[0], 8, 0, "ids") || rc_buf_get(o_out, &b[1], 4, 1, "out") ||
        rc_buf_get(o_scr, &b[2], 4, 1, "scratch")) {
        rc_buf_release(b, 3);
        return NULL;
    }
    Py_ssize_t n = COUNT(b[0]), S = st->S, cap = st->cap;
    long long rows = st->R;
    if (COUNT(b[1]) < n || COUNT(b[2]) < 2 * n || tail < 0 || tail > cap) {
        rc_buf_release(b, 3);
        PyErr_SetString(PyExc_ValueError, "LruState.hits: inconsistent shapes");
        return NULL;
    }
    HitsPart part[MAXT];
    int K = rc_split_count(threads, n, HITS_GRAIN);
    for (int k = 0; k < K; k++) {
        part[k] = (HitsPart){b[0].view.buf, st->map, st->last_used, st->log,
                             st->log_pos, b[1].view.buf, b[2].view.buf, n, S, rows, batch,
                             n * k / K, n * (k + 1) / K, 0, 0, 0, 0, 0, 0};
    }
    int status = RC_LRU_OK;
    Py_ssize_t a = 0, c = tail;
    Py_BEGIN_ALLOW_THREADS
    rc_pool_parallel(K, rc_hits_scan, (char *)part, sizeof part[0]);
    status = rc_scan_status(part, K, &a);
    if (status == RC_LRU_OK && K > 1) {
        int32_t *scr = b[2].view.buf;
        int disjoint = 1;
        for (int k = 1; k < K; k++) {
            disjoint &= scr[part[k].lo - 1] < scr[part[k].lo]; /* last of k-1 < first of k */
        }
        if (!disjoint) { /* one part over the whole call */
            part[0].lo = 0;
            part[0].hi = n;
            K = 1;
            rc_hits_scan(&part[0]);
        }
    }
    if (status == RC_LRU_OK) {
        Py_ssize_t n_u = 0;
        for (int k = 0; k < K; k++) {
            part[k].base = tail + n_u;
            n_u += part[k].n_u;
        }
        if (tail + n_u > cap) { /* the Python path's test: room for the distinct slots */
            status = RC_LRU_LOG_FULL;
        } else {
            rc_pool_parallel(K, rc_hits_touch, (char *)part, sizeof part[0]);
            for (int k = 0; k < K; k++) {
                a += part[k].fresh;
            }
            c = tail + n_u;
        }
    }
    Py_END_ALLOW_THREADS
    rc_buf_release(b, 3);
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
 * 3.1M (docs/benchmarks.md, "Figures the code cites"), once every ~128 prefill steps: a
 * stall of the toucher that the steps behind it waited out. */
Py_ssize_t rc_compact_log(int32_t *log, int32_t *log_pos, Py_ssize_t S, Py_ssize_t head,
                              Py_ssize_t tail, int threads, Pool *pool, int wait) {
    int K = rc_split_count(threads, tail - head, COMPACT_GRAIN);
    int32_t *tmp = K > 1 ? malloc((size_t)(tail - head) * sizeof *tmp) : NULL;
    if (tmp == NULL) {
        return compact_serial(log, log_pos, S, head, tail);
    }
    CompactPart part[MAXT];
    for (int k = 0; k < K; k++) {
        Py_ssize_t lo = head + (tail - head) * k / K, hi = head + (tail - head) * (k + 1) / K;
        part[k] = (CompactPart){log, log_pos, tmp + (lo - head), S, lo, hi, 0, 0};
    }
    rc_pool_parallel_on(pool, K, compact_gather, (char *)part, sizeof part[0], wait);
    Py_ssize_t base = 0;
    for (int k = 0; k < K; k++) {
        part[k].base = base;
        base += part[k].live;
    }
    rc_pool_parallel_on(pool, K, compact_scatter, (char *)part, sizeof part[0], wait);
    free(tmp);
    return base;
}

/* LruState.compact(head, tail[, threads]) -> new tail
 * Moves the live entries of log[head:tail] (log_pos[slot] == position) to the front, in
 * order, and points log_pos at their new positions: Lru.compact's loop, on up to
 * `threads` threads (default 1) of the step's pool. */
PyObject *rc_state_compact(LruState *st, PyObject *args) {
    Py_ssize_t head, tail;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "nn|i", &head, &tail, &threads)) {
        return NULL;
    }
    if (head < 0 || head > tail || tail > st->cap) {
        PyErr_SetString(PyExc_ValueError, "LruState.compact: bad head/tail");
        return NULL;
    }
    Py_ssize_t k = 0;
    Py_BEGIN_ALLOW_THREADS
    k = rc_compact_log(st->log, st->log_pos, st->S, head, tail, threads,
                       rc_pool_get(POOL_STEP), 0);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(k);
}
