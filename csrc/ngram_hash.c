/* csrc/ngram_hash.c: hash_packed of rowcache.kernels._host, the packed host hash.
 *
 * LongCat n-gram ids of the embedded positions of a packed batch (docs/ngram-spec.md), with
 * an optional per-table offset added (global ids of a shared arena). Tokens come checked
 * (rowcache.embed.ngram.batch.NgramBatch checks them once). Bit-exact with
 * rowcache.embed.ngram.batch.hash_positions. A large call is split over the step's pool
 * (csrc/pool.c), each thread a run of tables.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "ngram_hash.h"
#include "pool.h"
#include "pybuf.h"

typedef struct {
    const int64_t *tok, *ctx, *seq, *mult, *rows, *off;
    int64_t *out;
    Py_ssize_t S, N, n, T;
    long long eos;
    Py_ssize_t t0, t1; /* this part's tables */
} HashJob;

#define HASH_GRAIN 4096 /* ids (positions x tables) a hash_packed thread at least */

/* The ids of tables [t0, t1) at every embedded position. */
static void *hash_tables(void *arg) {
    const HashJob *h = arg;
    const int64_t *tok = h->tok, *ctx = h->ctx, *seq = h->seq, *mult = h->mult, *rows = h->rows;
    const int64_t *off = h->off;
    int64_t *out = h->out;
    Py_ssize_t S = h->S, N = h->N, n = h->n;
    long long eos = h->eos;
    Py_ssize_t begin = 0, r = 0;
    int64_t xs[16];
    for (Py_ssize_t s = 0; s < S; s++) {
        for (Py_ssize_t t = begin + ctx[s] - seq[s]; t < begin + ctx[s]; t++, r++) {
            /* j = 0 always counts; j >= 1 until the sequence start or an EOS in t-j..t-1 */
            xs[0] = tok[t];
            int live = 1;
            for (Py_ssize_t j = 1; j < N; j++) {
                if (live && (t - j < begin || tok[t - j] == eos)) {
                    live = 0; /* an EOS at t-j (or the start) stops terms >= j */
                }
                xs[j] = live ? tok[t - j] : 0;
            }
            for (Py_ssize_t i = h->t0; i < h->t1; i++) {
                int64_t acc = 0;
                const int64_t *m = mult + i * N;
                for (Py_ssize_t j = 0; j < N; j++) {
                    acc += m[j] * xs[j];
                }
                acc %= rows[i];
                out[i * n + r] = off ? acc + off[i] : acc;
            }
        }
        begin += ctx[s];
    }
    return NULL;
}

/* hash_packed(tokens i64[L], ctx_lens i64[S], seq_lens i64[S], mult i64[T, N],
 *             rows i64[T], N, offsets i64[T] | None, eos, out i64[T, n][, threads]) -> None
 * threads (default 1): the tables are split into up to that many runs (each at least
 * HASH_GRAIN ids), hashed in parallel. */
PyObject *rc_hash_packed(PyObject *self, PyObject *args) {
    PyObject *o_tok, *o_ctx, *o_seq, *o_mult, *o_rows, *o_off, *o_out;
    long long eos;
    Py_ssize_t N;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOnOLO|i", &o_tok, &o_ctx, &o_seq, &o_mult, &o_rows, &N,
                          &o_off, &eos, &o_out, &threads)) {
        return NULL;
    }
    Buf b[7];
    memset(b, 0, sizeof b);
    int has_off = o_off != Py_None;
    if (rc_buf_get(o_tok, &b[0], 8, 0, "tokens") || rc_buf_get(o_ctx, &b[1], 8, 0, "ctx_lens") ||
        rc_buf_get(o_seq, &b[2], 8, 0, "seq_lens") || rc_buf_get(o_mult, &b[3], 8, 0, "mult") ||
        rc_buf_get(o_rows, &b[4], 8, 0, "rows") ||
        (has_off && rc_buf_get(o_off, &b[5], 8, 0, "offsets")) ||
        rc_buf_get(o_out, &b[6], 8, 1, "out")) {
        rc_buf_release(b, 7);
        return NULL;
    }
    const int64_t *tok = b[0].view.buf, *ctx = b[1].view.buf, *seq = b[2].view.buf;
    const int64_t *mult = b[3].view.buf, *rows = b[4].view.buf;
    const int64_t *off = has_off ? b[5].view.buf : NULL;
    int64_t *out = b[6].view.buf;
    Py_ssize_t L = COUNT(b[0]), S = COUNT(b[1]), T = COUNT(b[4]);
    if (COUNT(b[2]) != S || N < 1 || N > 16 || COUNT(b[3]) != T * N ||
        (has_off && COUNT(b[5]) != T)) {
        rc_buf_release(b, 7);
        PyErr_SetString(PyExc_ValueError, "hash_packed: inconsistent shapes");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < T; i++) { /* ids are taken mod rows[i]: 0 would trap */
        if (rows[i] < 1) {
            rc_buf_release(b, 7);
            PyErr_Format(PyExc_ValueError, "hash_packed: rows[%zd] = %lld; every table has >= 1 row",
                         i, (long long)rows[i]);
            return NULL;
        }
    }
    Py_ssize_t n = 0, total = 0;
    for (Py_ssize_t s = 0; s < S; s++) {
        /* each length checked against what is left of tokens: no sum can wrap around */
        if (ctx[s] < 0 || seq[s] < 0 || seq[s] > ctx[s] || ctx[s] > L - total) {
            rc_buf_release(b, 7);
            PyErr_SetString(PyExc_ValueError,
                            "hash_packed: bad ctx_lens/seq_lens (each 0 <= seq_len <= ctx_len, "
                            "the contexts' lengths summing to len(tokens))");
            return NULL;
        }
        n += seq[s];
        total += ctx[s];
    }
    if (total != L || COUNT(b[6]) != T * n) {
        rc_buf_release(b, 7);
        PyErr_SetString(PyExc_ValueError, "hash_packed: lengths do not match tokens/out");
        return NULL;
    }
    HashJob job[MAXT];
    int K = rc_split_count(threads < T ? threads : (int)T, n * T, HASH_GRAIN);
    for (int k = 0; k < K; k++) {
        job[k] = (HashJob){tok, ctx, seq, mult, rows, off, out, S, N, n, T, eos,
                           T * k / K, T * (k + 1) / K};
    }
    Py_BEGIN_ALLOW_THREADS
    rc_pool_parallel(K, hash_tables, (char *)job, sizeof job[0]);
    Py_END_ALLOW_THREADS
    rc_buf_release(b, 7);
    Py_RETURN_NONE;
}
