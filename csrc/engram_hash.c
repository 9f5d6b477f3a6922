/* csrc/engram_hash.c: engram_hash of rowcache.kernels._host, DeepSeek Engram's host hash.
 *
 * The head-local row ids of every Engram layer at every position of a batch
 * (docs/engram-spec.md sections 1 and 4): each token is compressed through the vocabulary's
 * lookup table, the layer's n-gram mix is (x[t] * m0) XOR (x[t-1] * m1) XOR ... in 64 bits
 * (the multipliers keep every product below 2**63: no product wraps), and head h of order n
 * reads mix_n mod p[layer][n][h]. The first `ctx` columns of each row are look-back only
 * (the caller fills positions before a sequence's start with pad_id); ids are written for
 * the other columns. Bit-exact with rowcache.embed.engram.hash.hash_reference.
 *
 * The vocabulary, the multipliers and the primes are handed over once, to an EngramHasher
 * made with them (checked and copied then: the lookup as uint32, the primes with their
 * Barrett reciprocals), so that a call passes only tokens and out and costs O(tokens).
 *
 * The modulo by a prime is a Barrett reduction with a 128-bit product where the compiler
 * has one (a multiply and at most two subtractions instead of a 64-bit division). A large
 * call is split over the step's pool (csrc/pool.c), each thread a run of positions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "engram_hash.h"
#include "pool.h"
#include "pybuf.h"

#define MAXN 16       /* max_ngram at most */
#define EH_GRAIN 2048    /* ids a thread at least */

typedef struct {
    PyObject_HEAD
    uint32_t *lookup;  /* [V] compressed ids */
    int64_t *mult;     /* [L, N] */
    uint64_t *primes;  /* [L, K] */
    uint64_t *recip;   /* [L, K]: floor((2**64 - 1) / p) (Barrett) */
    Py_ssize_t V, L, N, H, K;
} EngramHasher;

typedef struct {
    const EngramHasher *e;
    const int64_t *tok;
    int64_t *out;
    Py_ssize_t B, W, C, T;
    Py_ssize_t p0, p1; /* this part's positions (b * T + t) */
} EngramJob;

static inline uint64_t mod_prime(uint64_t x, uint64_t p, uint64_t recip) {
#ifdef __SIZEOF_INT128__
    uint64_t q = (uint64_t)(((unsigned __int128)x * recip) >> 64);
    uint64_t r = x - q * p; /* q is floor(x / p), or one or two less */
    r = r >= p ? r - p : r;
    return r >= p ? r - p : r;
#else
    (void)recip;
    return x % p;
#endif
}

static void *engram_positions(void *arg) {
    const EngramJob *j = arg;
    const EngramHasher *e = j->e;
    const Py_ssize_t N = e->N, H = e->H, K = e->K, T = j->T, W = j->W, C = j->C;
    uint64_t xs[MAXN];
    for (Py_ssize_t pos = j->p0; pos < j->p1; pos++) {
        Py_ssize_t b = pos / T, t = pos % T;
        const int64_t *row = j->tok + b * W + C + t; /* row[-k]: the token k back */
        for (Py_ssize_t k = 0; k < N; k++) {
            xs[k] = e->lookup[row[-k]];
        }
        for (Py_ssize_t l = 0; l < e->L; l++) {
            const int64_t *m = e->mult + l * N;
            const uint64_t *p = e->primes + l * K, *rc = e->recip + l * K;
            int64_t *o = j->out + (l * j->B * T + pos) * K;
            uint64_t mix = xs[0] * (uint64_t)m[0];
            for (Py_ssize_t n = 1; n < N; n++) { /* order n + 1 */
                mix ^= xs[n] * (uint64_t)m[n];
                const Py_ssize_t base = (n - 1) * H;
                for (Py_ssize_t h = 0; h < H; h++) {
                    o[base + h] = (int64_t)mod_prime(mix, p[base + h], rc[base + h]);
                }
            }
        }
    }
    return NULL;
}

static void hasher_dealloc(EngramHasher *self) {
    PyMem_Free(self->lookup);
    PyMem_Free(self->mult);
    PyMem_Free(self->primes);
    PyMem_Free(self->recip);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* EngramHasher(lookup i64[V], mult i64[L, N], primes i64[L, K], heads) */
static int hasher_init(EngramHasher *self, PyObject *args, PyObject *kwds) {
    PyObject *o_lookup, *o_mult, *o_primes;
    Py_ssize_t H;
    (void)kwds;
    if (self->lookup) {
        PyErr_SetString(PyExc_TypeError, "EngramHasher: already made");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOn", &o_lookup, &o_mult, &o_primes, &H)) {
        return -1;
    }
    Buf b[3];
    memset(b, 0, sizeof b);
    if (rc_buf_get(o_lookup, &b[0], 8, 0, "lookup") || rc_buf_get(o_mult, &b[1], 8, 0, "mult") ||
        rc_buf_get(o_primes, &b[2], 8, 0, "primes")) {
        rc_buf_release(b, 3);
        return -1;
    }
    const int64_t *lookup = b[0].view.buf, *mult = b[1].view.buf, *primes = b[2].view.buf;
    Py_ssize_t V = COUNT(b[0]), n_mult = COUNT(b[1]), n_pr = COUNT(b[2]);
    Py_ssize_t L = 0, N = 0, K = 0;
    const char *bad = NULL;
    int64_t top = 0; /* the largest compressed id */
    if (H < 1 || H > 4096) {
        bad = "heads must be in 1..4096";
    } else if (V < 1 || V > INT32_MAX) {
        bad = "lookup must hold 1..2**31 - 1 token ids";
    } else if (n_pr == 0 || n_pr % H) {
        bad = "primes is not [L, (N - 1) * heads]";
    } else {
        /* n_mult = L * N and n_pr = L * (N - 1) * H, so n_mult - n_pr / H = L */
        L = n_mult - n_pr / H;
        if (L < 1 || n_mult % L) {
            bad = "mult and primes disagree on the layers";
        } else {
            N = n_mult / L;
            K = (N - 1) * H;
            if (N < 2 || N > MAXN || L * K != n_pr) {
                bad = "max_ngram must be in 2..16, primes [L, (N - 1) * heads]";
            }
        }
    }
    for (Py_ssize_t i = 0; !bad && i < V; i++) {
        if (lookup[i] < 0 || lookup[i] >= V) {
            bad = "lookup maps into [0, V)";
        } else if (lookup[i] > top) {
            top = lookup[i];
        }
    }
    for (Py_ssize_t i = 0; !bad && i < n_mult; i++) {
        if (mult[i] < 1 || mult[i] > INT64_MAX / (top + 1)) {
            bad = "every multiplier must lie in [1, 2**63 / compressed ids): a product would wrap";
        }
    }
    for (Py_ssize_t i = 0; !bad && i < n_pr; i++) {
        if (primes[i] < 2 || primes[i] > ((int64_t)1 << 62)) {
            bad = "every prime must lie in [2, 2**62]";
        }
    }
    if (bad) {
        rc_buf_release(b, 3);
        PyErr_Format(PyExc_ValueError, "EngramHasher: %s", bad);
        return -1;
    }
    self->lookup = PyMem_Malloc((size_t)V * sizeof *self->lookup);
    self->mult = PyMem_Malloc((size_t)n_mult * sizeof *self->mult);
    self->primes = PyMem_Malloc((size_t)n_pr * sizeof *self->primes);
    self->recip = PyMem_Malloc((size_t)n_pr * sizeof *self->recip);
    if (!self->lookup || !self->mult || !self->primes || !self->recip) {
        rc_buf_release(b, 3);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < V; i++) {
        self->lookup[i] = (uint32_t)lookup[i];
    }
    memcpy(self->mult, mult, (size_t)n_mult * sizeof *self->mult);
    for (Py_ssize_t i = 0; i < n_pr; i++) {
        self->primes[i] = (uint64_t)primes[i];
        self->recip[i] = UINT64_MAX / (uint64_t)primes[i];
    }
    self->V = V;
    self->L = L;
    self->N = N;
    self->H = H;
    self->K = K;
    rc_buf_release(b, 3);
    return 0;
}

/* hasher.hash(tokens i64[B, W], B, ctx, out i64[L, B, W - ctx, K][, threads]) -> None
 * Every token must lie in [0, V) (checked in one pass, before any id is written). */
static PyObject *hasher_hash(EngramHasher *self, PyObject *args) {
    PyObject *o_tok, *o_out;
    Py_ssize_t B, C;
    int threads = 1;
    if (!self->lookup) {
        PyErr_SetString(PyExc_ValueError, "EngramHasher: not made");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OnnO|i", &o_tok, &B, &C, &o_out, &threads)) {
        return NULL;
    }
    Buf b[2];
    memset(b, 0, sizeof b);
    if (rc_buf_get(o_tok, &b[0], 8, 0, "tokens") || rc_buf_get(o_out, &b[1], 8, 1, "out")) {
        rc_buf_release(b, 2);
        return NULL;
    }
    const int64_t *tok = b[0].view.buf;
    Py_ssize_t n_tok = COUNT(b[0]), W = 0, T = 0;
    const char *bad = NULL;
    if (B < 1 || n_tok % B) {
        bad = "tokens is not [B, W] for the given B";
    } else {
        W = n_tok / B;
        T = W - C;
        if (C < self->N - 1 || T < 0) {
            bad = "ctx must be in max_ngram - 1..W (the look-back of the first position)";
        } else if (COUNT(b[1]) != self->L * B * T * self->K) {
            bad = "out is not [L, B, W - ctx, (N - 1) * heads]";
        }
    }
    if (bad) {
        rc_buf_release(b, 2);
        PyErr_Format(PyExc_ValueError, "engram_hash: %s", bad);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_tok; i++) {
        if ((uint64_t)tok[i] >= (uint64_t)self->V) {
            long long v = (long long)tok[i];
            rc_buf_release(b, 2);
            PyErr_Format(PyExc_ValueError,
                         "engram_hash: tokens[%zd, %zd] = %lld is outside the vocabulary [0, %zd)",
                         i / W, i % W, v, self->V);
            return NULL;
        }
    }
    Py_ssize_t positions = B * T;
    EngramJob job[MAXT];
    int P = rc_split_count(threads, positions * self->L * self->K, EH_GRAIN);
    for (int k = 0; k < P; k++) {
        job[k] = (EngramJob){self, tok, b[1].view.buf, B, W, C, T, positions * k / P,
                             positions * (k + 1) / P};
    }
    if (positions > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc_pool_parallel(P, engram_positions, (char *)job, sizeof job[0]);
        Py_END_ALLOW_THREADS
    }
    rc_buf_release(b, 2);
    Py_RETURN_NONE;
}

static PyMethodDef hasher_methods[] = {
    {"hash", (PyCFunction)hasher_hash, METH_VARARGS,
     "hash(tokens i64[B, W], B, ctx, out i64[L, B, W - ctx, K][, threads]): every layer's head ids."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject rc_EngramHasherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "rowcache.kernels._host.EngramHasher",
    .tp_basicsize = sizeof(EngramHasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "EngramHasher(lookup, mult, primes, heads): Engram's hash over one vocabulary, "
              "its multipliers and primes (checked and copied once).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hasher_init,
    .tp_dealloc = (destructor)hasher_dealloc,
    .tp_methods = hasher_methods,
};
