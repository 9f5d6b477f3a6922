/* csrc/lru_touch.h: the deferred touch of rowcache.kernels._host (csrc/lru_touch.c):
 * LruState.scan and LruState.touch_start (csrc/lru_state.h), and lru_touch_wait. */
#ifndef ROWCACHE_LRU_TOUCH_H
#define ROWCACHE_LRU_TOUCH_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#pragma GCC visibility push(hidden) /* shared between this module's files only */
PyObject *rc_lru_touch_wait(PyObject *self, PyObject *args);
#pragma GCC visibility pop

#endif
