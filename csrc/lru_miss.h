/* csrc/lru_miss.h: lru_plan and lru_commit of rowcache.kernels._host (csrc/lru_miss.c). */
#ifndef ROWCACHE_LRU_MISS_H
#define ROWCACHE_LRU_MISS_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#pragma GCC visibility push(hidden) /* shared between this module's files only */
#pragma GCC visibility pop

#endif
