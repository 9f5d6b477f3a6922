/* csrc/pybuf.h: the argument helpers the host kernels share (csrc/pybuf.c): arrays
 * taken through the buffer protocol (C-contiguous, a checked item size) and released,
 * their item count, and the number of parts a call's work is split into.
 */
#ifndef ROWCACHE_PYBUF_H
#define ROWCACHE_PYBUF_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

typedef struct {
    Py_buffer view;
    int held;
} Buf;

#define COUNT(b) ((b).view.len / (b).view.itemsize)

#pragma GCC visibility push(hidden) /* shared between this module's files only */
/* b = obj's buffer, C-contiguous (writable if asked) with `itemsize`-byte items; 0, or -1
 * with an exception set (b->held says whether it must still be released). */
int rc_buf_get(PyObject *obj, Buf *b, Py_ssize_t itemsize, int writable, const char *name);
/* Releases the held ones of bufs[0:n]. */
void rc_buf_release(Buf *bufs, int n);
/* Threads for `work` items given `threads` wanted, at least `grain` items each (<= MAXT). */
int rc_split_count(int threads, Py_ssize_t work, Py_ssize_t grain);
#pragma GCC visibility pop

#endif
