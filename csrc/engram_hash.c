/* csrc/engram_hash.c: EngramHasher of rowcache.kernels._host, the multiply-XOR-heads hash
 * of DeepSeek Engram and of Qwen3.8-Flash-Next (qwen4_exp): one kernel for both families.
 *
 * The row ids of every layer at every position of a batch: each token is mapped through the
 * token map, the layer's n-gram mix is (x[t] * m0) XOR (x[t-1] * m1) XOR ... in 64 bits
 * (the multipliers keep every product below 2**63: no product wraps), and head h of order n
 * reads mix_n mod p[layer][n][h], plus the head's first row where offsets were given. The
 * first positions of a sequence read their look-back from the context a call is given (the
 * sequences' tokens before these), else pad. What differs between the families is a
 * parameter of the hasher, fixed when it is made:
 *   token map     Engram: its compressed vocabulary's lookup; Qwen4: the identity (None);
 *   multipliers   [L, N], primes [L, (N - 1) * H] (the moduli), offsets (Qwen4's global
 *                 rows; Engram's ids are head-local);
 *   context rule  Engram: none beyond the look-back above; Qwen4 (eos >= 0): a source
 *                 position at or before the last EOS strictly before t reads EOS
 *                 (docs/qwen4-spec.md), as one before the sequence's start does (pad = EOS).
 * Bit-exact with rowcache.embed.engram.hash.hash_reference (docs/engram-spec.md sections 1
 * and 4) and rowcache.embed.qwen4.hash.hash_reference.
 *
 * The token map, the multipliers, the primes and the offsets are handed over once, to an
 * EngramHasher made with them (checked and copied then: the lookup as uint32, the primes
 * with their reciprocals), so that a call passes only tokens and out and costs O(tokens).
 *
 * Nearly all the work is the reductions: (N - 1) * H a position and layer. The heads of one
 * order share their mix, so a vector holds consecutive heads, each lane its own prime, and
 * the mix broadcast: q = round(mix * (1 / p)) in doubles is floor(mix / p) or one more (its
 * error is below 8192 / p <= 0.25 for p >= 2**15, under any rounding mode), and
 * mix - q * p in exact 64-bit integers, plus p where negative, is the remainder. Three
 * paths; the hasher takes one when it is made (its `path` says which):
 *   "avx512"  AVX-512 F and DQ, 8 heads a vector;
 *   "avx2"    AVX2, 4 heads a vector;
 *   "scalar"  a Barrett reduction with a 128-bit product where the compiler has one (else
 *             the % operator), any prime: where neither vector path runs, or a prime is
 *             below 2**15.
 * The extension is built for baseline x86-64 (no -march): the vector paths are compiled
 * per function (target attributes) and chosen by __builtin_cpu_supports at run time: AVX2
 * where the CPU has it, not AVX-512. On the H200 machine's Xeon the AVX-512 path was the
 * fastest at prefill (7.5 against 12.4 ns a token a layer) but the slowest at decode (57
 * against 37 at the V4.1 shape, a call too short for it), and the process's other code ran
 * up to 1.6x slower beside it (the core's clock drops while it runs 512-bit work): a server's
 * host thread pays that at every step. AVX2 meets the ~50 ns target at every shape there.
 * ROWCACHE_ENGRAM_HASH=scalar|avx2|avx512, read when a hasher is made,
 * forces one (the tests and bench/engram_hash.py compare each with the reference). Each
 * order's primes are padded to a multiple of 8 heads in the hasher's tables, so a vector
 * load never reads past them; lanes past H are never stored.
 *
 * The work goes a block of EH_BLOCK positions at a time (a block may span sequences, as a
 * decode step's one token each does): the block's compressed tokens are looked up first, all
 * loads independent, so that misses in the vocabulary's table (512 KiB for DeepSeek's)
 * overlap; then, layer by layer, each order's mixes over the block (loops the path's target
 * vectorizes), and each order's heads over the block with their primes held in registers,
 * writing the ids of a position's order as one contiguous run. A large call is split over
 * the step's pool (csrc/pool.c), each thread a run of positions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engram_hash.h"
#include "pool.h"
#include "pybuf.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define EH_X86 1
#include <immintrin.h>
#else
#define EH_X86 0
#endif

#define MAXN 16                               /* max_ngram at most */
#define EH_GRAIN 2048                         /* ids a thread at least */
#define EH_LANES 8                            /* the widest vector's heads: the tables' padding */
#define EH_BLOCK 64 /* positions a pass: their ids looked up together, their mixes kept */
#define EH_VECTOR_MIN_PRIME ((uint64_t)1 << 15) /* the vector paths' quotient error < 1/2 */
#define EH_ENV "ROWCACHE_ENGRAM_HASH"

enum { EH_SCALAR, EH_AVX2, EH_AVX512, EH_PATHS };
static const char *const eh_path_name[EH_PATHS] = {"scalar", "avx2", "avx512"};

typedef struct {
    PyObject_HEAD
    uint32_t *lookup; /* [V] compressed ids; NULL: the identity map (Qwen4's raw tokens) */
    uint64_t *mult;   /* [L, N] */
    uint64_t *primes; /* [L, N - 1, HP]: each order's heads, padded with its last prime */
    uint64_t *recip;  /* [L, N - 1, HP]: floor((2**64 - 1) / p) (Barrett: the scalar path) */
    double *inv;      /* [L, N - 1, HP]: 1 / p (the vector paths) */
    uint64_t *off;    /* [L, N - 1, HP]: each head's first row, added; NULL: none (Engram) */
    int64_t eos;      /* the segment rule's separator (Qwen4); -1: no segments (Engram) */
    Py_ssize_t V, L, N, H, HP, K;
    int path; /* EH_SCALAR, EH_AVX2 or EH_AVX512 */
    int made;
} EngramHasher;

typedef struct {
    const EngramHasher *e;
    const int64_t *tok; /* [B, T] */
    const int64_t *ctx; /* [B, C]: the tokens before each sequence's first; NULL: none */
    int64_t *out;       /* [L, B, T, K] */
    int64_t pad;        /* the token read before a sequence's start */
    Py_ssize_t B, T, C;
    Py_ssize_t p0, p1; /* this part's positions (b * T + t) */
} EngramJob;

/* One order of one layer over a block's n positions: o[i * K + h] = mix[i] mod the order's
 * prime h, for h < H (`at`: the order's first entry in the tables; mixd[i]: mix[i] as a
 * double, for the vector paths). */
typedef void (*OrderFn)(int64_t *o, Py_ssize_t K, const uint64_t *mix, const double *mixd,
                        Py_ssize_t n, const EngramHasher *e, Py_ssize_t at);

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

static void order_scalar(int64_t *o, Py_ssize_t K, const uint64_t *mix, const double *mixd,
                         Py_ssize_t n, const EngramHasher *e, Py_ssize_t at) {
    const uint64_t *p = e->primes + at, *rc = e->recip + at;
    const Py_ssize_t H = e->H; /* not reloaded after each store */
    (void)mixd;
    if (e->off) {
        const uint64_t *off = e->off + at;
        for (Py_ssize_t i = 0; i < n; i++, o += K) {
            const uint64_t x = mix[i];
            for (Py_ssize_t h = 0; h < H; h++) {
                o[h] = (int64_t)(off[h] + mod_prime(x, p[h], rc[h]));
            }
        }
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++, o += K) {
        const uint64_t x = mix[i];
        for (Py_ssize_t h = 0; h < H; h++) {
            o[h] = (int64_t)mod_prime(x, p[h], rc[h]);
        }
    }
}

#if EH_X86
/* AVX2 has no 64-bit multiply, no double <-> int64 conversion and no 64-bit unsigned min:
 * q comes out of round(mix / p) + 2**52 as the double's low mantissa bits (q < 2**49), and
 * q * p mod 2**64 from three 32 x 32 -> 64-bit products (q < 2**32 or p < 2**32, so the
 * high halves' product is 0); r + p where r's sign bit is set is a blend on that bit. */
__attribute__((target("avx2"))) static inline __m256i mod4(const uint64_t *mix,
                                                           const double *mixd, __m256i p,
                                                           __m256i p_hi, __m256d inv) {
    const __m256d two52 = _mm256_set1_pd(4503599627370496.0);
    const __m256d qd = _mm256_round_pd(_mm256_mul_pd(_mm256_broadcast_sd(mixd), inv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i q = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(qd, two52)),
                                       _mm256_castpd_si256(two52));
    const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(q, 32), p),
                                           _mm256_mul_epu32(q, p_hi));
    const __m256i qp = _mm256_add_epi64(_mm256_mul_epu32(q, p), _mm256_slli_epi64(cross, 32));
    const __m256i r = _mm256_sub_epi64(_mm256_set1_epi64x((long long)*mix), qp); /* [-p, p) */
    return _mm256_castpd_si256(_mm256_blendv_pd(_mm256_castsi256_pd(r),
                                                _mm256_castsi256_pd(_mm256_add_epi64(r, p)),
                                                _mm256_castsi256_pd(r)));
}

__attribute__((target("avx2"))) static void order_avx2(int64_t *o, Py_ssize_t K,
                                                       const uint64_t *mix, const double *mixd,
                                                       Py_ssize_t n, const EngramHasher *e,
                                                       Py_ssize_t at) {
    for (Py_ssize_t h = 0; h < e->H; h += 4) {
        const __m256i p = _mm256_loadu_si256((const __m256i *)(e->primes + at + h));
        const __m256i p_hi = _mm256_srli_epi64(p, 32);
        const __m256d inv = _mm256_loadu_pd(e->inv + at + h);
        const Py_ssize_t left = e->H - h;
        if (e->off) { /* each head's first row added (Qwen4's global rows) */
            const __m256i off = _mm256_loadu_si256((const __m256i *)(e->off + at + h));
            const __m256i lanes = _mm256_cmpgt_epi64(_mm256_set1_epi64x(left),
                                                     _mm256_set_epi64x(3, 2, 1, 0));
            for (Py_ssize_t i = 0; i < n; i++) {
                const __m256i r = _mm256_add_epi64(mod4(mix + i, mixd + i, p, p_hi, inv), off);
                if (left >= 4) {
                    _mm256_storeu_si256((__m256i *)(o + i * K + h), r);
                } else {
                    _mm256_maskstore_epi64((long long *)(o + i * K + h), lanes, r);
                }
            }
        } else if (left >= 4) {
            for (Py_ssize_t i = 0; i < n; i++) {
                _mm256_storeu_si256((__m256i *)(o + i * K + h),
                                    mod4(mix + i, mixd + i, p, p_hi, inv));
            }
        } else {
            const __m256i lanes = _mm256_cmpgt_epi64(_mm256_set1_epi64x(left),
                                                     _mm256_set_epi64x(3, 2, 1, 0));
            for (Py_ssize_t i = 0; i < n; i++) {
                _mm256_maskstore_epi64((long long *)(o + i * K + h), lanes,
                                       mod4(mix + i, mixd + i, p, p_hi, inv));
            }
        }
    }
}

__attribute__((target("avx512f,avx512dq"))) static inline __m512i mod8(const uint64_t *mix,
                                                                       const double *mixd,
                                                                       __m512i p, __m512d inv) {
    const __m512i q = _mm512_cvt_roundpd_epi64(_mm512_mul_pd(_mm512_set1_pd(*mixd), inv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i r = _mm512_sub_epi64(_mm512_set1_epi64((long long)*mix),
                                       _mm512_mullo_epi64(q, p)); /* in [-p, p) */
    return _mm512_min_epu64(r, _mm512_add_epi64(r, p));          /* r + p where r < 0 */
}

__attribute__((target("avx512f,avx512dq"))) static void order_avx512(
    int64_t *o, Py_ssize_t K, const uint64_t *mix, const double *mixd, Py_ssize_t n,
    const EngramHasher *e, Py_ssize_t at) {
    for (Py_ssize_t h = 0; h < e->H; h += 8) {
        const __m512i p = _mm512_loadu_si512(e->primes + at + h);
        const __m512d inv = _mm512_loadu_pd(e->inv + at + h);
        const Py_ssize_t left = e->H - h;
        if (e->off) { /* each head's first row added (Qwen4's global rows) */
            const __m512i off = _mm512_loadu_si512(e->off + at + h);
            const __mmask8 lanes = (__mmask8)(left >= 8 ? 0xff : (1u << left) - 1);
            for (Py_ssize_t i = 0; i < n; i++) {
                _mm512_mask_storeu_epi64(o + i * K + h, lanes,
                                         _mm512_add_epi64(mod8(mix + i, mixd + i, p, inv), off));
            }
        } else if (left >= 8) {
            for (Py_ssize_t i = 0; i < n; i++) {
                _mm512_storeu_si512(o + i * K + h, mod8(mix + i, mixd + i, p, inv));
            }
        } else {
            const __mmask8 lanes = (__mmask8)((1u << left) - 1);
            for (Py_ssize_t i = 0; i < n; i++) {
                _mm512_mask_storeu_epi64(o + i * K + h, lanes, mod8(mix + i, mixd + i, p, inv));
            }
        }
    }
}

#endif

/* The mapped id of token `tok` (the vocabulary's compressed id, or the token itself where
 * the map is the identity). The call checked every token with the GIL held; the caller's
 * arrays are read in place with it released, so a token another thread changed since reads
 * id 0 instead of outside the table. `ident` is a constant where this is inlined. */
static inline __attribute__((always_inline)) uint64_t eh_map(const EngramHasher *e, int ident,
                                                             int64_t tok) {
    const int64_t t = (uint64_t)tok < (uint64_t)e->V ? tok : 0;
    return ident ? (uint64_t)t : e->lookup[t];
}

/* x[k][i] = the mapped token k back from position pos + i, for the n positions from pos
 * (which may span sequences: decode's one token each): its own sequence's token, else its
 * context's last, else pad. With the segment rule (`seg`, Qwen4's), a token k >= 2 back
 * reads eos where the one k - 1 back did: so a source at or before the last EOS strictly
 * before the position reads EOS (the one at the EOS is EOS itself). Within one sequence past
 * the look-back and without segments, each token is mapped once (x[k] points into one
 * window); else each position's N tokens are (a decode step's, one token a sequence after
 * a context as long as the look-back, without the tests of where each source lies). `seg` and `ident` are constants in each of
 * the four copies eh_lookback chooses from, so that the loops carry no test of them. */
static inline __attribute__((always_inline)) void eh_lookback_as(
    const EngramJob *j, Py_ssize_t pos, Py_ssize_t n, uint64_t win[MAXN + EH_BLOCK],
    uint64_t each[MAXN][EH_BLOCK], const uint64_t *x[MAXN], int seg, int ident) {
    const EngramHasher *e = j->e;
    const Py_ssize_t N = e->N, T = j->T, C = j->C, look = N - 1;
    const int64_t eos = e->eos;
    Py_ssize_t b = pos / T, t = pos % T;
    if (t >= look && t + n <= T) {
        const int64_t *row = j->tok + pos - look;
        if (!seg) {
            for (Py_ssize_t i = 0; i < n + look; i++) {
                win[i] = eh_map(e, ident, row[i]);
            }
            for (Py_ssize_t k = 0; k < N; k++) {
                x[k] = win + look - k;
            }
            return;
        }
        int64_t cur[EH_BLOCK]; /* the raw token k back, or eos past a segment's start */
        for (Py_ssize_t i = 0; i < n; i++) {
            each[0][i] = eh_map(e, ident, row[look + i]);
            cur[i] = row[look + i - 1];
            each[1][i] = eh_map(e, ident, cur[i]);
        }
        for (Py_ssize_t k = 2; k < N; k++) {
            for (Py_ssize_t i = 0; i < n; i++) {
                cur[i] = cur[i] == eos ? eos : row[look + i - k];
                each[k][i] = eh_map(e, ident, cur[i]);
            }
        }
    } else if (T == 1 && C >= look) { /* decode: each sequence's token after its context */
        const int64_t *end = j->ctx + (pos + 1) * C; /* past sequence pos's context */
        for (Py_ssize_t i = 0; i < n; i++, end += C) {
            int64_t prev = j->tok[pos + i];
            each[0][i] = eh_map(e, ident, prev);
            for (Py_ssize_t k = 1; k < N; k++) {
                const int64_t tok = seg && k >= 2 && prev == eos ? eos : end[-k];
                prev = tok;
                each[k][i] = eh_map(e, ident, tok);
            }
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t *row = j->tok + b * T, *ctx = j->ctx ? j->ctx + b * C : NULL;
            int64_t prev = 0;
            for (Py_ssize_t k = 0; k < N; k++) {
                const Py_ssize_t s = t - k; /* < 0: the context's column C + s, else pad */
                int64_t tok = s >= 0 ? row[s] : (C + s >= 0 && ctx) ? ctx[C + s] : j->pad;
                if (seg && k >= 2 && prev == eos) {
                    tok = eos;
                }
                prev = tok;
                each[k][i] = eh_map(e, ident, tok);
            }
            if (++t == T) {
                t = 0;
                b++;
            }
        }
    }
    for (Py_ssize_t k = 0; k < N; k++) {
        x[k] = each[k];
    }
}

static void eh_lookback(const EngramJob *j, Py_ssize_t pos, Py_ssize_t n,
                        uint64_t win[MAXN + EH_BLOCK], uint64_t each[MAXN][EH_BLOCK],
                        const uint64_t *x[MAXN]) {
    const int seg = j->e->eos >= 0, ident = j->e->lookup == NULL;
    if (!seg && !ident) {
        eh_lookback_as(j, pos, n, win, each, x, 0, 0); /* Engram's */
    } else if (seg && ident) {
        eh_lookback_as(j, pos, n, win, each, x, 1, 1); /* Qwen4's */
    } else if (seg) {
        eh_lookback_as(j, pos, n, win, each, x, 1, 0);
    } else {
        eh_lookback_as(j, pos, n, win, each, x, 0, 1);
    }
}

/* The positions of one part, a block at a time: their compressed tokens (eh_lookback), then
 * layer by layer, every order's mixes over the block and `order` over each order's heads.
 * Inlined into one function a path (below), so that its loops over the block are compiled
 * for that path's target (vectorized there). */
static inline __attribute__((always_inline)) void eh_positions(const EngramJob *j,
                                                               OrderFn order) {
    const EngramHasher *e = j->e;
    const Py_ssize_t N = e->N, H = e->H, HP = e->HP, K = e->K, look = N - 1;
    const Py_ssize_t layer_stride = j->B * j->T * K;
    uint64_t win[MAXN + EH_BLOCK], each[MAXN][EH_BLOCK], mix[MAXN - 1][EH_BLOCK];
    double mixd[MAXN - 1][EH_BLOCK];
    const uint64_t *x[MAXN];
    for (Py_ssize_t pos = j->p0; pos < j->p1;) {
        const Py_ssize_t n = j->p1 - pos < EH_BLOCK ? j->p1 - pos : EH_BLOCK;
        eh_lookback(j, pos, n, win, each, x);
        for (Py_ssize_t l = 0; l < e->L; l++) {
            const uint64_t *m = e->mult + l * N;
            const uint64_t *x0 = x[0], *x1 = x[1], m0 = m[0], m1 = m[1];
            for (Py_ssize_t i = 0; i < n; i++) { /* order 2 */
                mix[0][i] = (x0[i] * m0) ^ (x1[i] * m1);
            }
            for (Py_ssize_t k = 2; k < N; k++) { /* order k + 1 */
                const uint64_t *xk = x[k], mk = m[k];
                for (Py_ssize_t i = 0; i < n; i++) {
                    mix[k - 1][i] = mix[k - 2][i] ^ (xk[i] * mk);
                }
            }
            for (Py_ssize_t k = 0; k < look; k++) {
                for (Py_ssize_t i = 0; i < n; i++) {
                    mixd[k][i] = (double)(int64_t)mix[k][i];
                }
            }
            int64_t *o = j->out + l * layer_stride + pos * K;
            for (Py_ssize_t k = 0; k < look; k++) {
                order(o + k * H, K, mix[k], mixd[k], n, e, (l * look + k) * HP);
            }
        }
        pos += n;
    }
}

static void *run_scalar(void *arg) {
    eh_positions(arg, order_scalar);
    return NULL;
}

#if EH_X86
__attribute__((target("avx2"))) static void *run_avx2(void *arg) {
    eh_positions(arg, order_avx2);
    return NULL;
}

__attribute__((target("avx512f,avx512dq"))) static void *run_avx512(void *arg) {
    eh_positions(arg, order_avx512);
    return NULL;
}

static void *(*const eh_run[EH_PATHS])(void *) = {run_scalar, run_avx2, run_avx512};
#else
static void *(*const eh_run[EH_PATHS])(void *) = {run_scalar, NULL, NULL};
#endif

/* Whether this CPU (and its OS's saved state) runs `path`. */
static int eh_cpu_has(int path) {
#if EH_X86
    __builtin_cpu_init();
    if (path == EH_AVX2) {
        return __builtin_cpu_supports("avx2");
    }
    if (path == EH_AVX512) {
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    }
#endif
    return path == EH_SCALAR;
}

/* The path a hasher whose smallest prime is `low` takes: ROWCACHE_ENGRAM_HASH's, else AVX2
 * where this CPU runs it (AVX-512 only when asked: the header says why), else scalar; -1
 * with a ValueError set where the one asked for cannot run. */
static int eh_choose_path(uint64_t low) {
    const char *want = getenv(EH_ENV);
    if (want == NULL || want[0] == '\0') {
        if (low < EH_VECTOR_MIN_PRIME) {
            return EH_SCALAR;
        }
        return eh_cpu_has(EH_AVX2) ? EH_AVX2 : EH_SCALAR;
    }
    for (int path = 0; path < EH_PATHS; path++) {
        if (strcmp(want, eh_path_name[path]) != 0) {
            continue;
        }
        if (!eh_cpu_has(path)) {
            PyErr_Format(PyExc_ValueError, "EngramHasher: %s=%s, but this CPU lacks it", EH_ENV,
                         want);
            return -1;
        }
        if (path != EH_SCALAR && low < EH_VECTOR_MIN_PRIME) {
            PyErr_Format(PyExc_ValueError,
                         "EngramHasher: %s=%s, but a prime is %llu: the vector paths need "
                         "primes >= %llu (scalar takes any)",
                         EH_ENV, want, (unsigned long long)low,
                         (unsigned long long)EH_VECTOR_MIN_PRIME);
            return -1;
        }
        return path;
    }
    PyErr_Format(PyExc_ValueError, "EngramHasher: %s=%s: give scalar, avx2 or avx512 (or unset)",
                 EH_ENV, want);
    return -1;
}

static void eh_free_tables(EngramHasher *self) {
    PyMem_Free(self->lookup);
    PyMem_Free(self->mult);
    PyMem_Free(self->primes);
    PyMem_Free(self->recip);
    PyMem_Free(self->inv);
    PyMem_Free(self->off);
    self->lookup = NULL;
    self->mult = self->primes = self->recip = self->off = NULL;
    self->inv = NULL;
    self->made = 0;
}

static void hasher_dealloc(EngramHasher *self) {
    eh_free_tables(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* EngramHasher(lookup i64[V] or None, mult i64[L, N], primes i64[L, K], heads,
 *              offsets=None (i64[L, K]), eos=-1, vocab=0)
 * lookup None: the identity map over vocab token ids (then vocab >= 1 is required). */
static int hasher_init(EngramHasher *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"lookup", "mult", "primes", "heads", "offsets", "eos", "vocab", NULL};
    PyObject *o_lookup, *o_mult, *o_primes, *o_off = Py_None;
    Py_ssize_t H, vocab = 0;
    long long eos = -1;
    if (self->made) {
        PyErr_SetString(PyExc_TypeError, "EngramHasher: already made");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOn|OLn", kwlist, &o_lookup, &o_mult,
                                     &o_primes, &H, &o_off, &eos, &vocab)) {
        return -1;
    }
    const int ident = o_lookup == Py_None;
    Buf b[4];
    memset(b, 0, sizeof b);
    if ((!ident && rc_buf_get(o_lookup, &b[0], 8, 0, "lookup")) ||
        rc_buf_get(o_mult, &b[1], 8, 0, "mult") || rc_buf_get(o_primes, &b[2], 8, 0, "primes") ||
        (o_off != Py_None && rc_buf_get(o_off, &b[3], 8, 0, "offsets"))) {
        rc_buf_release(b, 4);
        return -1;
    }
    const int64_t *lookup = ident ? NULL : b[0].view.buf, *mult = b[1].view.buf,
                  *primes = b[2].view.buf, *offs = o_off != Py_None ? b[3].view.buf : NULL;
    Py_ssize_t V = ident ? vocab : COUNT(b[0]), n_mult = COUNT(b[1]), n_pr = COUNT(b[2]);
    Py_ssize_t L = 0, N = 0, K = 0;
    const char *bad = NULL;
    int64_t top = ident ? V - 1 : 0; /* the largest mapped id */
    if (H < 1 || H > 4096) {
        bad = "heads must be in 1..4096";
    } else if (!ident && vocab != 0) {
        bad = "vocab is for the identity map (lookup None) only";
    } else if (V < 1 || V > INT32_MAX) {
        bad = ident ? "vocab must be 1..2**31 - 1 token ids"
                    : "lookup must hold 1..2**31 - 1 token ids";
    } else if (eos < -1 || eos >= V) {
        bad = "eos must be a token id in [0, V), or -1 (no segments)";
    } else if (n_pr == 0 || n_pr % H) {
        bad = "primes is not [L, (N - 1) * heads]";
    } else if (offs && COUNT(b[3]) != n_pr) {
        bad = "offsets is not [L, (N - 1) * heads], as primes";
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
    for (Py_ssize_t i = 0; !bad && lookup && i < V; i++) {
        if (lookup[i] < 0 || lookup[i] >= V) {
            bad = "lookup maps into [0, V)";
        } else if (lookup[i] > top) {
            top = lookup[i];
        }
    }
    for (Py_ssize_t i = 0; !bad && i < n_mult; i++) {
        if (mult[i] < 1 || mult[i] > INT64_MAX / (top + 1)) {
            bad = "every multiplier must lie in [1, 2**63 / mapped ids): a product would wrap";
        }
    }
    for (Py_ssize_t i = 0; !bad && i < n_pr; i++) {
        if (primes[i] < 2 || primes[i] > ((int64_t)1 << 62)) {
            bad = "every prime must lie in [2, 2**62]";
        } else if (offs && (offs[i] < 0 || offs[i] > ((int64_t)1 << 62))) {
            bad = "every offset must lie in [0, 2**62]";
        }
    }
    if (bad) {
        rc_buf_release(b, 4);
        PyErr_Format(PyExc_ValueError, "EngramHasher: %s", bad);
        return -1;
    }
    const Py_ssize_t HP = (H + EH_LANES - 1) / EH_LANES * EH_LANES, n_tab = L * (N - 1) * HP;
    uint64_t low = UINT64_MAX; /* the smallest prime: whether the vector paths hold */
    for (Py_ssize_t i = 0; i < n_pr; i++) {
        low = (uint64_t)primes[i] < low ? (uint64_t)primes[i] : low;
    }
    const int path = eh_choose_path(low);
    if (path < 0) {
        rc_buf_release(b, 4);
        return -1;
    }
    self->lookup = ident ? NULL : PyMem_Malloc((size_t)V * sizeof *self->lookup);
    self->mult = PyMem_Malloc((size_t)n_mult * sizeof *self->mult);
    self->primes = PyMem_Malloc((size_t)n_tab * sizeof *self->primes);
    self->recip = PyMem_Malloc((size_t)n_tab * sizeof *self->recip);
    self->inv = PyMem_Malloc((size_t)n_tab * sizeof *self->inv);
    self->off = offs ? PyMem_Malloc((size_t)n_tab * sizeof *self->off) : NULL;
    if ((!ident && !self->lookup) || !self->mult || !self->primes || !self->recip ||
        !self->inv || (offs && !self->off)) {
        rc_buf_release(b, 4);
        eh_free_tables(self); /* not made: the next init may try again */
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; lookup && i < V; i++) {
        self->lookup[i] = (uint32_t)lookup[i];
    }
    for (Py_ssize_t i = 0; i < n_mult; i++) {
        self->mult[i] = (uint64_t)mult[i];
    }
    for (Py_ssize_t i = 0; i < n_tab; i++) { /* order i / HP, head i % HP (past H: the last) */
        const Py_ssize_t h = i % HP < H ? i % HP : H - 1;
        const uint64_t p = (uint64_t)primes[i / HP * H + h];
        self->primes[i] = p;
        self->recip[i] = UINT64_MAX / p;
        self->inv[i] = 1.0 / (double)p;
        if (self->off) {
            self->off[i] = (uint64_t)offs[i / HP * H + h];
        }
    }
    self->V = V;
    self->L = L;
    self->N = N;
    self->H = H;
    self->HP = HP;
    self->K = K;
    self->eos = eos;
    self->path = path;
    self->made = 1;
    rc_buf_release(b, 4);
    return 0;
}

/* The first of `n` tokens at `tok` outside [0, V), or -1. */
static Py_ssize_t eh_first_outside(const int64_t *tok, Py_ssize_t n, Py_ssize_t V) {
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* no early exit: this loop vectorizes */
        bad |= (uint64_t)tok[i] >= (uint64_t)V;
    }
    for (Py_ssize_t i = 0; bad && i < n; i++) {
        if ((uint64_t)tok[i] >= (uint64_t)V) {
            return i;
        }
    }
    return -1;
}

/* Takes tokens, out and context (None: b[2] not held) into b[0..2]; 0, or -1 with an
 * exception set and every buffer released. */
static int eh_get_args(Buf b[3], PyObject *o_tok, PyObject *o_ctx, PyObject *o_out) {
    memset(b, 0, 3 * sizeof *b);
    if (rc_buf_get(o_tok, &b[0], 8, 0, "tokens") || rc_buf_get(o_out, &b[1], 8, 1, "out") ||
        (o_ctx != Py_None && rc_buf_get(o_ctx, &b[2], 8, 0, "context"))) {
        rc_buf_release(b, 3);
        return -1;
    }
    return 0;
}

/* The call itself, on the buffers eh_get_args took (released here, on every path).
 * Position t of a sequence reads the max_ngram - 1 tokens before it: its own, else its
 * context's last, else pad (with the segment rule where eos >= 0). Every token read must lie
 * in [0, V) (checked before any id is written). */
static PyObject *eh_hash_bufs(EngramHasher *self, Buf b[3], Py_ssize_t B, long long pad,
                              int threads) {
    const int64_t *tok = b[0].view.buf, *ctx = b[2].held ? b[2].view.buf : NULL;
    const Py_ssize_t n_tok = COUNT(b[0]), n_ctx = ctx ? COUNT(b[2]) : 0;
    Py_ssize_t T = 0, C = 0;
    const char *bad = NULL;
    if (B < 1 || n_tok % B) {
        bad = "tokens is not [B, T] for the given B";
    } else if (n_ctx % B) {
        bad = "context is not [B, C] for the given B";
    } else if ((uint64_t)pad >= (uint64_t)self->V) {
        bad = "pad is outside the vocabulary";
    } else {
        T = n_tok / B;
        C = n_ctx / B;
        if (COUNT(b[1]) != self->L * B * T * self->K) {
            bad = "out is not [L, B, T, (N - 1) * heads]";
        }
    }
    if (bad) {
        rc_buf_release(b, 3);
        PyErr_Format(PyExc_ValueError, "engram_hash: %s", bad);
        return NULL;
    }
    Py_ssize_t at = eh_first_outside(tok, n_tok, self->V);
    const Py_ssize_t read = C < self->N - 1 ? C : self->N - 1; /* context columns read */
    /* all of them (a decode step's kept look-back): one pass; else a row at a time */
    const Py_ssize_t rows = read == C ? 1 : B, span = read == C ? B * C : read;
    for (Py_ssize_t i = 0; at < 0 && T > 0 && i < rows; i++) {
        const Py_ssize_t k = eh_first_outside(ctx + i * C + C - read, span, self->V);
        if (k >= 0) {
            const Py_ssize_t ci = i * C + C - read + k; /* its index in ctx */
            long long v = (long long)ctx[ci];
            rc_buf_release(b, 3);
            PyErr_Format(PyExc_ValueError,
                         "engram_hash: context[%zd, %zd] = %lld is outside the vocabulary [0, %zd)",
                         ci / C, ci % C, v, self->V);
            return NULL;
        }
    }
    if (at >= 0) {
        long long v = (long long)tok[at];
        rc_buf_release(b, 3);
        PyErr_Format(PyExc_ValueError,
                     "engram_hash: tokens[%zd, %zd] = %lld is outside the vocabulary [0, %zd)",
                     at / T, at % T, v, self->V);
        return NULL;
    }
    const Py_ssize_t positions = B * T;
    EngramJob job[MAXT];
    const int P = rc_split_count(threads, positions * self->L * self->K, EH_GRAIN);
    for (int k = 0; k < P; k++) {
        job[k] = (EngramJob){self, tok, ctx, b[1].view.buf, (int64_t)pad, B, T, C,
                             positions * k / P, positions * (k + 1) / P};
    }
    if (positions > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc_pool_parallel(P, eh_run[self->path], (char *)job, sizeof job[0]);
        Py_END_ALLOW_THREADS
    }
    rc_buf_release(b, 3);
    Py_RETURN_NONE;
}

/* hasher.hash(tokens i64[B, T], B, context i64[B, C] or None, pad, out i64[L, B, T, K]
 *             [, threads]) -> None: the arrays' sizes checked, not their shapes. */
static PyObject *hasher_hash(EngramHasher *self, PyObject *args) {
    PyObject *o_tok, *o_ctx, *o_out;
    Py_ssize_t B;
    long long pad;
    int threads = 1;
    if (!self->made) {
        PyErr_SetString(PyExc_ValueError, "EngramHasher: not made");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OnOLO|i", &o_tok, &B, &o_ctx, &pad, &o_out, &threads)) {
        return NULL;
    }
    Buf b[3];
    if (eh_get_args(b, o_tok, o_ctx, o_out)) {
        return NULL;
    }
    return eh_hash_bufs(self, b, B, pad, threads);
}

/* Whether a buffer holds signed 64-bit integers (a NumPy int64 array's "l" or "q"). */
static int eh_is_i64(const Buf *b) {
    const char *f = b->view.format ? b->view.format : "B";
    if (*f == '@' || *f == '=' || (PY_LITTLE_ENDIAN && *f == '<')) {
        f++;
    }
    return (f[0] == 'l' || f[0] == 'q') && f[1] == '\0' && b->view.itemsize == 8;
}

/* hasher.rows(tokens i64[B, T], context i64[B, C] or None, pad, out i64[B, T, K] (one
 *             layer) or [L, B, T, K] [, threads]) -> None
 * hash with every shape and dtype checked here (a TypeError names what is wrong; the tokens'
 * values as hash checks them), so that a wrapper passes a server's arrays straight through:
 * a decode step's call, where the wrapper's own checks cost as much as the hash. */
static PyObject *hasher_rows(EngramHasher *self, PyObject *args) {
    PyObject *o_tok, *o_ctx, *o_out;
    long long pad;
    int threads = 1;
    if (!self->made) {
        PyErr_SetString(PyExc_ValueError, "EngramHasher: not made");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOLO|i", &o_tok, &o_ctx, &pad, &o_out, &threads)) {
        return NULL;
    }
    Buf b[3];
    if (eh_get_args(b, o_tok, o_ctx, o_out)) {
        return NULL;
    }
    const Py_buffer *t = &b[0].view, *c = &b[2].view, *o = &b[1].view;
    const char *bad = NULL;
    if (!eh_is_i64(&b[0]) || t->ndim != 2) {
        bad = "tokens must be an int64 array [B, T]";
    } else if (b[2].held && (!eh_is_i64(&b[2]) || c->ndim != 2 || c->shape[0] != t->shape[0])) {
        bad = "context must be an int64 array [B, C], one row a sequence";
    } else if (!eh_is_i64(&b[1])) {
        bad = "out must be an int64 array";
    } else {
        const Py_ssize_t want[4] = {self->L, t->shape[0], t->shape[1], self->K};
        const int lead = o->ndim == 3 && self->L == 1 ? 1 : 0; /* [B, T, K]: no L */
        if (o->ndim != 4 - lead) {
            bad = "out must be [L, B, T, K] ([B, T, K] for one layer)";
        }
        for (int d = 0; !bad && d < o->ndim; d++) {
            if (o->shape[d] != want[d + lead]) {
                bad = "out must be [L, B, T, K] ([B, T, K] for one layer)";
            }
        }
    }
    if (bad) {
        rc_buf_release(b, 3);
        PyErr_Format(PyExc_TypeError, "EngramHasher.rows: %s", bad);
        return NULL;
    }
    return eh_hash_bufs(self, b, t->shape[0], pad, threads);
}

static PyObject *hasher_path(EngramHasher *self, void *closure) {
    (void)closure;
    if (!self->made) {
        PyErr_SetString(PyExc_ValueError, "EngramHasher: not made");
        return NULL;
    }
    return PyUnicode_FromString(eh_path_name[self->path]);
}

static PyGetSetDef hasher_getset[] = {
    {"path", (getter)hasher_path, NULL,
     "the reduction this hasher runs: 'avx512', 'avx2' or 'scalar' (csrc/engram_hash.c)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef hasher_methods[] = {
    {"rows", (PyCFunction)hasher_rows, METH_VARARGS,
     "rows(tokens i64[B, T], context i64[B, C] or None, pad, out i64[B, T, K] or [L, B, T, K]"
     "[, threads]): hash with the shapes and dtypes checked (TypeError)."},
    {"hash", (PyCFunction)hasher_hash, METH_VARARGS,
     "hash(tokens i64[B, T], B, context i64[B, C] or None, pad, out i64[L, B, T, K][, threads]): "
     "every layer's head ids."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject rc_EngramHasherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "rowcache.kernels._host.EngramHasher",
    .tp_basicsize = sizeof(EngramHasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "EngramHasher(lookup, mult, primes, heads, offsets=None, eos=-1, vocab=0): the "
              "multiply-XOR-heads hash of Engram (lookup: its compressed vocabulary) and Qwen4 "
              "(lookup None: raw tokens over vocab ids; offsets: global rows; eos: its segment "
              "rule), its tables checked and copied once.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hasher_init,
    .tp_dealloc = (destructor)hasher_dealloc,
    .tp_methods = hasher_methods,
    .tp_getset = hasher_getset,
};
