/* csrc/pool.h: the worker pools of rowcache.kernels._host's parallel calls (csrc/pool.c).
 *
 * rc_pool_parallel(K, fn, arg, size) runs fn(arg + k * size) for k in [0, K) on the
 * caller's thread and the step's pool; rc_pool_parallel_on does it on a pool of
 * rc_pool_get (the step's or the toucher's), waiting for a busy one when asked. The pools'
 * state, their workers and the fork handler are pool.c's alone.
 */
#ifndef ROWCACHE_POOL_H
#define ROWCACHE_POOL_H

#include <stddef.h>

#define MAXT 16                 /* threads of one call at most (the caller's included) */

typedef struct Pool Pool; /* workers kept between calls (pool.c) */

enum { POOL_STEP, POOL_TOUCH };

#pragma GCC visibility push(hidden) /* shared between this module's files only */
/* The pool `which` (POOL_STEP: the calls a step makes; POOL_TOUCH: the deferred touch's). */
Pool *rc_pool_get(int which);
void rc_pool_parallel_on(Pool *p, int K, void *(*fn)(void *), char *arg, size_t size, int wait);
void rc_pool_parallel(int K, void *(*fn)(void *), char *arg, size_t size);
#pragma GCC visibility pop

#endif
