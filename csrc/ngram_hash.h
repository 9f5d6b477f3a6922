/* csrc/ngram_hash.h: hash_packed of rowcache.kernels._host (csrc/ngram_hash.c). */
#ifndef ROWCACHE_NGRAM_HASH_H
#define ROWCACHE_NGRAM_HASH_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#pragma GCC visibility push(hidden) /* shared between this module's files only */
PyObject *rc_hash_packed(PyObject *self, PyObject *args);
#pragma GCC visibility pop

#endif
