/* rowcache.kernels._host: the per-step host kernels of a cached embedding step. This file
 * is the module (its method table, its LruState type and slot constants, PyInit__host);
 * the functions live in:
 *   csrc/ngram_hash.c  hash_packed
 *   csrc/engram_hash.c EngramHasher: the head ids of DeepSeek Engram (docs/engram-spec.md)
 *                      and the rows of Qwen4 (docs/qwen4-spec.md): one kernel
 *   csrc/lru_state.c   LruState: the row cache's arrays, held once (csrc/lru_state.h)
 *   csrc/row_map.c     RowHash: a row -> slot hash map (csrc/row_map.h), an LruState's map
 *   csrc/lru_hits.c    LruState.hits, .compact (and the sort, scan and compaction the others use)
 *   csrc/lru_miss.c    LruState.plan, .commit
 *   csrc/lru_touch.c   LruState.scan, .touch_start, lru_touch_wait (the toucher thread)
 *   csrc/pool.c        the worker pools of their parallel calls
 *   csrc/pybuf.c       the buffer helpers they share
 *
 * hash_packed: LongCat n-gram ids of the embedded positions of a packed batch
 *   (docs/ngram-spec.md), with an optional per-table offset added (global ids of a
 *   shared arena). Tokens come checked (rowcache.embed.ngram.batch.NgramBatch checks them
 *   once).
 * LruState(row_map, slot_row, state, last_used, log, log_pos, row_offsets, part_counts):
 *   made once by rowcache.cache.lru.Lru with the slot table's and the LRU's arrays (the
 *   row map an int32 array or a RowHash: rowcache.cache.row_map); a call
 *   passes ids and a plan. hits: the all-hits path of NgramRowCache.resolve; plan, commit:
 *   the bookkeeping of a resolve with misses, around its read (csrc/lru_miss.c); scan and
 *   touch_start: the deferred touch; compact: the LRU log's compaction.
 * SLOT_FREE .. SLOT_READ: the slot states (csrc/lru_slots.h, rowcache.cache.slots.SlotState).
 * LRU_OK .. LRU_EXHAUSTED: what the LRU's calls found (csrc/lru_status.h,
 *   rowcache.cache.plan.LruStatus).
 *
 * All are bit-exact with their references (rowcache.embed.ngram.batch.hash_positions and
 * the cache's Python paths), checked by tests/kernels/test_host.py and
 * tests/cache/test_miss_native.py. Arrays come in through the buffer protocol
 * (C-contiguous, checked item sizes); the GIL is released for the whole call. No
 * library beyond libc and Python.
 *
 * hits and hash_packed take an optional thread count: a large call (a prefill step's tens
 * of thousands of ids) is split over up to that many threads (the caller's and the
 * workers of csrc/pool.c, kept between calls). hits gives each a contiguous part of the
 * ids (the parts of a shared arena's step are its tables, whose global ids are disjoint
 * ranges); hash_packed gives each a run of tables. Results are identical whatever the count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "lru_slots.h"  /* the slot states, exported as SLOT_* */
#include "lru_status.h" /* what the LRU's calls found, exported as LRU_* */
#include "lru_state.h"  /* LruState: the arrays, held once; the LRU's calls are its methods */
#include "lru_touch.h"  /* lru_touch_wait: the deferred touch */
#include "ngram_hash.h" /* hash_packed */
#include "engram_hash.h" /* EngramHasher */
#include "row_map.h"     /* RowHash */

static PyMethodDef methods[] = {
    {"hash_packed", rc_hash_packed, METH_VARARGS, "LongCat ids of a packed batch's embedded positions."},
    {"lru_touch_wait", rc_lru_touch_wait, METH_VARARGS, "Wait for a touch started by LruState.touch_start."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "rowcache.kernels._host", NULL, -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__host(void) {
    if (PyType_Ready(&rc_LruStateType) < 0 || PyType_Ready(&rc_EngramHasherType) < 0 ||
        PyType_Ready(&rc_RowHashType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL || PyModule_AddObjectRef(m, "LruState", (PyObject *)&rc_LruStateType) ||
        PyModule_AddObjectRef(m, "EngramHasher", (PyObject *)&rc_EngramHasherType) ||
        PyModule_AddObjectRef(m, "RowHash", (PyObject *)&rc_RowHashType) ||
        PyModule_AddIntConstant(m, "SLOT_FREE", RC_SLOT_FREE) ||
        PyModule_AddIntConstant(m, "SLOT_RESIDENT", RC_SLOT_RESIDENT) ||
        PyModule_AddIntConstant(m, "SLOT_READING", RC_SLOT_READING) ||
        PyModule_AddIntConstant(m, "SLOT_READ", RC_SLOT_READ) ||
        PyModule_AddIntConstant(m, "LRU_OK", RC_LRU_OK) ||
        PyModule_AddIntConstant(m, "LRU_MISS", RC_LRU_MISS) ||
        PyModule_AddIntConstant(m, "LRU_BAD_ID", RC_LRU_BAD_ID) ||
        PyModule_AddIntConstant(m, "LRU_LOG_FULL", RC_LRU_LOG_FULL) ||
        PyModule_AddIntConstant(m, "LRU_IN_FLIGHT", RC_LRU_IN_FLIGHT) ||
        PyModule_AddIntConstant(m, "LRU_EXHAUSTED", RC_LRU_EXHAUSTED)) {
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
