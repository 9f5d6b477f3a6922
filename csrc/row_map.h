/* csrc/row_map.h: the row cache's row -> slot map as the LRU's C reads and writes it
 * (rowcache.cache.row_map), one of two kinds behind the same inline calls:
 *
 *   dense  int32 slot[R], -1 where the row is not mapped: one load a look-up, 4 bytes a
 *          table row (the map of a table whose rows are large next to 4 bytes);
 *   hash   open addressing over `cap` (a power of two, at least twice the arena's slots)
 *          (row, slot) int32 pairs, linear probing from the row's Fibonacci hash, deletion
 *          by backward shift (no tombstones: every probe ends at an empty entry within the
 *          row's cluster): 8 bytes a pair, 16-32 bytes an arena slot whatever the table's
 *          rows, for tables of small rows whose dense map would cost more than ~2 % of
 *          their bytes (csrc/row_map.c: the type RowHash that owns one).
 *
 * Readers may run on several threads at once; a writer runs alone (the cache's lock, and
 * no deferred touch in flight: rowcache.cache.lru). The reference of both kinds is a
 * Python dict of row -> slot (tests/cache/test_row_map.py).
 */
#ifndef ROWCACHE_ROW_MAP_H
#define ROWCACHE_ROW_MAP_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <stdint.h>

typedef struct {
    int32_t *dense;   /* [R] (dense), else NULL */
    int32_t *tab;     /* [2 cap] (hash): row (-1: empty), slot */
    uint32_t mask;    /* cap - 1 */
    int shift;        /* 32 - log2(cap) */
    Py_ssize_t count; /* pairs held (hash) */
} RowMap;

#define RM_MULT 0x9E3779B1u /* 2**32 / golden ratio: consecutive rows land far apart */

static inline uint32_t rm_home(const RowMap *m, int32_t row) {
    return (uint32_t)((uint32_t)row * RM_MULT) >> m->shift;
}

/* The slot of `row` (0 <= row < R), or -1. */
static inline int32_t rm_get(const RowMap *m, int32_t row) {
    if (m->dense) {
        return m->dense[row];
    }
    const int32_t *t = m->tab;
    for (uint32_t i = rm_home(m, row);; i = (i + 1) & m->mask) {
        int32_t k = t[2 * i];
        if (k == row) {
            return t[2 * i + 1];
        }
        if (k < 0) {
            return -1;
        }
    }
}

/* Start loading what rm_get(m, row) reads first. */
static inline void rm_prefetch(const RowMap *m, int32_t row) {
    if (m->dense) {
        __builtin_prefetch(&m->dense[row]);
    } else {
        __builtin_prefetch(&m->tab[2 * rm_home(m, row)]);
    }
}

/* Map `row` to `slot` (>= 0), replacing its slot if mapped. A hash map must have room:
 * count < cap - 1 when the row is new (rm_room). */
static inline void rm_set(RowMap *m, int32_t row, int32_t slot) {
    if (m->dense) {
        m->dense[row] = slot;
        return;
    }
    int32_t *t = m->tab;
    for (uint32_t i = rm_home(m, row);; i = (i + 1) & m->mask) {
        int32_t k = t[2 * i];
        if (k == row || k < 0) {
            m->count += k < 0;
            t[2 * i] = row;
            t[2 * i + 1] = slot;
            return;
        }
    }
}

/* Unmap `row` (nothing when it is not mapped). Hash: the entries after it in its cluster
 * that may move back do (backward shift), so no probe ever passes a hole. */
static inline void rm_del(RowMap *m, int32_t row) {
    if (m->dense) {
        m->dense[row] = -1;
        return;
    }
    int32_t *t = m->tab;
    uint32_t i = rm_home(m, row);
    for (;; i = (i + 1) & m->mask) {
        int32_t k = t[2 * i];
        if (k == row) {
            break;
        }
        if (k < 0) {
            return;
        }
    }
    for (uint32_t j = i;;) {
        j = (j + 1) & m->mask;
        int32_t k = t[2 * j];
        if (k < 0) {
            break;
        }
        /* the entry at j may fill the hole at i unless its home lies cyclically in (i, j] */
        uint32_t h = rm_home(m, k);
        if (((j - h) & m->mask) >= ((j - i) & m->mask)) {
            t[2 * i] = k;
            t[2 * i + 1] = t[2 * j + 1];
            i = j;
        }
    }
    t[2 * i] = -1;
    t[2 * i + 1] = -1;
    m->count--;
}

/* A hash map can take `fresh` more rows (dense: always). */
static inline int rm_room(const RowMap *m, Py_ssize_t fresh) {
    return m->dense || m->count + fresh <= (Py_ssize_t)m->mask; /* one entry stays empty */
}

typedef struct {
    PyObject_HEAD
    RowMap map;    /* map.tab: malloc'd [2 cap], freed with the object */
    Py_ssize_t R;  /* rows: 0 <= row < R */
} RowHash;

#pragma GCC visibility push(hidden) /* shared between this module's files only */
extern PyTypeObject rc_RowHashType;
#pragma GCC visibility pop

#endif
