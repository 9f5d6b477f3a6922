// N-gram embedding kernels: the LongCat hash of every (table, position) and the gather
// of every table's row into one stacked [n, T*d] buffer (the final scaled sum of the
// word row and the projected n-gram rows is rowcache/kernels/gemm.cu).
// Their launchers and NumPy references (the specification) are in kernels/ngram.py (the
// hash, hash + gather) and kernels/stacked.py (the stacked gather, copy_from_mapped).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

// E4M3 code -> float, exactly (every E4M3 value is a half), as rowcache/kernels/gather.cu does.
__device__ __forceinline__ float ngram_e4m3_to_float(unsigned char code) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(__half(h));
}

// The id of position t in one table: (sum_j xt(t - j) * m[j]) mod rows, with
// xt(t) = tokens[t], and for j >= 1 xt(t - j) = tokens[t - j] while t - j >= first
// and no EOS lies in positions t - j .. t - 1 (else 0 and the look-back stops).
// m[j] = V^j mod rows for j < the table's order, 0 beyond: every term fits int64.
__device__ __forceinline__ long long ngram_id(const long long* __restrict__ tokens, long long t,
                                              long long first, const long long* __restrict__ m,
                                              int N, long long eos, long long rows) {
    long long acc = tokens[t] * m[0];
    for (int j = 1; j < N; ++j) {
        long long p = t - j;
        if (p < first) break;
        long long x = tokens[p];
        if (x == eos) break;
        acc += x * m[j];
    }
    return acc % rows;
}

// out[i * L + t] = ngram_id of table i at position t (mult[i, :] its multipliers).
// With has_starts, the look-back of t also stops before starts[t] (the first position
// of t's sequence when several sequences are hashed in one launch).
extern "C" __global__ void ngram_hash(const long long* __restrict__ tokens,
                                      const long long* __restrict__ starts,
                                      const long long* __restrict__ mult,
                                      const long long* __restrict__ rows,
                                      long long* __restrict__ out,
                                      long long L, int T, int N, long long eos,
                                      int has_starts, long long vocab,
                                      long long* __restrict__ bad) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * L) return;
    int i = (int)(idx / L);
    long long t = idx - (long long)i * L;
    if (vocab > 0) {
        // Range check fused in (bad[0] starts at L): the launcher reads bad[0] and
        // raises, naming the first bad position, before anything uses these ids.
        long long x0 = tokens[t];
        if (x0 < 0 || x0 >= vocab) {
            if (i == 0) atomicMin((unsigned long long*)bad, (unsigned long long)t);
            out[idx] = 0;
            return;
        }
    }
    out[idx] = ngram_id(tokens, t, has_starts ? starts[t] : 0, mult + (long long)i * N, N, eos,
                        rows[i]);
}

// Elements c0 .. c0 + d of row `row` of one table into dst[0:d), by the threads of one
// threadIdx.y row (c0 a multiple of 8 when vec): bf16 rows
// (scales == 0) copied, FP8 E4M3 codes dequantized as bf16_rn(float(e4m3(code)) *
// scale[row]) -- the rules of gather_rows / gather_rows_fp8 (rowcache/kernels/gather.cu), bit for
// bit. data and scales are raw pointers; stride is in elements (bf16) or bytes (codes).
// With vec, 8 values move per thread step (16-byte bf16 words, 8-byte code words).
__device__ __forceinline__ void ngram_copy_row(unsigned long long data, unsigned long long scales,
                                               long long stride, long long row,
                                               __nv_bfloat16* __restrict__ dst, int d, int vec,
                                               int c0 = 0) {
    const float* sc = reinterpret_cast<const float*>(scales);
    if (sc == nullptr) {
        const __nv_bfloat16* src =
            reinterpret_cast<const __nv_bfloat16*>(data) + row * stride + c0;
        if (vec) {
            const uint4* s4 = reinterpret_cast<const uint4*>(src);
            uint4* d4 = reinterpret_cast<uint4*>(dst);
            for (int c = threadIdx.x; c < d / 8; c += blockDim.x) d4[c] = s4[c];
        } else {
            for (int c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c];
        }
        return;
    }
    const unsigned char* src = reinterpret_cast<const unsigned char*>(data) + row * stride + c0;
    const float s = sc[row];
    if (vec) {
        for (int c = threadIdx.x; c < d / 8; c += blockDim.x) {
            const uint2 q8 = reinterpret_cast<const uint2*>(src)[c];
            const unsigned char* q = reinterpret_cast<const unsigned char*>(&q8);
            __align__(16) __nv_bfloat16 v[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = __float2bfloat16_rn(ngram_e4m3_to_float(q[k]) * s);
            reinterpret_cast<uint4*>(dst)[c] = *reinterpret_cast<const uint4*>(v);
        }
    } else {
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            dst[c] = __float2bfloat16_rn(ngram_e4m3_to_float(src[c]) * s);
        }
    }
}

// Stacked gather: out[r, i*d : (i+1)*d] = row ids[i*ld + off + r] of table i, for every
// output row r < n and table i < T (data[i], scales[i], stride[i]: ngram_copy_row's
// arguments of table i; device memory or mapped pinned host memory). Block (32, 8):
// each threadIdx.y row handles one (r, i) pair (the launcher checks alignment for vec).
extern "C" __global__ void ngram_gather_stacked(const long long* __restrict__ ids,
                                                long long ld, long long off,
                                                const unsigned long long* __restrict__ data,
                                                const unsigned long long* __restrict__ scales,
                                                const long long* __restrict__ stride,
                                                __nv_bfloat16* __restrict__ out,
                                                long long n, int T, int d, int vec) {
    const long long pairs = n * T;
    const long long step = (long long)gridDim.x * blockDim.y;
    for (long long pair = (long long)blockIdx.x * blockDim.y + threadIdx.y; pair < pairs;
         pair += step) {
        const int i = (int)(pair % T);
        const long long r = pair / T;
        const long long row = ids[(long long)i * ld + off + r];
        ngram_copy_row(data[i], scales[i], stride[i], row,
                       out + r * ((long long)T * d) + (long long)i * d, d, vec);
    }
}

// The row to read for id `id` of a table: the id itself (map == 0: a resident table),
// or its slot in a row cache's arena (-1 when not resident).
__device__ __forceinline__ long long ngram_lookup(unsigned long long map, long long off,
                                                  long long id) {
    if (map == 0ULL) return id;
    return (long long)reinterpret_cast<const int*>(map)[off + id];
}

// The tokens of a hash + gather launch, packed: one int64 array, output row r embeds
// position t = positions[r] (has_starts) or off + r, whose look-back stops at
// starts[t] (has_starts) or 0. Tokens are trusted to lie in [0, V) (checked on the
// host): id() and word() never return -1.
struct NgramPackedTokens {
    const long long* __restrict__ tokens;
    const long long* __restrict__ starts;
    const long long* __restrict__ positions;
    long long off;
    int has_starts;
    __device__ __forceinline__ long long pos(long long r) const {
        return has_starts ? positions[r] : off + r;
    }
    __device__ __forceinline__ long long word(long long r) const { return tokens[pos(r)]; }
    __device__ __forceinline__ long long id(long long r, const long long* __restrict__ m, int N,
                                            long long eos, long long rows) const {
        const long long t = pos(r);
        return ngram_id(tokens, t, has_starts ? starts[t] : 0, m, N, eos, rows);
    }
    __device__ __forceinline__ void check_context(long long) const {}
};

// The tokens of a hash + gather launch, as rows: output row r = b * L + l embeds
// ids[b, l], after ctx[b, 0:c] and ids[b, 0:l] (its sequence; strides in elements, any
// layout). Tokens are checked against [0, vocab): a bad one makes id() / word() -1
// (the row is written as zeros) and sets *bad = seq (mapped pinned host memory, read
// by the launcher's caller after the stream's work ran); check_context(r) checks the
// c context tokens of row b once (l == 0), the ones a look-back stopped at an EOS
// never reads included.
struct NgramRowTokens {
    const long long* __restrict__ ids;
    long long is0, is1;
    const long long* __restrict__ ctx;
    long long cs0, cs1;
    long long L;
    int c;
    long long vocab;
    volatile long long* bad;
    long long seq;
    __device__ __forceinline__ long long at(long long b, long long p) const {
        return p >= c ? ids[b * is0 + (p - c) * is1] : ctx[b * cs0 + p * cs1];
    }
    __device__ __forceinline__ bool ok(long long x) const {
        if (x >= 0 && x < vocab) return true;
        *bad = seq;
        return false;
    }
    __device__ __forceinline__ long long word(long long r) const {
        const long long b = r / L;
        const long long x = ids[b * is0 + (r - b * L) * is1];
        return ok(x) ? x : -1;
    }
    __device__ __forceinline__ long long id(long long r, const long long* __restrict__ m, int N,
                                            long long eos, long long rows) const {
        const long long b = r / L;
        const long long t = c + (r - b * L);
        long long x = at(b, t);
        if (!ok(x)) return -1;
        long long acc = x * m[0];
        for (int j = 1; j < N && j <= t; ++j) {
            x = at(b, t - j);
            if (!ok(x)) return -1;
            if (x == eos) break;
            acc += x * m[j];
        }
        return acc % rows;
    }
    __device__ __forceinline__ void check_context(long long r) const {
        const long long b = r / L;
        if (r - b * L != 0) return;
        for (int p = threadIdx.x; p < c; p += blockDim.x) ok(ctx[b * cs0 + p * cs1]);
    }
};

// Hash and gather in one launch (a step's id work without the ids ever written): for
// every output row r and table i < T, out[r, i*d : (i+1)*d] = row tok.id(r) of table
// i, and words[r, 0:D] = row tok.word(r) of the word table (wdata[0], wscales[0],
// wstride[0]). Bit-identical to ngram_hash, the selection of positions,
// ngram_gather_stacked and the word table's gather. Block (32, 8), one work item per
// threadIdx.y row: (r, table i) for i < T, or (r, chunk c) of the word row, cut into W
// chunks of wchunk elements (a multiple of 8) so that no warp copies a whole D-wide
// row alone (a chain of dependent loads: the step's critical path).
// Row caches: where maps[i] (resp. wmap[0]) is not 0 it points at a row cache's device
// row -> slot map (int32, -1: not resident) and the table's data is the cache's arena:
// the row read is slot = map[moff[i] + row] (moff: the table's offset in a shared
// cache); a row that is not resident (or whose tokens were bad, id -1) is written as
// zeros (the caller resolves the rows on the host and runs the step again when that
// faulted).
template <class Tokens>
__device__ __forceinline__ void ngram_hash_gather_body(
    const Tokens& tok, const long long* __restrict__ mult, const long long* __restrict__ rows,
    int N, long long eos, const unsigned long long* __restrict__ data,
    const unsigned long long* __restrict__ scales, const long long* __restrict__ stride,
    __nv_bfloat16* __restrict__ out, long long n, int T, int d, int vec,
    const unsigned long long* __restrict__ wdata, const unsigned long long* __restrict__ wscales,
    const long long* __restrict__ wstride, __nv_bfloat16* __restrict__ words, int D, int wvec,
    int W, int wchunk, const unsigned long long* __restrict__ maps,
    const long long* __restrict__ moff, const unsigned long long* __restrict__ wmap,
    const long long* __restrict__ wmoff) {
    const long long items = n * (T + W);
    const long long step = (long long)gridDim.x * blockDim.y;
    for (long long item = (long long)blockIdx.x * blockDim.y + threadIdx.y; item < items;
         item += step) {
        const int i = (int)(item % (T + W));
        const long long r = item / (T + W);
        if (i >= T) {
            const int c0 = (i - T) * wchunk;
            const int len = min(wchunk, D - c0);
            __nv_bfloat16* dst = words + r * (long long)D + c0;
            if (c0 == 0) tok.check_context(r);
            const long long x = tok.word(r);
            const long long row = x < 0 ? -1 : ngram_lookup(wmap[0], wmoff[0], x);
            if (row < 0) {
                for (int c = threadIdx.x; c < len; c += blockDim.x) dst[c] = __float2bfloat16(0.f);
            } else {
                ngram_copy_row(wdata[0], wscales[0], wstride[0], row, dst, len, wvec, c0);
            }
        } else {
            const long long id = tok.id(r, mult + (long long)i * N, N, eos, rows[i]);
            const long long row = id < 0 ? -1 : ngram_lookup(maps[i], moff[i], id);
            __nv_bfloat16* dst = out + r * ((long long)T * d) + (long long)i * d;
            if (row < 0) {
                for (int c = threadIdx.x; c < d; c += blockDim.x) dst[c] = __float2bfloat16(0.f);
            } else {
                ngram_copy_row(data[i], scales[i], stride[i], row, dst, d, vec);
            }
        }
    }
}

#define NGRAM_HASH_GATHER_TAIL                                                                 \
    const long long *__restrict__ mult, const long long *__restrict__ rows, int N,             \
        long long eos, const unsigned long long *__restrict__ data,                           \
        const unsigned long long *__restrict__ scales, const long long *__restrict__ stride,  \
        __nv_bfloat16 *__restrict__ out, long long n, int T, int d, int vec,                  \
        const unsigned long long *__restrict__ wdata,                                         \
        const unsigned long long *__restrict__ wscales,                                       \
        const long long *__restrict__ wstride, __nv_bfloat16 *__restrict__ words, int D,      \
        int wvec, int W, int wchunk, const unsigned long long *__restrict__ maps,             \
        const long long *__restrict__ moff, const unsigned long long *__restrict__ wmap,      \
        const long long *__restrict__ wmoff
#define NGRAM_HASH_GATHER_ARGS                                                                 \
    mult, rows, N, eos, data, scales, stride, out, n, T, d, vec, wdata, wscales, wstride, words, \
        D, wvec, W, wchunk, maps, moff, wmap, wmoff

// Packed tokens (NgramPackedTokens).
extern "C" __global__ void ngram_hash_gather(const long long* __restrict__ tokens,
                                             const long long* __restrict__ starts,
                                             const long long* __restrict__ positions,
                                             long long off, int has_starts,
                                             NGRAM_HASH_GATHER_TAIL) {
    const NgramPackedTokens tok{tokens, starts, positions, off, has_starts};
    ngram_hash_gather_body(tok, NGRAM_HASH_GATHER_ARGS);
}

// Row tokens (NgramRowTokens): n = B * L output rows.
extern "C" __global__ void ngram_hash_gather_rows(const long long* __restrict__ ids,
                                                  long long is0, long long is1,
                                                  const long long* __restrict__ ctx,
                                                  long long cs0, long long cs1, long long L,
                                                  int c, long long vocab,
                                                  unsigned long long bad, long long seq,
                                                  NGRAM_HASH_GATHER_TAIL) {
    const NgramRowTokens tok{ids, is0, is1, ctx, cs0, cs1, L, c, vocab,
                             reinterpret_cast<volatile long long*>(bad), seq};
    ngram_hash_gather_body(tok, NGRAM_HASH_GATHER_ARGS);
}

// dst[i] = src[i] for i < n int64 words, src in mapped pinned host memory: a step's
// small upload read over PCIe by the kernel (one round trip) instead of a DMA copy,
// whose setup costs ~10 us inside a graph for a few kilobytes (bench/embed_step.py).
extern "C" __global__ void ngram_copy_words(const long long* __restrict__ src,
                                            long long* __restrict__ dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
