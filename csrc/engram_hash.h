/* csrc/engram_hash.h: EngramHasher of rowcache.kernels._host (csrc/engram_hash.c). */
#ifndef ROWCACHE_ENGRAM_HASH_H
#define ROWCACHE_ENGRAM_HASH_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#pragma GCC visibility push(hidden) /* shared between this module's files only */
extern PyTypeObject rc_EngramHasherType; /* EngramHasher: made once, .hash(tokens, ...) */
#pragma GCC visibility pop

#endif
