/* csrc/lru_state.c: the type LruState of rowcache.kernels._host (csrc/lru_state.h): made once
 * with the row cache's arrays, checked once; its methods live beside their reference code
 * (csrc/lru_hits.c, csrc/lru_touch.c, csrc/lru_miss.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "lru_state.h"

static void state_clear(LruState *self) {
    rc_buf_release(self->b, 8);
    memset(self->b, 0, sizeof self->b);
    Py_CLEAR(self->hash);
    self->map = NULL;
    self->R = self->S = self->cap = self->P = 0;
}

/* row_map: an int32 [R] array (dense) or a RowHash of R rows (csrc/row_map.h). */
static int state_init(LruState *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"row_map", "slot_row", "state", "last_used", "log", "log_pos",
                         "row_offsets", "part_counts", NULL};
    PyObject *o[8];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOO:LruState", kw, &o[0], &o[1], &o[2],
                                     &o[3], &o[4], &o[5], &o[6], &o[7])) {
        return -1;
    }
    state_clear(self); /* (a second __init__) */
    int hashed = PyObject_TypeCheck(o[0], &rc_RowHashType);
    static const Py_ssize_t sizes[8] = {4, 4, 1, 8, 4, 4, 8, 8};
    for (int i = hashed; i < 8; i++) {
        if (rc_buf_get(o[i], &self->b[i], sizes[i], i != 6, kw[i])) {
            state_clear(self);
            return -1;
        }
    }
    Buf *b = self->b;
    Py_ssize_t S = COUNT(b[1]), cap = COUNT(b[4]), P = COUNT(b[7]);
    Py_ssize_t R = hashed ? ((RowHash *)o[0])->R : COUNT(b[0]);
    const int64_t *off = b[6].view.buf;
    int bad = COUNT(b[2]) != S || COUNT(b[3]) != S || COUNT(b[5]) != S || S < 1 ||
              R > INT32_MAX || S > R || cap < S || P < 1 || COUNT(b[6]) != P + 1 ||
              off[0] != 0 || off[P] != R ||
              (hashed && (((RowHash *)o[0])->map.tab == NULL ||
                          (Py_ssize_t)((RowHash *)o[0])->map.mask < S));
    for (Py_ssize_t p = 0; p < P && !bad; p++) {
        bad = off[p] > off[p + 1];
    }
    if (bad) {
        state_clear(self);
        PyErr_SetString(PyExc_ValueError,
                        "LruState: inconsistent shapes (slot_row, state, last_used, log_pos: "
                        "S >= 1 entries; row_map an int32 array of R >= S entries, R < 2**31, "
                        "or a RowHash of R rows and more than S pairs; log at least S; "
                        "row_offsets P + 1 ascending from 0 to R; part_counts P >= 1)");
        return -1;
    }
    if (hashed) {
        Py_INCREF(o[0]);
        self->hash = o[0];
        self->map = &((RowHash *)o[0])->map;
    } else {
        self->dense = (RowMap){b[0].view.buf, NULL, 0, 0, 0};
        self->map = &self->dense;
    }
    self->slot_row = b[1].view.buf;
    self->state = b[2].view.buf;
    self->last_used = b[3].view.buf;
    self->log = b[4].view.buf;
    self->log_pos = b[5].view.buf;
    self->row_offsets = off;
    self->part_counts = b[7].view.buf;
    self->R = R;
    self->S = S;
    self->cap = cap;
    self->P = P;
    return 0;
}

static void state_dealloc(LruState *self) {
    state_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Methods of an object whose __init__ failed (or never ran) refuse to run. */
#define READY(self)                                                                    \
    if ((self)->S == 0) {                                                              \
        PyErr_SetString(PyExc_ValueError, "LruState: not initialized with its arrays"); \
        return NULL;                                                                   \
    }

static PyObject *m_hits(LruState *s, PyObject *a) { READY(s) return rc_state_hits(s, a); }
static PyObject *m_scan(LruState *s, PyObject *a) { READY(s) return rc_state_scan(s, a); }
static PyObject *m_touch(LruState *s, PyObject *a) { READY(s) return rc_state_touch_start(s, a); }
static PyObject *m_plan(LruState *s, PyObject *a) { READY(s) return rc_state_plan(s, a); }
static PyObject *m_commit(LruState *s, PyObject *a) { READY(s) return rc_state_commit(s, a); }
static PyObject *m_compact(LruState *s, PyObject *a) { READY(s) return rc_state_compact(s, a); }

static PyMethodDef state_methods[] = {
    {"hits", (PyCFunction)m_hits, METH_VARARGS,
     "hits(ids, tail, batch, out, scratch[, threads]) -> (status, fresh, tail): the all-hits path."},
    {"scan", (PyCFunction)m_scan, METH_VARARGS,
     "scan(ids, out, scratch[, threads]) -> (status, a): hits' scan alone, changing nothing."},
    {"touch_start", (PyCFunction)m_touch, METH_VARARGS,
     "touch_start(scratch, n, head, tail, batch[, threads[, after]]) -> handle or result."},
    {"plan", (PyCFunction)m_plan, METH_VARARGS,
     "plan(ids, head, tail, batch, reserved, avail, work, scratch[, threads]) -> the miss plan."},
    {"commit", (PyCFunction)m_commit, METH_VARARGS,
     "commit(ids, work, n_u, n_miss, n_ev, head, tail, batch, out[, threads]) -> (fresh, head, tail)."},
    {"compact", (PyCFunction)m_compact, METH_VARARGS,
     "compact(head, tail[, threads]) -> new tail: the log's live entries moved to its front."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject rc_LruStateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "rowcache.kernels._host.LruState",
    .tp_basicsize = sizeof(LruState),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The row cache's slot table and LRU arrays, held for the LRU's native calls.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)state_init,
    .tp_dealloc = (destructor)state_dealloc,
    .tp_methods = state_methods,
};
