/* csrc/lru_slots.h: the states of a row cache slot, shared with Python
 * (rowcache.cache.slots.SlotState; the module exports them as SLOT_FREE .. SLOT_READ, and
 * tests/cache/test_slots.py checks that the two agree). The slot table's state array is
 * uint8[slots] of these values.
 */
#ifndef ROWCACHE_LRU_SLOTS_H
#define ROWCACHE_LRU_SLOTS_H

enum {
    RC_SLOT_FREE = 0,     /* holds no row */
    RC_SLOT_RESIDENT = 1, /* holds its row */
    RC_SLOT_READING = 2,  /* reserved by a prefetch piece in flight, its row being read */
    RC_SLOT_READ = 3,     /* reserved, and its row already read into it by a resolve */
};

#endif
