/* csrc/lru_status.h: what the row cache LRU's calls (LruState.hits, scan, plan, touch)
 * found, shared with Python (rowcache.cache.plan.LruStatus; the module exports them as
 * LRU_OK .. LRU_EXHAUSTED, and tests/cache/test_slots.py checks that the two agree). One
 * code a meaning, whichever call gives it.
 */
#ifndef ROWCACHE_LRU_STATUS_H
#define ROWCACHE_LRU_STATUS_H

enum {
    RC_LRU_OK = 0,        /* hits, scan: every row resident; plan: planned; touch: done */
    RC_LRU_MISS = 1,      /* hits, scan: a row is not resident (nothing changed) */
    RC_LRU_BAD_ID = 2,    /* an id outside the table (nothing changed) */
    RC_LRU_LOG_FULL = 3,  /* hits, touch: no room at the log's tail (compact first); plan:
                             the log ended before enough victims (cannot happen after the
                             exhaustion test) */
    RC_LRU_IN_FLIGHT = 4, /* plan: a row of the call is being read by a prefetch piece */
    RC_LRU_EXHAUSTED = 5, /* plan: more misses than slots free or unpinned */
};

#endif
