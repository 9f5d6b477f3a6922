/* csrc/lru_hits.h: the all-hits path of the row cache's LRU (csrc/lru_hits.c), and what the
 * miss path (csrc/lru_miss.c) and the deferred touch (csrc/lru_touch.c) share with it: the
 * sort of a call's ids, a part's scan and touch (HitsPart), the log's compaction.
 */
#ifndef ROWCACHE_LRU_HITS_H
#define ROWCACHE_LRU_HITS_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <stdint.h>

#include "lru_status.h" /* what a call found: RC_LRU_* */
#include "pool.h"
#include "row_map.h"

#define PF 16 /* software prefetch distance (iterations) of the random-access loops */
#define HITS_GRAIN 4096 /* ids an lru_hits thread at least */

typedef struct {
    const int64_t *ids;
    const RowMap *map; /* row -> slot (csrc/row_map.h) */
    int64_t *last_used;
    int32_t *log, *log_pos, *out, *scr;
    Py_ssize_t n, S;
    long long rows, batch;
    Py_ssize_t lo, hi;      /* this part's ids */
    int status;             /* RC_LRU_OK, _MISS or _BAD_ID (ids[bad]) */
    Py_ssize_t bad, n_u;    /* first bad id; distinct ids of the part */
    Py_ssize_t base, fresh; /* its first log position; slots newly pinned */
    int keys_only;          /* the scan of lru_scan: keys copied for a later sort */
} HitsPart;

#pragma GCC visibility push(hidden) /* shared between this module's files only */
/* LSD radix sort of n non-negative int32 keys (< 2**31) in a, using tmp[n]. */
void rc_radix_sort(int32_t *a, int32_t *tmp, Py_ssize_t n);
/* keys[0:n] = ids[0:n] (in range: < 2**31) as int32, sorted, with tmp[n] as the buffer. */
void rc_sort_ids(const int64_t *ids, int32_t *keys, int32_t *tmp, Py_ssize_t n);
/* A part's phases (rc_pool_parallel jobs, arg a HitsPart): the scan (range check, slots,
 * sorted ids or, keys_only, the keys) and the touch (pins and log entries from base). */
void *rc_hits_scan(void *arg);
void *rc_hits_touch(void *arg);
/* The status of a scan split into K parts (RC_LRU_OK, _MISS, _BAD_ID: *bad the first bad id). */
int rc_scan_status(const HitsPart *part, int K, Py_ssize_t *bad);
/* The log's compaction on up to `threads` threads of `pool`; returns the new tail. */
Py_ssize_t rc_compact_log(int32_t *log, int32_t *log_pos, Py_ssize_t S, Py_ssize_t head,
                          Py_ssize_t tail, int threads, Pool *pool, int wait);
#pragma GCC visibility pop

#endif
