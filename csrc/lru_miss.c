/* csrc/lru_miss.c: the miss path of NgramRowCache.resolve in rowcache.kernels._host.
 *
 * LruState.plan (csrc/lru_state.h): dedup, exhaustion test and victims of a resolve with
 * misses, changing nothing (its result: rowcache.cache.plan.MissPlan);
 * LruState.commit: once the reads succeeded, the maps, slot states, pins, LRU log and
 * per-part miss counts.
 * Their reference is NgramRowCache's Python path (rowcache/cache/faulter.py,
 * rowcache/cache/lru.py); tests/cache/test_miss_native.py compares the two;
 * tests/kernels/test_host.py compares a call in parts with the same call on one thread.
 * Uses csrc/lru_hits.c's sort and compaction; a large call's parts run on the step's pool
 * (csrc/pool.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "lru_hits.h"
#include "lru_miss.h"
#include "lru_slots.h"
#include "lru_state.h"
#include "pool.h"
#include "pybuf.h"

/* True when the ascending a[0:n] holds v. */
static int sorted_has(const int32_t *a, Py_ssize_t n, int32_t v) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (a[mid] < v) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo < n && a[lo] == v;
}

#define PLAN_GRAIN 2048 /* ids an lru_plan / lru_commit thread at least */

typedef struct {
    const int64_t *ids;
    const RowMap *map;
    const int64_t *last_used;
    const uint8_t *busy;
    int32_t *scr, *uniq, *slots, *missing; /* uniq, slots, missing: written from lo */
    Py_ssize_t n, S, lo, hi;
    long long rows, batch;
    int status;                      /* RC_LRU_OK, _BAD_ID (ids[bad]) or _IN_FLIGHT */
    Py_ssize_t bad, n_u, n_miss, fresh;
} PlanPart;

/* state[slot] (the slot table's, csrc/lru_slots.h): a slot reserved by a prefetch piece in
 * flight, whose row is still being read (RC_SLOT_READING) or was read into the slot by a
 * resolve already (RC_SLOT_READ: a hit; the piece writes the same bytes again), is no
 * victim; a scan passing either, but a pinned or this call's READ slot, says so. */

/* One part of lru_plan's scan: range check, its ids sorted (scr[lo:hi], scr[n + lo:] as
 * the sort's buffer) and deduplicated into uniq[lo:], their slots into slots[lo:] (-1:
 * missing), the missing rows into missing[lo:], hit slots not yet used in this batch
 * counted, a hit in a BUSY_READING slot flagged (RC_LRU_IN_FLIGHT). */
static void *plan_scan(void *arg) {
    PlanPart *h = arg;
    const int64_t *ids = h->ids, *last_used = h->last_used;
    const RowMap *map = h->map;
    const uint8_t *busy = h->busy;
    Py_ssize_t lo = h->lo, hi = h->hi, S = h->S;
    h->status = RC_LRU_OK;
    h->n_u = h->n_miss = h->fresh = 0;
    for (Py_ssize_t i = lo; i < hi; i++) {
        if ((uint64_t)ids[i] >= (uint64_t)h->rows) {
            h->status = RC_LRU_BAD_ID;
            h->bad = i;
            return NULL;
        }
    }
    int32_t *scr = h->scr + lo, *uniq = h->uniq + lo, *slots = h->slots + lo;
    int32_t *missing = h->missing + lo;
    rc_sort_ids(ids + lo, scr, h->scr + h->n + lo, hi - lo);
    Py_ssize_t n_u = 0, n_miss = 0, fresh = 0;
    for (Py_ssize_t i = 0; i < hi - lo; i++) {
        if (i == 0 || scr[i] != scr[i - 1]) {
            uniq[n_u++] = scr[i];
        }
    }
    for (Py_ssize_t j = 0; j < n_u; j++) { /* two passes: the rows' slots, then their uses */
        if (j + PF < n_u) {
            rm_prefetch(map, uniq[j + PF]);
        }
        slots[j] = rm_get(map, uniq[j]);
    }
    for (Py_ssize_t j = 0; j < n_u; j++) {
        if (j + PF < n_u) {
            int32_t q = slots[j + PF];
            if (q >= 0 && q < S) {
                __builtin_prefetch(&last_used[q]);
                if (busy) {
                    __builtin_prefetch(&busy[q]);
                }
            }
        }
        int32_t s = slots[j];
        if (s < 0 || s >= S) {
            slots[j] = -1;
            missing[n_miss++] = uniq[j];
        } else {
            fresh += last_used[s] != h->batch;
            if (busy && busy[s] == RC_SLOT_READING) {
                h->status = RC_LRU_IN_FLIGHT;
            }
        }
    }
    h->n_u = n_u;
    h->n_miss = n_miss;
    h->fresh = fresh;
    return NULL;
}

/* LruState.plan(ids i64[n], head, tail, batch, reserved, avail, work i32[5n],
 *                scratch i32[2n][, threads]) -> (status, n_u, n_miss, fresh_hits, n_ev,
 *                new_head, end, passed_busy)
 * On the state's row map, slot_row, last_used, log, log_pos and (with `reserved`: some
 * slots are reserved by prefetch pieces) its slot states.
 * The first half of a resolve with misses (NgramRowCache._resolve_unique's Python path up
 * to its read); changes no state. work is [uniq | slots | missing | victims | evicted], n
 * each: the call's n_u distinct rows ascending, their slots (-1: missing), the n_miss
 * missing rows ascending, their victims (Lru.choose_victims: the first live log
 * entries from head whose slot is not pinned (last_used != batch), not busy and not a hit
 * of this call) and the n_ev rows mapped in those victims (slot_row >= 0, victim order).
 * fresh_hits: hit slots not yet used in this batch; avail: slots neither pinned nor busy.
 * new_head: the first live entry passed over before the last victim, else end = just past
 * the last victim (new_head = end = head when nothing is missing).
 * passed_busy: the victims' scan passed a live entry of a busy slot (one a prefetch in
 * flight holds; of a BUSY_READ slot, one neither pinned nor a hit of this call:
 * Lru.passed_reserved(end), found in the scan instead of over every job's slots).
 * status (csrc/lru_status.h): RC_LRU_OK: planned. RC_LRU_EXHAUSTED: n_miss > avail -
 * fresh_hits. RC_LRU_BAD_ID: ids[n_u] is outside [0, rows). RC_LRU_LOG_FULL: the log ended
 * before n_miss victims (cannot happen after the availability test). RC_LRU_IN_FLIGHT: a
 * row of the call is in a BUSY_READING slot (its prefetch must be settled first; nothing
 * else planned).
 * threads (default 1): the scan (sort, dedup, the maps' lookups) runs in up to that many
 * contiguous parts of the ids (each at least PLAN_GRAIN) on the step's pool; when the
 * parts' sorted ids are not disjoint ascending ranges (a shared arena's step is: its ids
 * come table by table), one part scans the whole call. The result does not depend on it. */
PyObject *rc_state_plan(LruState *st, PyObject *args) {
    PyObject *o_ids, *o_work, *o_scr;
    long long batch;
    Py_ssize_t head, tail, avail;
    int reserved, threads = 1;
    if (!PyArg_ParseTuple(args, "OnnLpnOO|i", &o_ids, &head, &tail, &batch, &reserved, &avail,
                          &o_work, &o_scr, &threads)) {
        return NULL;
    }
    Buf b[3];
    memset(b, 0, sizeof b);
    if (rc_buf_get(o_ids, &b[0], 8, 0, "ids") || rc_buf_get(o_work, &b[1], 4, 1, "work") ||
        rc_buf_get(o_scr, &b[2], 4, 1, "scratch")) {
        rc_buf_release(b, 3);
        return NULL;
    }
    const int64_t *ids = b[0].view.buf, *last_used = st->last_used;
    const RowMap *map = st->map;
    const int32_t *slot_row = st->slot_row;
    const int32_t *log = st->log, *log_pos = st->log_pos;
    const uint8_t *busy = reserved ? st->state : NULL;
    int32_t *work = b[1].view.buf, *scr = b[2].view.buf;
    Py_ssize_t n = COUNT(b[0]), R = st->R, S = st->S, cap = st->cap;
    long long rows = R;
    if (COUNT(b[1]) < 5 * n || COUNT(b[2]) < 2 * n || head < 0 || head > tail || tail > cap) {
        rc_buf_release(b, 3);
        PyErr_SetString(PyExc_ValueError, "LruState.plan: inconsistent shapes");
        return NULL;
    }
    int32_t *uniq = work, *slots = work + n, *missing = work + 2 * n, *victims = work + 3 * n;
    int32_t *evicted = work + 4 * n;
    int status = RC_LRU_OK, passed_busy = 0;
    Py_ssize_t n_u = 0, n_miss = 0, fresh = 0, n_ev = 0, new_head = head, end = head;
    PlanPart part[MAXT];
    int K = rc_split_count(threads, n, PLAN_GRAIN);
    Py_BEGIN_ALLOW_THREADS
    if (K > 1) { /* parts end where every id before is below every id after (tables' ends) */
        int32_t *sufmin = victims; /* victims and evicted: 2n, unused until the scan is done */
        int64_t m = INT64_MAX, pmax = -1;
        for (Py_ssize_t i = n - 1; i >= 0; i--) {
            m = ids[i] < m ? ids[i] : m;
            sufmin[i] = m > INT32_MAX ? INT32_MAX : (m < 0 ? -1 : (int32_t)m);
        }
        Py_ssize_t lo = 0;
        int k = 0;
        for (Py_ssize_t i = 1; i < n && k < K - 1; i++) {
            pmax = ids[i - 1] > pmax ? ids[i - 1] : pmax;
            if (i >= n * (k + 1) / K && pmax < sufmin[i] && i - lo >= PLAN_GRAIN / 2) {
                part[k++].hi = i;
                part[k].lo = lo = i;
            }
        }
        part[0].lo = 0;
        part[k].hi = n;
        K = k + 1;
    } else {
        part[0].lo = 0;
        part[0].hi = n;
    }
    for (int k = 0; k < K; k++) {
        part[k] = (PlanPart){ids, map, last_used, busy, scr, uniq, slots, missing, n, S,
                             part[k].lo, part[k].hi, rows, batch, 0, 0, 0, 0, 0};
    }
    rc_pool_parallel(K, plan_scan, (char *)part, sizeof part[0]);
    for (int k = 0; k < K && !status; k++) { /* the first bad id, as a serial scan finds it */
        if (part[k].status == RC_LRU_BAD_ID) {
            status = RC_LRU_BAD_ID;
            n_u = part[k].bad;
        }
    }
    if (status == RC_LRU_OK && K > 1) {
        int disjoint = 1;
        for (int k = 1; k < K; k++) { /* the last of part k-1 < the first of part k */
            disjoint &= part[k - 1].n_u == 0 || part[k].n_u == 0 ||
                        uniq[part[k - 1].lo + part[k - 1].n_u - 1] < uniq[part[k].lo];
        }
        if (!disjoint) { /* one part over the whole call */
            part[0].lo = 0;
            part[0].hi = n;
            K = 1;
            plan_scan(&part[0]);
        }
    }
    if (status == RC_LRU_OK) { /* the parts' uniq, slots and missing made contiguous, in order */
        for (int k = 0; k < K; k++) {
            const PlanPart *h = &part[k];
            if (h->lo != n_u) {
                memmove(uniq + n_u, uniq + h->lo, (size_t)h->n_u * sizeof *uniq);
                memmove(slots + n_u, slots + h->lo, (size_t)h->n_u * sizeof *slots);
            }
            if (h->lo != n_miss) {
                memmove(missing + n_miss, missing + h->lo, (size_t)h->n_miss * sizeof *missing);
            }
            n_u += h->n_u;
            n_miss += h->n_miss;
            fresh += h->fresh;
            status = status ? status : h->status;
        }
        if (status == RC_LRU_OK && n_miss > 0 && n_miss > avail - fresh) {
            status = RC_LRU_EXHAUSTED;
        }
    }
    if (status == RC_LRU_OK && n_miss > 0) {
        Py_ssize_t got = 0, first_kept = -1, p = head;
        for (; got < n_miss; p++) {
            if (p >= tail) {
                status = RC_LRU_LOG_FULL;
                break;
            }
            if (p + PF < tail) {
                int32_t q = log[p + PF];
                if (q >= 0 && q < S) {
                    __builtin_prefetch(&log_pos[q]);
                    __builtin_prefetch(&last_used[q]);
                    __builtin_prefetch(&slot_row[q]);
                }
            }
            int32_t s = log[p];
            if (s < 0 || s >= S || log_pos[s] != (int32_t)p) {
                continue; /* stale: the slot has a newer entry */
            }
            int b = busy ? busy[s] : RC_SLOT_RESIDENT;
            int ok = last_used[s] != batch && b < RC_SLOT_READING;
            if ((ok && fresh > 0) || (b == RC_SLOT_READ && last_used[s] != batch)) {
                /* a hit of this call is pinned by it: no victim, and no slot passed */
                int32_t r = slot_row[s];
                int hit = r >= 0 && r < R && sorted_has(uniq, n_u, r) && rm_get(map, r) == s;
                ok = ok && !hit;
                passed_busy |= b == RC_SLOT_READ && !hit;
            }
            passed_busy |= b == RC_SLOT_READING;
            if (ok) {
                victims[got++] = s;
            } else if (first_kept < 0) {
                first_kept = p; /* pinned, busy or hit: stays in the log */
            }
        }
        if (status == RC_LRU_OK) {
            end = p; /* just past the last victim */
            new_head = first_kept >= 0 ? first_kept : end;
            for (Py_ssize_t j = 0; j < n_miss; j++) {
                int32_t r = slot_row[victims[j]];
                if (r >= 0) {
                    evicted[n_ev++] = r;
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    rc_buf_release(b, 3);
    return Py_BuildValue("(innnnnni)", status, n_u, n_miss, fresh, n_ev, new_head, end,
                         passed_busy);
}

typedef struct {
    const int64_t *ids;
    const int32_t *slots; /* the call's distinct slots, in ascending row order */
    const RowMap *map;
    int32_t *log, *log_pos, *out;
    int64_t *last_used;
    Py_ssize_t j0, j1, i0, i1, tail; /* its distinct rows, its ids; the log from tail + j0 */
    long long batch;
    Py_ssize_t fresh;
} CommitPart;

/* One part of lru_commit's touch: pins its distinct slots and logs them at tail + j (j its
 * rows' places in ascending row order), then writes the slots of its ids to out. */
static void *commit_touch(void *arg) {
    CommitPart *h = arg;
    const int32_t *slots = h->slots;
    int64_t *last_used = h->last_used;
    int32_t *log = h->log, *log_pos = h->log_pos;
    long long batch = h->batch;
    Py_ssize_t fresh = 0;
    for (Py_ssize_t j = h->j0; j < h->j1; j++) {
        if (j + PF < h->j1) {
            __builtin_prefetch(&last_used[slots[j + PF]], 1);
            __builtin_prefetch(&log_pos[slots[j + PF]], 1);
        }
        int32_t s = slots[j];
        if (last_used[s] != batch) {
            fresh++;
            last_used[s] = batch;
        }
        log[h->tail + j] = s;
        log_pos[s] = (int32_t)(h->tail + j);
    }
    const int64_t *ids = h->ids;
    const RowMap *map = h->map;
    for (Py_ssize_t i = h->i0; i < h->i1; i++) {
        if (i + PF < h->i1) {
            rm_prefetch(map, (int32_t)ids[i + PF]);
        }
        h->out[i] = rm_get(map, (int32_t)ids[i]);
    }
    h->fresh = fresh;
    return NULL;
}

/* LruState.commit(ids i64[n], work i32[5n], n_u, n_miss, n_ev, head, tail, batch,
 *                  out i32[n][, threads]) -> (fresh, head, tail)
 * On the state's arrays (row_offsets and part_counts: the parts').
 * The second half, once the missing rows' reads succeeded: with work and head (its
 * new_head) from plan, unmaps the evicted rows, maps the missing rows to their victims
 * (their states RC_SLOT_RESIDENT), pins the call's slots (last_used = batch) and logs them
 * at tail in ascending row order (compacting the log first when it lacks room for n_u entries, as
 * Lru.log_slots), writes each part's misses (parts: row_offsets) to part_counts (the
 * caller adds them to its counts: C counts, it does not keep the books), and
 * writes the slots of ids to out. fresh: slots not used in this batch before (victims
 * included). Arguments are checked before anything changes. threads (default 1): of the
 * compaction (rc_compact_log), and of the pins, log entries and out (parts of at least
 * PLAN_GRAIN distinct rows), on the step's pool. */
PyObject *rc_state_commit(LruState *st, PyObject *args) {
    PyObject *o_ids, *o_work, *o_out;
    Py_ssize_t n_u, n_miss, n_ev, head, tail;
    long long batch;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOnnnnnLO|i", &o_ids, &o_work, &n_u, &n_miss, &n_ev, &head,
                          &tail, &batch, &o_out, &threads)) {
        return NULL;
    }
    Buf b[3];
    memset(b, 0, sizeof b);
    if (rc_buf_get(o_ids, &b[0], 8, 0, "ids") || rc_buf_get(o_work, &b[1], 4, 1, "work") ||
        rc_buf_get(o_out, &b[2], 4, 1, "out")) {
        rc_buf_release(b, 3);
        return NULL;
    }
    const int64_t *ids = b[0].view.buf, *off = st->row_offsets;
    int32_t *work = b[1].view.buf, *slot_row = st->slot_row;
    RowMap *map = st->map;
    int64_t *last_used = st->last_used, *part_counts = st->part_counts;
    int32_t *log = st->log, *log_pos = st->log_pos, *out = b[2].view.buf;
    uint8_t *state = st->state;
    Py_ssize_t n = COUNT(b[0]), R = st->R, S = st->S, cap = st->cap, P = st->P;
    /* S + n_u <= cap: after a compaction (at most S live entries) the call's entries fit */
    if (COUNT(b[1]) < 5 * n || COUNT(b[2]) < n || n_ev < 0 || n_ev > n_miss ||
        n_miss > n_u || n_u > n || n_u > S || S + n_u > cap || head < 0 || head > tail ||
        tail > cap) {
        rc_buf_release(b, 3);
        PyErr_SetString(PyExc_ValueError, "LruState.commit: inconsistent shapes");
        return NULL;
    }
    int32_t *uniq = work, *slots = work + n, *missing = work + 2 * n, *victims = work + 3 * n;
    int32_t *evicted = work + 4 * n;
    int bad = 0;
    Py_ssize_t fresh = 0;
    Py_BEGIN_ALLOW_THREADS
    /* every index in range and the plan consistent (its missing rows are the unique rows
     * without a slot), or nothing changes */
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        bad = (uint64_t)ids[i] >= (uint64_t)R;
    }
    Py_ssize_t m = 0;
    for (Py_ssize_t j = 0; j < n_u && !bad; j++) {
        if ((uint32_t)uniq[j] >= (uint64_t)R || (j > 0 && uniq[j] <= uniq[j - 1])) {
            bad = 1;
        } else if (slots[j] < 0) {
            bad = m >= n_miss || missing[m] != uniq[j];
            m++;
        } else {
            bad = slots[j] >= S;
        }
    }
    bad = bad || m != n_miss;
    for (Py_ssize_t j = 0; j < n_miss && !bad; j++) {
        bad = (uint32_t)victims[j] >= (uint64_t)S;
    }
    for (Py_ssize_t j = 0; j < n_ev && !bad; j++) {
        bad = (uint32_t)evicted[j] >= (uint64_t)R;
    }
    bad = bad || !rm_room(map, n_miss - n_ev); /* (cannot happen: pairs > 2 x slots) */
    if (!bad) {
        for (Py_ssize_t j = 0; j < n_ev; j++) {
            if (j + PF < n_ev) {
                rm_prefetch(map, evicted[j + PF]);
            }
            rm_del(map, evicted[j]);
        }
        for (Py_ssize_t k = 0; k < n_miss; k++) { /* the missing rows (ascending), mapped */
            if (k + PF < n_miss) {
                rm_prefetch(map, missing[k + PF]);
                __builtin_prefetch(&slot_row[victims[k + PF]], 1);
            }
            int32_t s = victims[k];
            rm_set(map, missing[k], s);
            slot_row[s] = missing[k];
            state[s] = RC_SLOT_RESIDENT; /* a victim was free or resident */
        }
        for (Py_ssize_t j = 0, k = 0; j < n_u; j++) {
            if (slots[j] < 0) {
                slots[j] = victims[k++];
            }
        }
        if (tail + n_u > cap) { /* first: the slots' old entries are still live, and kept */
            tail = rc_compact_log(log, log_pos, S, head, tail, threads, rc_pool_get(POOL_STEP), 0);
            head = 0;
        }
        /* the slots are distinct, and out is read after the maps changed: parts apart */
        CommitPart part[MAXT];
        int K = rc_split_count(threads, n_u, PLAN_GRAIN);
        for (int k = 0; k < K; k++) {
            part[k] = (CommitPart){ids, slots, map, log, log_pos, out, last_used,
                                   n_u * k / K, n_u * (k + 1) / K, n * k / K, n * (k + 1) / K,
                                   tail, batch, 0};
        }
        rc_pool_parallel(K, commit_touch, (char *)part, sizeof part[0]);
        for (int k = 0; k < K; k++) {
            fresh += part[k].fresh;
        }
        tail += n_u;
        /* missing rows ascending: each part's misses are one run */
        memset(part_counts, 0, (size_t)P * sizeof *part_counts);
        for (Py_ssize_t j = 0, p = 0; j < n_miss; j++) {
            while (p < P - 1 && missing[j] >= off[p + 1]) {
                p++;
            }
            part_counts[p]++;
        }
    }
    Py_END_ALLOW_THREADS
    rc_buf_release(b, 3);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "LruState.commit: a row or slot out of range, or not plan's work");
        return NULL;
    }
    return Py_BuildValue("(nnn)", fresh, head, tail);
}
