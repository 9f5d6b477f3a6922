/* csrc/row_map.c: the type RowHash of rowcache.kernels._host: a row -> slot hash map
 * (csrc/row_map.h) of a fixed capacity, owned here, read and written by the LRU's C
 * (an LruState made over it) and by rowcache.cache.row_map.HashRowMap's calls below.
 *
 * RowHash(rows, capacity): an empty map of rows 0 <= row < rows (< 2**31) over
 *   `capacity` pairs (a power of two, 2 .. 2**30).
 * get(ids i64[n], out i32[n]): out = the ids' slots, -1 where not mapped.
 * set(rows i64[n], slots i32[n]): map each row to its slot (distinct rows; slots >= 0);
 *   refused before any change when the new rows would leave no empty pair.
 * unset(rows i64[n]): unmap them (rows not mapped: nothing).
 * items() -> (rows i64[count] ascending, slots i32[count]).
 * fill(out i32[rows]): the dense map (-1 where not mapped).
 * check() -> list of str: every broken invariant (a row outside [0, rows), a pair not
 *   reachable from its row's home without passing an empty pair, a row twice, a negative
 *   slot, count not the pairs held); empty when sound.
 * count, capacity, rows, nbytes: read-only.
 * Ids and rows are range-checked before anything changes (ValueError naming the first bad
 * one); the GIL is released for a call's whole loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "pybuf.h"
#include "row_map.h"

static int hash_init(RowHash *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"rows", "capacity", NULL};
    Py_ssize_t rows, cap;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nn:RowHash", kw, &rows, &cap)) {
        return -1;
    }
    if (rows < 1 || rows > INT32_MAX || cap < 2 || cap > (1 << 30) || (cap & (cap - 1))) {
        PyErr_Format(PyExc_ValueError,
                     "RowHash: rows=%zd, capacity=%zd: give 1 <= rows < 2**31 and a power of "
                     "two 2 <= capacity <= 2**30", rows, cap);
        return -1;
    }
    if (self->map.tab != NULL) { /* an LruState may hold it: never re-made */
        PyErr_SetString(PyExc_ValueError, "RowHash: already initialized");
        return -1;
    }
    /* anonymous pages, asked to be huge where the kernel allows it (madvise mode): a
     * look-up is one random access into the table, and 2 MiB pages keep a table of tens of
     * MB in the TLB */
    size_t bytes = (size_t)cap * 2 * sizeof(int32_t);
    int32_t *tab = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (tab == MAP_FAILED) {
        PyErr_NoMemory();
        return -1;
    }
#ifdef MADV_HUGEPAGE
    if (bytes >= (2u << 20)) {
        (void)madvise(tab, bytes, MADV_HUGEPAGE); /* a hint: refused or not, the same map */
    }
#endif
    memset(tab, 0xff, bytes); /* every pair (-1, -1): empty */
    int bits = 0;
    while (((Py_ssize_t)1 << bits) < cap) {
        bits++;
    }
    self->map = (RowMap){NULL, tab, (uint32_t)(cap - 1), 32 - bits, 0};
    self->R = rows;
    return 0;
}

static void hash_dealloc(RowHash *self) {
    if (self->map.tab != NULL) {
        munmap(self->map.tab, ((size_t)self->map.mask + 1) * 2 * sizeof(int32_t));
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define READY(self)                                                                 \
    if ((self)->map.tab == NULL) {                                                  \
        PyErr_SetString(PyExc_ValueError, "RowHash: not initialized");              \
        return NULL;                                                                \
    }

/* The first of ids[0:n] outside [0, R), or -1. */
static Py_ssize_t first_bad(const int64_t *ids, Py_ssize_t n, Py_ssize_t R) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((uint64_t)ids[i] >= (uint64_t)R) {
            return i;
        }
    }
    return -1;
}

static PyObject *bad_row(const char *call, const int64_t *ids, Py_ssize_t i, Py_ssize_t R) {
    PyErr_Format(PyExc_ValueError, "RowHash.%s: row %lld (at %zd) is outside [0, %zd)", call,
                 (long long)ids[i], i, R);
    return NULL;
}

static PyObject *hash_get(RowHash *self, PyObject *args) {
    READY(self)
    PyObject *o_ids, *o_out;
    if (!PyArg_ParseTuple(args, "OO", &o_ids, &o_out)) {
        return NULL;
    }
    Buf b[2];
    memset(b, 0, sizeof b);
    if (rc_buf_get(o_ids, &b[0], 8, 0, "ids") || rc_buf_get(o_out, &b[1], 4, 1, "out")) {
        rc_buf_release(b, 2);
        return NULL;
    }
    const int64_t *ids = b[0].view.buf;
    int32_t *out = b[1].view.buf;
    Py_ssize_t n = COUNT(b[0]), bad = -1;
    if (COUNT(b[1]) < n) {
        rc_buf_release(b, 2);
        PyErr_SetString(PyExc_ValueError, "RowHash.get: out is shorter than ids");
        return NULL;
    }
    const RowMap *m = &self->map;
    Py_BEGIN_ALLOW_THREADS
    bad = first_bad(ids, n, self->R);
    if (bad < 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i + 16 < n) {
                rm_prefetch(m, (int32_t)ids[i + 16]);
            }
            out[i] = rm_get(m, (int32_t)ids[i]);
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        bad_row("get", ids, bad, self->R);
    }
    rc_buf_release(b, 2);
    if (bad >= 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *hash_set(RowHash *self, PyObject *args) {
    READY(self)
    PyObject *o_rows, *o_slots;
    if (!PyArg_ParseTuple(args, "OO", &o_rows, &o_slots)) {
        return NULL;
    }
    Buf b[2];
    memset(b, 0, sizeof b);
    if (rc_buf_get(o_rows, &b[0], 8, 0, "rows") || rc_buf_get(o_slots, &b[1], 4, 0, "slots")) {
        rc_buf_release(b, 2);
        return NULL;
    }
    const int64_t *rows = b[0].view.buf;
    const int32_t *slots = b[1].view.buf;
    Py_ssize_t n = COUNT(b[0]), bad = -1, fresh = 0, neg = -1;
    if (COUNT(b[1]) != n) {
        rc_buf_release(b, 2);
        PyErr_SetString(PyExc_ValueError, "RowHash.set: rows and slots differ in length");
        return NULL;
    }
    RowMap *m = &self->map;
    int full = 0;
    Py_BEGIN_ALLOW_THREADS
    bad = first_bad(rows, n, self->R);
    for (Py_ssize_t i = 0; i < n && bad < 0 && neg < 0; i++) {
        neg = slots[i] < 0 ? i : -1;
    }
    if (bad < 0 && neg < 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            fresh += rm_get(m, (int32_t)rows[i]) < 0;
        }
        full = !rm_room(m, fresh); /* (a row given twice counts twice: refused early, safe) */
        for (Py_ssize_t i = 0; i < n && !full; i++) {
            rm_set(m, (int32_t)rows[i], slots[i]);
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        bad_row("set", rows, bad, self->R);
    } else if (neg >= 0) {
        PyErr_Format(PyExc_ValueError, "RowHash.set: slot %d (at %zd) is negative", slots[neg], neg);
    } else if (full) {
        PyErr_Format(PyExc_ValueError,
                     "RowHash.set: %zd new rows do not fit (%zd of %zd pairs held, one stays empty)",
                     fresh, m->count, (Py_ssize_t)m->mask + 1);
    }
    rc_buf_release(b, 2);
    if (bad >= 0 || neg >= 0 || full) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *hash_unset(RowHash *self, PyObject *args) {
    READY(self)
    PyObject *o_rows;
    if (!PyArg_ParseTuple(args, "O", &o_rows)) {
        return NULL;
    }
    Buf b;
    memset(&b, 0, sizeof b);
    if (rc_buf_get(o_rows, &b, 8, 0, "rows")) {
        rc_buf_release(&b, 1);
        return NULL;
    }
    const int64_t *rows = b.view.buf;
    Py_ssize_t n = COUNT(b), bad = -1;
    RowMap *m = &self->map;
    Py_BEGIN_ALLOW_THREADS
    bad = first_bad(rows, n, self->R);
    if (bad < 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            rm_del(m, (int32_t)rows[i]);
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        bad_row("unset", rows, bad, self->R);
    }
    rc_buf_release(&b, 1);
    if (bad >= 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static int cmp_pair(const void *a, const void *b) {
    int32_t x = ((const int32_t *)a)[0], y = ((const int32_t *)b)[0];
    return (x > y) - (x < y);
}

static PyObject *hash_items(RowHash *self, PyObject *Py_UNUSED(args)) {
    READY(self)
    const RowMap *m = &self->map;
    Py_ssize_t cap = (Py_ssize_t)m->mask + 1, c = 0;
    int32_t *pairs = malloc((size_t)(m->count > 0 ? m->count : 1) * 2 * sizeof *pairs);
    if (pairs == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < cap && c < m->count; i++) {
        if (m->tab[2 * i] >= 0) {
            pairs[2 * c] = m->tab[2 * i];
            pairs[2 * c + 1] = m->tab[2 * i + 1];
            c++;
        }
    }
    qsort(pairs, (size_t)c, 2 * sizeof *pairs, cmp_pair);
    PyObject *rows = PyByteArray_FromStringAndSize(NULL, c * 8);
    PyObject *slots = PyByteArray_FromStringAndSize(NULL, c * 4);
    if (rows == NULL || slots == NULL) {
        free(pairs);
        Py_XDECREF(rows);
        Py_XDECREF(slots);
        return NULL;
    }
    int64_t *r = (int64_t *)PyByteArray_AS_STRING(rows);
    int32_t *s = (int32_t *)PyByteArray_AS_STRING(slots);
    for (Py_ssize_t i = 0; i < c; i++) {
        r[i] = pairs[2 * i];
        s[i] = pairs[2 * i + 1];
    }
    free(pairs);
    return Py_BuildValue("(NN)", rows, slots);
}

static PyObject *hash_fill(RowHash *self, PyObject *args) {
    READY(self)
    PyObject *o_out;
    if (!PyArg_ParseTuple(args, "O", &o_out)) {
        return NULL;
    }
    Buf b;
    memset(&b, 0, sizeof b);
    if (rc_buf_get(o_out, &b, 4, 1, "out")) {
        rc_buf_release(&b, 1);
        return NULL;
    }
    if (COUNT(b) != self->R) {
        rc_buf_release(&b, 1);
        PyErr_SetString(PyExc_ValueError, "RowHash.fill: out must hold one int32 a row");
        return NULL;
    }
    int32_t *out = b.view.buf;
    const RowMap *m = &self->map;
    Py_ssize_t cap = (Py_ssize_t)m->mask + 1;
    Py_BEGIN_ALLOW_THREADS
    memset(out, 0xff, (size_t)self->R * sizeof *out);
    for (Py_ssize_t i = 0; i < cap; i++) {
        if (m->tab[2 * i] >= 0) {
            out[m->tab[2 * i]] = m->tab[2 * i + 1];
        }
    }
    Py_END_ALLOW_THREADS
    rc_buf_release(&b, 1);
    Py_RETURN_NONE;
}

static int add_problem(PyObject *list, const char *msg) {
    PyObject *s = PyUnicode_FromString(msg);
    int r = s == NULL ? -1 : PyList_Append(list, s);
    Py_XDECREF(s);
    return r;
}

static PyObject *hash_check(RowHash *self, PyObject *Py_UNUSED(args)) {
    READY(self)
    const RowMap *m = &self->map;
    Py_ssize_t cap = (Py_ssize_t)m->mask + 1, held = 0;
    int outside = 0, unreachable = 0, twice = 0, negative = 0;
    for (Py_ssize_t i = 0; i < cap; i++) {
        int32_t k = m->tab[2 * i];
        if (k < 0) {
            continue;
        }
        held++;
        if (k >= self->R) {
            outside = 1;
            continue;
        }
        negative |= m->tab[2 * i + 1] < 0;
        /* from its home to i: no empty pair, and no other pair of the same row */
        for (uint32_t j = rm_home(m, k); j != (uint32_t)i; j = (j + 1) & m->mask) {
            if (m->tab[2 * j] < 0) {
                unreachable = 1;
                break;
            }
            twice |= m->tab[2 * j] == k;
        }
    }
    PyObject *bad = PyList_New(0);
    if (bad == NULL) {
        return NULL;
    }
    char msg[160];
    if ((outside && add_problem(bad, "a pair holds a row outside [0, rows)")) ||
        (unreachable && add_problem(bad, "a pair is not reachable from its row's home")) ||
        (twice && add_problem(bad, "a row is held by two pairs")) ||
        (negative && add_problem(bad, "a pair holds a negative slot"))) {
        Py_DECREF(bad);
        return NULL;
    }
    if (held != m->count) {
        snprintf(msg, sizeof msg, "count is %zd but %zd pairs are held", m->count, held);
        if (add_problem(bad, msg)) {
            Py_DECREF(bad);
            return NULL;
        }
    }
    return bad;
}

static PyObject *hash_count(RowHash *self, void *Py_UNUSED(c)) {
    return PyLong_FromSsize_t(self->map.count);
}
static PyObject *hash_capacity(RowHash *self, void *Py_UNUSED(c)) {
    return PyLong_FromSsize_t(self->map.tab ? (Py_ssize_t)self->map.mask + 1 : 0);
}
static PyObject *hash_rows(RowHash *self, void *Py_UNUSED(c)) {
    return PyLong_FromSsize_t(self->R);
}
static PyObject *hash_nbytes(RowHash *self, void *Py_UNUSED(c)) {
    return PyLong_FromSsize_t(self->map.tab ? ((Py_ssize_t)self->map.mask + 1) * 8 : 0);
}

static PyGetSetDef hash_getset[] = {
    {"count", (getter)hash_count, NULL, "Rows mapped.", NULL},
    {"capacity", (getter)hash_capacity, NULL, "Pairs (a power of two).", NULL},
    {"rows", (getter)hash_rows, NULL, "Rows of the table: 0 <= row < rows.", NULL},
    {"nbytes", (getter)hash_nbytes, NULL, "Bytes of the pairs.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef hash_methods[] = {
    {"get", (PyCFunction)hash_get, METH_VARARGS, "get(ids, out): out = slots, -1 where not mapped."},
    {"set", (PyCFunction)hash_set, METH_VARARGS, "set(rows, slots): map rows to slots."},
    {"unset", (PyCFunction)hash_unset, METH_VARARGS, "unset(rows): unmap rows."},
    {"items", (PyCFunction)hash_items, METH_NOARGS,
     "items() -> (rows int64 bytes, slots int32 bytes), rows ascending."},
    {"fill", (PyCFunction)hash_fill, METH_VARARGS, "fill(out): out = the dense map."},
    {"check", (PyCFunction)hash_check, METH_NOARGS, "check() -> broken invariants."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject rc_RowHashType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "rowcache.kernels._host.RowHash",
    .tp_basicsize = sizeof(RowHash),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A row -> slot hash map of fixed capacity (csrc/row_map.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hash_init,
    .tp_dealloc = (destructor)hash_dealloc,
    .tp_methods = hash_methods,
    .tp_getset = hash_getset,
};
