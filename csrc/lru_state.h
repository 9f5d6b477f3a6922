/* csrc/lru_state.h: the row cache's native state object (csrc/lru_state.c), made once with
 * the slot table's and the LRU's arrays (rowcache.cache.slots.SlotTable, rowcache.cache.lru.Lru)
 * so that a call passes ids and a plan, not the arrays (row_map: an int32 [R] array, or a
 * RowHash, csrc/row_map.h): `_host.LruState(row_map, slot_row,
 * state, last_used, log, log_pos, row_offsets, part_counts)`. Its methods are the LRU's C:
 * hits, scan, touch_start (csrc/lru_hits.c, csrc/lru_touch.c), plan, commit (csrc/lru_miss.c),
 * compact. The object holds the arrays' buffers until it is freed (they cannot be resized
 * meanwhile); a touch in flight holds a reference to it.
 */
#ifndef ROWCACHE_LRU_STATE_H
#define ROWCACHE_LRU_STATE_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <stdint.h>

#include "pybuf.h"
#include "row_map.h"

typedef struct {
    PyObject_HEAD
    Buf b[8];           /* the arrays below, in the constructor's order */
    RowMap *map;        /* row -> slot: &dense, or a RowHash's (held in `hash`) */
    RowMap dense;       /* over the int32 [R] array given as row_map */
    PyObject *hash;     /* the RowHash given as row_map, or NULL */
    int32_t *slot_row;  /* [S] */
    uint8_t *state;     /* [S] csrc/lru_slots.h */
    int64_t *last_used; /* [S] */
    int32_t *log;       /* [cap] */
    int32_t *log_pos;   /* [S] */
    const int64_t *row_offsets; /* [P + 1]: 0 = offsets[0] <= ... <= offsets[P] = R */
    int64_t *part_counts;       /* [P]: each commit writes its misses per part here */
    Py_ssize_t R, S, cap, P;
} LruState;

#pragma GCC visibility push(hidden) /* shared between this module's files only */
extern PyTypeObject rc_LruStateType;
/* the methods, in the files of their reference code */
PyObject *rc_state_hits(LruState *st, PyObject *args);          /* csrc/lru_hits.c */
PyObject *rc_state_compact(LruState *st, PyObject *args);       /* csrc/lru_hits.c */
PyObject *rc_state_scan(LruState *st, PyObject *args);          /* csrc/lru_touch.c */
PyObject *rc_state_touch_start(LruState *st, PyObject *args);   /* csrc/lru_touch.c */
PyObject *rc_state_plan(LruState *st, PyObject *args);          /* csrc/lru_miss.c */
PyObject *rc_state_commit(LruState *st, PyObject *args);        /* csrc/lru_miss.c */
#pragma GCC visibility pop

#endif
