/* csrc/pybuf.c: the argument helpers of rowcache.kernels._host's functions: a Python
 * array taken through the buffer protocol (C-contiguous, checked item size) and released,
 * and the split of a call's work into parts for csrc/pool.c's threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "pool.h" /* MAXT */
#include "pybuf.h"

int rc_buf_get(PyObject *obj, Buf *b, Py_ssize_t itemsize, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    b->held = 0;
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) {
        return -1;
    }
    b->held = 1;
    if (b->view.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected %zd-byte items, got %zd", name, itemsize,
                     b->view.itemsize);
        return -1;
    }
    return 0;
}

void rc_buf_release(Buf *bufs, int n) {
    for (int i = 0; i < n; i++) {
        if (bufs[i].held) {
            PyBuffer_Release(&bufs[i].view);
            bufs[i].held = 0;
        }
    }
}

/* Threads for `work` items given `threads` wanted, at least `grain` items each. */
int rc_split_count(int threads, Py_ssize_t work, Py_ssize_t grain) {
    Py_ssize_t k = work / grain;
    if (k > threads) {
        k = threads;
    }
    if (k > MAXT) {
        k = MAXT;
    }
    return k < 1 ? 1 : (int)k;
}
