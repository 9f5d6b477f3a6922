// Row gathers of the embedding tables, launched by kernels/gather.py and specified
// by kernels/reference.py (batched_embed_reference, batched_embed_fp8_reference,
// batched_embed_fp8_table_scale_reference, batched_embed_fp8_block_reference):
//   gather_rows_*:     out[r, :] = table[ids[r], :]                      (bf16 bytes)
//   gather_rows_fp8_*: out[r, :] = bf16_rn(float(e4m3(codes[ids[r], :])) * scales[ids[r]])
//   gather_rows_fp8ts_*: out[r, :] = bf16_rn(bf16(e4m3(codes[ids[r], :])) * scale), one bf16
//                      scale for the table; a NaN result is written as 0x7FC0
//   gather_rows_fp8blk_*: out[r, j] = bf16_rn(bf16(e4m3(codes[ids[r], j])) * 2**(e - 127)),
//                      e = scales[ids[r], j / block] (one UE8M0 byte a block; 255 is NaN);
//                      a NaN result is written as 0x7FC0
// Ids are trusted to lie in [0, rows): the launcher documents it, the CPU path checks.
//
// Layout: a block is (TX, TY) threads; each of its TY rows of threads (a "team")
// copies one output row at a time, TX threads striding over the row's words, and
// the teams of the whole grid stride over the batch. Words are V-sized vectors
// (16, 8, 4 or 2 bytes): the launcher picks the widest V that divides the row bytes,
// both row strides and both base pointers. All strides are in units of V.
// The table may live in pinned host memory mapped into the device (unified
// addressing makes its pointer valid here); nothing below assumes device memory.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

template <typename V, typename I>
__device__ __forceinline__ void gather_rows(const V* __restrict__ table,
                                            const I* __restrict__ ids,
                                            V* __restrict__ out,
                                            long long n,
                                            long long words,
                                            long long table_stride,
                                            long long out_stride) {
    const long long step = (long long)gridDim.x * blockDim.y;
    for (long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; r < n; r += step) {
        const V* src = table + (long long)ids[r] * table_stride;
        V* dst = out + r * out_stride;
        for (long long w = threadIdx.x; w < words; w += blockDim.x) {
            dst[w] = src[w];
        }
    }
}

#define GATHER_ROWS(NAME, V, I)                                                         \
    extern "C" __global__ void NAME(const V* __restrict__ table,                        \
                                    const I* __restrict__ ids,                          \
                                    V* __restrict__ out,                                \
                                    long long n,                                        \
                                    long long words,                                    \
                                    long long table_stride,                             \
                                    long long out_stride) {                             \
        gather_rows<V, I>(table, ids, out, n, words, table_stride, out_stride);         \
    }

GATHER_ROWS(gather_rows_16_i32, uint4, int)
GATHER_ROWS(gather_rows_16_i64, uint4, long long)
GATHER_ROWS(gather_rows_8_i32, uint2, int)
GATHER_ROWS(gather_rows_8_i64, uint2, long long)
GATHER_ROWS(gather_rows_4_i32, unsigned int, int)
GATHER_ROWS(gather_rows_4_i64, unsigned int, long long)
GATHER_ROWS(gather_rows_2_i32, unsigned short, int)
GATHER_ROWS(gather_rows_2_i64, unsigned short, long long)

// ---------------------------------------------------------------------------------
// FP8 (E4M3) gather with dequantization. VEC codes are loaded as one word (In) and
// VEC bf16 results stored as one word (Out); the launcher picks VEC in {8, 4, 2, 1}
// from the alignment of dim, the strides and the pointers. Strides: codes_stride in
// bytes, out_stride in bf16 elements, scales_stride in floats.

template <int VEC>
struct Fp8Words;
template <>
struct Fp8Words<8> {
    typedef uint2 In;
    typedef uint4 Out;
};
template <>
struct Fp8Words<4> {
    typedef unsigned int In;
    typedef uint2 Out;
};
template <>
struct Fp8Words<2> {
    typedef unsigned short In;
    typedef unsigned int Out;
};
template <>
struct Fp8Words<1> {
    typedef unsigned char In;
    typedef unsigned short Out;
};

// E4M3 -> half is exact (every E4M3 value is a half) and half -> float is exact,
// so this is the exact value of the code; NaN codes (0x7f, 0xff) are outside the
// bit-exact contract.
__device__ __forceinline__ float e4m3_to_float(unsigned char code) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(__half(h));
}

template <int VEC, typename I>
__device__ __forceinline__ void gather_rows_fp8(const unsigned char* __restrict__ codes,
                                                const float* __restrict__ scales,
                                                const I* __restrict__ ids,
                                                __nv_bfloat16* __restrict__ out,
                                                long long n,
                                                long long dim,
                                                long long codes_stride,
                                                long long scales_stride,
                                                long long out_stride) {
    typedef typename Fp8Words<VEC>::In In;
    typedef typename Fp8Words<VEC>::Out Out;
    const long long chunks = dim / VEC;
    const long long step = (long long)gridDim.x * blockDim.y;
    for (long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; r < n; r += step) {
        const long long id = (long long)ids[r];
        const float s = scales[id * scales_stride];
        const In* src = reinterpret_cast<const In*>(codes + id * codes_stride);
        Out* dst = reinterpret_cast<Out*>(out + r * out_stride);
        for (long long c = threadIdx.x; c < chunks; c += blockDim.x) {
            union {
                In word;
                unsigned char b[VEC];
            } in;
            union {
                Out word;
                unsigned short h[VEC];
            } res;
            in.word = src[c];
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                // One multiply, rounded once to float, then once to bf16 (RN-even):
                // the reference's float32 product followed by astype(bfloat16).
                const float v = e4m3_to_float(in.b[k]) * s;
                res.h[k] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
            }
            dst[c] = res.word;
        }
    }
}

#define GATHER_ROWS_FP8(NAME, VEC, I)                                                   \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ codes,            \
                                    const float* __restrict__ scales,                   \
                                    const I* __restrict__ ids,                          \
                                    __nv_bfloat16* __restrict__ out,                    \
                                    long long n,                                        \
                                    long long dim,                                      \
                                    long long codes_stride,                             \
                                    long long scales_stride,                            \
                                    long long out_stride) {                             \
        gather_rows_fp8<VEC, I>(codes, scales, ids, out, n, dim, codes_stride,          \
                                scales_stride, out_stride);                             \
    }

GATHER_ROWS_FP8(gather_rows_fp8_8_i32, 8, int)
GATHER_ROWS_FP8(gather_rows_fp8_8_i64, 8, long long)
GATHER_ROWS_FP8(gather_rows_fp8_4_i32, 4, int)
GATHER_ROWS_FP8(gather_rows_fp8_4_i64, 4, long long)
GATHER_ROWS_FP8(gather_rows_fp8_2_i32, 2, int)
GATHER_ROWS_FP8(gather_rows_fp8_2_i64, 2, long long)
GATHER_ROWS_FP8(gather_rows_fp8_1_i32, 1, int)
GATHER_ROWS_FP8(gather_rows_fp8_1_i64, 1, long long)

// ---------------------------------------------------------------------------------
// E4M3 codes with ONE bf16 scale for the whole table (the fp8_table_scale codec):
// out = bf16_rn(bf16(code) * scale). The code converts exactly to bf16 (at most 4
// significant bits, exponents inside bf16's range) and __hmul rounds the exact product
// of two bf16 values once to bf16, nearest even, subnormal results kept (mul.bf16 /
// fma.rn.bf16 have no flush), which is the float32 product (exact) rounded to bf16 of
// the reference. A NaN (NaN code 0x7f/0xff, NaN scale, 0 * Inf) is written as 0x7FC0,
// the reference's canonical NaN, so NaN outputs are bit-exact too. The scale arrives
// as its bf16 bits in an unsigned int.

// VEC E4M3 codes times one bf16 scale ``s``, each bf16_rn(bf16(code) * s) (the rule of
// both bf16-scaled codecs below), a NaN written as 0x7FC0.
template <int VEC>
__device__ __forceinline__ typename Fp8Words<VEC>::Out fp8_word_times_bf16(
    typename Fp8Words<VEC>::In word, __nv_bfloat16 s) {
    union {
        typename Fp8Words<VEC>::In word;
        unsigned char b[VEC];
    } in;
    union {
        typename Fp8Words<VEC>::Out word;
        unsigned short h[VEC];
    } res;
    in.word = word;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const __nv_bfloat16 code = __float2bfloat16_rn(e4m3_to_float(in.b[k]));
        const __nv_bfloat16 p = __hmul(code, s);
        res.h[k] = __hisnan(p) ? (unsigned short)0x7FC0 : __bfloat16_as_ushort(p);
    }
    return res.word;
}

template <int VEC, typename I>
__device__ __forceinline__ void gather_rows_fp8ts(const unsigned char* __restrict__ codes,
                                                  unsigned int scale_bits,
                                                  const I* __restrict__ ids,
                                                  __nv_bfloat16* __restrict__ out,
                                                  long long n,
                                                  long long dim,
                                                  long long codes_stride,
                                                  long long out_stride) {
    typedef typename Fp8Words<VEC>::In In;
    typedef typename Fp8Words<VEC>::Out Out;
    const __nv_bfloat16 s = __ushort_as_bfloat16((unsigned short)(scale_bits & 0xffffu));
    const long long chunks = dim / VEC;
    const long long step = (long long)gridDim.x * blockDim.y;
    for (long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; r < n; r += step) {
        const long long id = (long long)ids[r];
        const In* src = reinterpret_cast<const In*>(codes + id * codes_stride);
        Out* dst = reinterpret_cast<Out*>(out + r * out_stride);
        for (long long c = threadIdx.x; c < chunks; c += blockDim.x) {
            dst[c] = fp8_word_times_bf16<VEC>(src[c], s);
        }
    }
}

#define GATHER_ROWS_FP8TS(NAME, VEC, I)                                                 \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ codes,            \
                                    unsigned int scale_bits,                            \
                                    const I* __restrict__ ids,                          \
                                    __nv_bfloat16* __restrict__ out,                    \
                                    long long n,                                        \
                                    long long dim,                                      \
                                    long long codes_stride,                             \
                                    long long out_stride) {                             \
        gather_rows_fp8ts<VEC, I>(codes, scale_bits, ids, out, n, dim, codes_stride,    \
                                  out_stride);                                          \
    }

GATHER_ROWS_FP8TS(gather_rows_fp8ts_8_i32, 8, int)
GATHER_ROWS_FP8TS(gather_rows_fp8ts_8_i64, 8, long long)
GATHER_ROWS_FP8TS(gather_rows_fp8ts_4_i32, 4, int)
GATHER_ROWS_FP8TS(gather_rows_fp8ts_4_i64, 4, long long)
GATHER_ROWS_FP8TS(gather_rows_fp8ts_2_i32, 2, int)
GATHER_ROWS_FP8TS(gather_rows_fp8ts_2_i64, 2, long long)
GATHER_ROWS_FP8TS(gather_rows_fp8ts_1_i32, 1, int)
GATHER_ROWS_FP8TS(gather_rows_fp8ts_1_i64, 1, long long)

// ---------------------------------------------------------------------------------
// E4M3 codes with one UE8M0 scale byte a block of `block` values (the fp8_block_e8m0
// codec, DeepSeek-V4.1's Engram tables): out = bf16_rn(bf16(code) * 2**(e - 127)). The
// scale is made as a bf16 value, exactly: 2**(e - 127) for e in 1..254 is the bf16 of
// exponent field e and mantissa 0 (bits e << 7); e = 0 is 2**-127, the bf16 subnormal
// 0x0040; e = 255 is the UE8M0 NaN (OCP MX), a NaN scale (0x7FC0) that makes its block
// NaN. Then, as gather_rows_fp8ts: __hmul rounds the exact product of two bf16 values
// once, nearest even, subnormal operands and results kept (mul.bf16 / fma.rn.bf16 have no
// flush; a float32 multiply here would flush the subnormal 2**-127 on these GPUs), which
// is the reference's exact float32 product rounded to bf16. A NaN is written as 0x7FC0.
// Codes and scales are two arrays (strides in bytes): a cache's arena passes the two
// parts of its records (codes at byte 0, scales at byte dim of each slot's row), a
// resident table its two tensors. VEC divides block, so a word's codes share one scale.

__device__ __forceinline__ __nv_bfloat16 e8m0_to_bf16(unsigned char e) {
    const unsigned short bits = e == 0 ? (unsigned short)0x0040
                                : e == 255 ? (unsigned short)0x7FC0
                                : (unsigned short)((unsigned short)e << 7);
    return __ushort_as_bfloat16(bits);
}

template <int VEC, typename I>
__device__ __forceinline__ void gather_rows_fp8blk(const unsigned char* __restrict__ codes,
                                                   const unsigned char* __restrict__ scales,
                                                   const I* __restrict__ ids,
                                                   __nv_bfloat16* __restrict__ out,
                                                   long long n,
                                                   long long dim,
                                                   long long words_per_block,
                                                   long long codes_stride,
                                                   long long scales_stride,
                                                   long long out_stride) {
    typedef typename Fp8Words<VEC>::In In;
    typedef typename Fp8Words<VEC>::Out Out;
    const long long chunks = dim / VEC;
    const long long step = (long long)gridDim.x * blockDim.y;
    for (long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; r < n; r += step) {
        const long long id = (long long)ids[r];
        const In* src = reinterpret_cast<const In*>(codes + id * codes_stride);
        const unsigned char* exps = scales + id * scales_stride;
        Out* dst = reinterpret_cast<Out*>(out + r * out_stride);
        for (long long c = threadIdx.x; c < chunks; c += blockDim.x) {
            const __nv_bfloat16 s = e8m0_to_bf16(exps[c / words_per_block]);
            dst[c] = fp8_word_times_bf16<VEC>(src[c], s);
        }
    }
}

#define GATHER_ROWS_FP8BLK(NAME, VEC, I)                                                \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ codes,            \
                                    const unsigned char* __restrict__ scales,           \
                                    const I* __restrict__ ids,                          \
                                    __nv_bfloat16* __restrict__ out,                    \
                                    long long n,                                        \
                                    long long dim,                                      \
                                    long long words_per_block,                          \
                                    long long codes_stride,                             \
                                    long long scales_stride,                            \
                                    long long out_stride) {                             \
        gather_rows_fp8blk<VEC, I>(codes, scales, ids, out, n, dim, words_per_block,    \
                                   codes_stride, scales_stride, out_stride);            \
    }

GATHER_ROWS_FP8BLK(gather_rows_fp8blk_8_i32, 8, int)
GATHER_ROWS_FP8BLK(gather_rows_fp8blk_8_i64, 8, long long)
GATHER_ROWS_FP8BLK(gather_rows_fp8blk_4_i32, 4, int)
GATHER_ROWS_FP8BLK(gather_rows_fp8blk_4_i64, 4, long long)
GATHER_ROWS_FP8BLK(gather_rows_fp8blk_2_i32, 2, int)
GATHER_ROWS_FP8BLK(gather_rows_fp8blk_2_i64, 2, long long)
GATHER_ROWS_FP8BLK(gather_rows_fp8blk_1_i32, 1, int)
GATHER_ROWS_FP8BLK(gather_rows_fp8blk_1_i64, 1, long long)
