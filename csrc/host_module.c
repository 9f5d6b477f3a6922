/* rowcache.kernels._host: the per-step host kernels of a cached embedding step. This file
 * is the module (its method table and PyInit__host); the functions live in:
 *   csrc/ngram_hash.c  hash_packed
 *   csrc/lru_hits.c    lru_hits, lru_compact (and the sort, scan and compaction the others use)
 *   csrc/lru_miss.c    lru_plan, lru_commit
 *   csrc/lru_touch.c   lru_scan, lru_touch_start, lru_touch_wait (the toucher thread)
 *   csrc/pool.c        the worker pools of their parallel calls
 *   csrc/pybuf.c       the buffer helpers they share
 *
 * hash_packed: LongCat n-gram ids of the embedded positions of a packed batch
 *   (docs/ngram-spec.md), with an optional per-table offset added (global ids of a
 *   shared arena). Tokens come checked (rowcache.embed.ngram.batch.NgramBatch checks them
 *   once).
 * lru_hits: the all-hits path of NgramRowCache.resolve: map ids to slots, and when
 *   every row is resident, pin and touch the call's unique slots in ascending row
 *   order (the cache's tie rule) in the LRU log.
 * lru_plan, lru_commit: the bookkeeping of a resolve with misses, around its read:
 *   dedup, exhaustion test and victims (changing nothing), then, once the reads
 *   succeeded, the maps, pins, LRU log and per-part miss counts (csrc/lru_miss.c).
 * lru_compact: the LRU log's compaction.
 *
 * All are bit-exact with their references (rowcache.embed.ngram.batch.hash_positions and
 * NgramRowCache's Python paths), checked by tests/kernels/test_host.py and
 * tests/rowcache/test_miss_native.py. Arrays come in through the buffer protocol
 * (C-contiguous, checked item sizes); the GIL is released for the whole call. No
 * library beyond libc and Python.
 *
 * lru_hits and hash_packed take an optional thread count: a large call (a prefill
 * step's tens of thousands of ids) is split over up to that many threads (the caller's
 * and the workers of csrc/pool.c, kept between calls). lru_hits gives each a
 * contiguous part of the ids (the parts of a shared arena's step are its tables, whose
 * global ids are disjoint ranges); hash_packed gives each a run of tables. Results are
 * identical whatever the count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "lru_hits.h"   /* lru_hits, lru_compact */
#include "lru_miss.h"   /* lru_plan, lru_commit: the miss path */
#include "lru_slots.h"  /* the slot states, exported as SLOT_* */
#include "lru_touch.h"  /* lru_scan, lru_touch_start, lru_touch_wait: the deferred touch */
#include "ngram_hash.h" /* hash_packed */

static PyMethodDef methods[] = {
    {"lru_compact", rc_lru_compact, METH_VARARGS, "Compact NgramRowCache's LRU log in place."},
    {"hash_packed", rc_hash_packed, METH_VARARGS, "LongCat ids of a packed batch's embedded positions."},
    {"lru_hits", rc_lru_hits, METH_VARARGS, "The all-hits path of NgramRowCache.resolve."},
    {"lru_plan", rc_lru_plan, METH_VARARGS, "Victims of a resolve with misses (changes nothing)."},
    {"lru_commit", rc_lru_commit, METH_VARARGS, "Commit a planned resolve once its reads succeeded."},
    {"lru_scan", rc_lru_scan, METH_VARARGS, "lru_hits' scan alone: slots, misses, keys."},
    {"lru_touch_start", rc_lru_touch_start, METH_VARARGS, "lru_hits' touch on a background thread."},
    {"lru_touch_wait", rc_lru_touch_wait, METH_VARARGS, "Wait for a touch started by lru_touch_start."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "rowcache.kernels._host", NULL, -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__host(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL || PyModule_AddIntConstant(m, "SLOT_FREE", RC_SLOT_FREE) ||
        PyModule_AddIntConstant(m, "SLOT_RESIDENT", RC_SLOT_RESIDENT) ||
        PyModule_AddIntConstant(m, "SLOT_READING", RC_SLOT_READING) ||
        PyModule_AddIntConstant(m, "SLOT_READ", RC_SLOT_READ)) {
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
