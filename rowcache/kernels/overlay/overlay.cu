// Token-overlay kernels: find changed vocab rows (embed_rowdiff), overwrite gathered
// embedding rows with an adapter's rows (embed_overlay_routed), and recompute the
// logits of an adapter's overridden tokens (lmhead_overlay_routed, the GEMM path's
// lmhead_overlay_scatter after a cuBLAS GEMM against all adapters' rows at once, or the
// tensor-core lmhead_overlay_mma over those packed rows).
// Launchers and NumPy references (the specification): kernels/overlay.py.
//
// bf16 values travel as raw 16-bit patterns (unsigned short); a bf16 widens to f32
// exactly by shifting its bits into the high half of a 32-bit word. Per-adapter tables
// arrive as device pointer tables (unsigned long long[L]) plus int32 counts, so a
// decode step passes only seq_slot and the tables can be captured in a CUDA graph.
#include <cuda_bf16.h>

typedef unsigned short bf16_bits;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// A pair of values differs when |a - b| > thresh (f32 subtraction, round to nearest
// even, as NumPy does), or when exactly one of them is NaN.
__device__ __forceinline__ bool differs(float a, float b, float thresh) {
    const float d = fabsf(a - b);
    return (d > thresh) || ((a != a) != (b != b));
}

__device__ __forceinline__ bool differs_word(unsigned int x, unsigned int y, float thresh) {
    return differs(bf16_lo(x), bf16_lo(y), thresh) || differs(bf16_hi(x), bf16_hi(y), thresh);
}

// ---------------------------------------------------------------------------------
// embed_rowdiff(base, served, rows, hidden, thresh, vec, flags)
//   base, served : bf16[rows, hidden] (C-contiguous)
//   flags        : uint8[rows], flags[r] = any_i differs(base[r,i], served[r,i])
//   vec          : 1 when hidden % 8 == 0 and both pointers are 16-byte aligned
// One warp per row (grid-stride over rows); the lanes OR their verdicts by __any_sync.
extern "C" __global__ void embed_rowdiff(const bf16_bits* __restrict__ base,
                                         const bf16_bits* __restrict__ served, long long rows,
                                         int hidden, float thresh, int vec,
                                         unsigned char* __restrict__ flags) {
    const int lane = threadIdx.x & 31;
    const long long warps_per_block = blockDim.x >> 5;
    const long long stride = (long long)gridDim.x * warps_per_block;
    for (long long r = (long long)blockIdx.x * warps_per_block + (threadIdx.x >> 5); r < rows;
         r += stride) {
        const bf16_bits* b = base + r * hidden;
        const bf16_bits* s = served + r * hidden;
        bool hit = false;
        if (vec) {
            for (int k = lane * 8; k < hidden; k += 256) {
                const uint4 bv = __ldg(reinterpret_cast<const uint4*>(b + k));
                const uint4 sv = __ldg(reinterpret_cast<const uint4*>(s + k));
                hit = hit || differs_word(bv.x, sv.x, thresh) || differs_word(bv.y, sv.y, thresh) ||
                      differs_word(bv.z, sv.z, thresh) || differs_word(bv.w, sv.w, thresh);
            }
        } else {
            for (int k = lane; k < hidden; k += 32) {
                const float x = __uint_as_float(((unsigned int)b[k]) << 16);
                const float y = __uint_as_float(((unsigned int)s[k]) << 16);
                hit = hit || differs(x, y, thresh);
            }
        }
        hit = __any_sync(FULL_MASK, hit);
        if (lane == 0) flags[r] = hit ? 1 : 0;
    }
}

// ---------------------------------------------------------------------------------
// embed_overlay_routed_{i32,i64}(ids, seq_slot, active, n_rows, hidden, map_ptrs,
//                                row_ptrs, counts, vocabs, num_adapters, vec, out)
//   ids      : int32 or int64 [n_rows] token ids of the gathered rows
//   seq_slot : int32 [n_rows] adapter slot per row, or nullptr (then every row uses `active`)
//   map_ptrs : u64[num_adapters], adapter s's slot map int32[vocabs[s]] (token -> override
//              index or -1); 0 for an empty adapter
//   row_ptrs : u64[num_adapters], adapter s's override rows bf16[counts[s], hidden]
//   counts, vocabs : int32[num_adapters]
//   out      : bf16[n_rows, hidden], overwritten in place where a row is overridden
//   vec      : 1 when hidden % 8 == 0 and `out` is 16-byte aligned (tables always are)
// One block per row (grid-stride). Row r is left untouched when its slot is < 0 or
// >= num_adapters, its id is < 0 or >= vocabs[s], or the map entry is < 0 or >= counts[s];
// nothing outside those bounds is ever read.
template <typename IdT>
__device__ __forceinline__ void embed_overlay_impl(const IdT* __restrict__ ids,
                                                   const int* __restrict__ seq_slot, int active,
                                                   long long n_rows, int hidden,
                                                   const u64* __restrict__ map_ptrs,
                                                   const u64* __restrict__ row_ptrs,
                                                   const int* __restrict__ counts,
                                                   const int* __restrict__ vocabs, int num_adapters,
                                                   int vec, bf16_bits* __restrict__ out) {
    for (long long r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const int s = seq_slot ? seq_slot[r] : active;
        if (s < 0 || s >= num_adapters) continue;
        const long long id = (long long)ids[r];
        if (id < 0 || id >= (long long)vocabs[s]) continue;
        const int* map = reinterpret_cast<const int*>(map_ptrs[s]);
        const int slot = map[id];
        if (slot < 0 || slot >= counts[s]) continue;
        const bf16_bits* src = reinterpret_cast<const bf16_bits*>(row_ptrs[s]) + (long long)slot * hidden;
        bf16_bits* dst = out + r * hidden;
        if (vec) {
            for (int k = threadIdx.x * 8; k < hidden; k += blockDim.x * 8)
                *reinterpret_cast<uint4*>(dst + k) = __ldg(reinterpret_cast<const uint4*>(src + k));
        } else {
            for (int k = threadIdx.x; k < hidden; k += blockDim.x) dst[k] = src[k];
        }
    }
}

extern "C" __global__ void embed_overlay_routed_i32(
    const int* ids, const int* seq_slot, int active, long long n_rows, int hidden,
    const u64* map_ptrs, const u64* row_ptrs, const int* counts, const int* vocabs,
    int num_adapters, int vec, bf16_bits* out) {
    embed_overlay_impl<int>(ids, seq_slot, active, n_rows, hidden, map_ptrs, row_ptrs, counts,
                            vocabs, num_adapters, vec, out);
}

extern "C" __global__ void embed_overlay_routed_i64(
    const long long* ids, const int* seq_slot, int active, long long n_rows, int hidden,
    const u64* map_ptrs, const u64* row_ptrs, const int* counts, const int* vocabs,
    int num_adapters, int vec, bf16_bits* out) {
    embed_overlay_impl<long long>(ids, seq_slot, active, n_rows, hidden, map_ptrs, row_ptrs,
                                  counts, vocabs, num_adapters, vec, out);
}

// ---------------------------------------------------------------------------------
// lmhead_overlay_routed_{f32,bf16}_j{JB}r{RB}(hidden, seq_slot, active, n_rows, hidden_size,
//                                  id_ptrs, row_ptrs, counts, num_adapters, n_cols, vec, logits)
//   hidden   : bf16[n_rows, hidden_size]
//   seq_slot : int32[n_rows] or nullptr (then every row uses `active`)
//   id_ptrs  : u64[num_adapters], adapter s's overridden token ids int32[counts[s]] (distinct)
//   row_ptrs : u64[num_adapters], adapter s's LM-head rows bf16[counts[s], hidden_size]
//   logits   : f32 or bf16 [n_rows, n_cols], in place:
//              logits[r, ids_s[j]] = round(dot_f32(hidden[r], rows_s[j])) for rows routed to s
//   vec      : 1 when hidden_size % 8 == 0 and `hidden` is 16-byte aligned (tables always are)
// Grid (x: override groups, y: adapter s, z: tiles of LM_ROW_TILE rows); blocks of whole
// warps. Each (row, j) dot product is one warp's: every lane accumulates its strided
// share in f32 (fmaf), then a shuffle tree sums the 32 partial sums. A warp works on
// LM_JB overrides x LM_RB rows at once (the rows of its tile routed to s, found with a
// ballot), so each loaded 16-byte chunk of an override row serves LM_RB dot products and
// each chunk of a hidden row LM_JB: with (4, 4), 4x fewer loads and bf16->f32 conversions
// per FMA than one (row, j) at a time. Ids < 0 or >= n_cols are skipped.
#define LM_ROW_TILE 64

template <typename LogitT>
__device__ __forceinline__ void store_logit(LogitT* p, float v);

template <>
__device__ __forceinline__ void store_logit<float>(float* p, float v) { *p = v; }

template <>
__device__ __forceinline__ void store_logit<bf16_bits>(bf16_bits* p, float v) {
    *p = __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__device__ __forceinline__ void unpack8(const uint4 v, float* f) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x); f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z); f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}

template <typename LogitT, int LM_JB, int LM_RB>
__device__ __forceinline__ void lmhead_overlay_impl(
    const bf16_bits* __restrict__ hidden, const int* __restrict__ seq_slot, int active,
    long long n_rows, int hidden_size, const u64* __restrict__ id_ptrs,
    const u64* __restrict__ row_ptrs, const int* __restrict__ counts, int num_adapters,
    long long n_cols, int vec, LogitT* __restrict__ logits) {
    const int s = blockIdx.y;
    if (s >= num_adapters) return;
    if (seq_slot == nullptr && active != s) return;
    const int count = counts[s];
    if (count <= 0) return;
    const int* ids = reinterpret_cast<const int*>(id_ptrs[s]);
    const bf16_bits* rows = reinterpret_cast<const bf16_bits*>(row_ptrs[s]);
    const int lane = threadIdx.x & 31;
    const int warps_per_block = blockDim.x >> 5;
    const long long row0 = (long long)blockIdx.z * LM_ROW_TILE;

    // Rows of this tile routed to s: bit i of tile_mask[h] is row row0 + 32 h + i. Every
    // lane computes the same masks, so all control flow below is uniform in the warp.
    unsigned int tile_mask[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long r = row0 + 32 * h + lane;
        bool mine = false;
        if (r < n_rows) mine = (seq_slot ? seq_slot[r] : active) == s;
        tile_mask[h] = __ballot_sync(FULL_MASK, mine);
    }
    if ((tile_mask[0] | tile_mask[1]) == 0u) return;

    for (int jb = (blockIdx.x * warps_per_block + (threadIdx.x >> 5)) * LM_JB; jb < count;
         jb += gridDim.x * warps_per_block * LM_JB) {
        // This warp's overrides; slots past `count` repeat the last row and are not stored.
        const bf16_bits* w[LM_JB];
        long long col[LM_JB];
#pragma unroll
        for (int jj = 0; jj < LM_JB; ++jj) {
            const int j = (jb + jj < count) ? jb + jj : count - 1;
            w[jj] = rows + (long long)j * hidden_size;
            col[jj] = (jb + jj < count) ? (long long)ids[j] : -1;
        }
        unsigned int m0 = tile_mask[0], m1 = tile_mask[1];
        while ((m0 | m1) != 0u) {
            // Next LM_RB routed rows; missing ones repeat the first and are not stored.
            const bf16_bits* h[LM_RB];
            long long r[LM_RB];
            bool has[LM_RB];
#pragma unroll
            for (int rr = 0; rr < LM_RB; ++rr) {
                if (m0 != 0u) {
                    r[rr] = row0 + (__ffs(m0) - 1);
                    m0 &= m0 - 1;
                    has[rr] = true;
                } else if (m1 != 0u) {
                    r[rr] = row0 + 32 + (__ffs(m1) - 1);
                    m1 &= m1 - 1;
                    has[rr] = true;
                } else {
                    r[rr] = r[0];
                    has[rr] = false;
                }
                h[rr] = hidden + r[rr] * hidden_size;
            }
            float acc[LM_RB][LM_JB];
#pragma unroll
            for (int rr = 0; rr < LM_RB; ++rr)
#pragma unroll
                for (int jj = 0; jj < LM_JB; ++jj) acc[rr][jj] = 0.0f;
            if (vec) {
                for (int k = lane * 8; k < hidden_size; k += 256) {
                    float wf[LM_JB][8];
#pragma unroll
                    for (int jj = 0; jj < LM_JB; ++jj)
                        unpack8(__ldg(reinterpret_cast<const uint4*>(w[jj] + k)), wf[jj]);
#pragma unroll
                    for (int rr = 0; rr < LM_RB; ++rr) {
                        float hf[8];
                        unpack8(__ldg(reinterpret_cast<const uint4*>(h[rr] + k)), hf);
#pragma unroll
                        for (int jj = 0; jj < LM_JB; ++jj)
#pragma unroll
                            for (int e = 0; e < 8; ++e)
                                acc[rr][jj] = fmaf(hf[e], wf[jj][e], acc[rr][jj]);
                    }
                }
            } else {
                for (int k = lane; k < hidden_size; k += 32) {
                    float wf[LM_JB];
#pragma unroll
                    for (int jj = 0; jj < LM_JB; ++jj)
                        wf[jj] = __uint_as_float(((unsigned int)w[jj][k]) << 16);
#pragma unroll
                    for (int rr = 0; rr < LM_RB; ++rr) {
                        const float hf = __uint_as_float(((unsigned int)h[rr][k]) << 16);
#pragma unroll
                        for (int jj = 0; jj < LM_JB; ++jj)
                            acc[rr][jj] = fmaf(hf, wf[jj], acc[rr][jj]);
                    }
                }
            }
#pragma unroll
            for (int rr = 0; rr < LM_RB; ++rr)
#pragma unroll
                for (int jj = 0; jj < LM_JB; ++jj)
#pragma unroll
                    for (int off = 16; off > 0; off >>= 1)
                        acc[rr][jj] += __shfl_xor_sync(FULL_MASK, acc[rr][jj], off);
            if (lane == 0) {
#pragma unroll
                for (int rr = 0; rr < LM_RB; ++rr)
#pragma unroll
                    for (int jj = 0; jj < LM_JB; ++jj)
                        if (has[rr] && col[jj] >= 0 && col[jj] < n_cols)
                            store_logit<LogitT>(logits + r[rr] * n_cols + col[jj], acc[rr][jj]);
            }
        }
    }
}

// One entry point per (logits dtype, LM_JB, LM_RB); the launcher picks by name. (1, 1) is
// the plain one-warp-per-(row, j) kernel; larger tiles trade registers for fewer loads.
#define LMHEAD_ENTRY(NAME, LT, JB, RB)                                                        \
    extern "C" __global__ void NAME(const bf16_bits* hidden, const int* seq_slot, int active, \
                                    long long n_rows, int hidden_size, const u64* id_ptrs,    \
                                    const u64* row_ptrs, const int* counts, int num_adapters, \
                                    long long n_cols, int vec, LT* logits) {                  \
        lmhead_overlay_impl<LT, JB, RB>(hidden, seq_slot, active, n_rows, hidden_size,        \
                                        id_ptrs, row_ptrs, counts, num_adapters, n_cols, vec, \
                                        logits);                                              \
    }

LMHEAD_ENTRY(lmhead_overlay_routed_f32_j1r1, float, 1, 1)
LMHEAD_ENTRY(lmhead_overlay_routed_f32_j2r2, float, 2, 2)
LMHEAD_ENTRY(lmhead_overlay_routed_f32_j2r4, float, 2, 4)
LMHEAD_ENTRY(lmhead_overlay_routed_f32_j4r4, float, 4, 4)
LMHEAD_ENTRY(lmhead_overlay_routed_bf16_j1r1, bf16_bits, 1, 1)
LMHEAD_ENTRY(lmhead_overlay_routed_bf16_j2r2, bf16_bits, 2, 2)
LMHEAD_ENTRY(lmhead_overlay_routed_bf16_j2r4, bf16_bits, 2, 4)
LMHEAD_ENTRY(lmhead_overlay_routed_bf16_j4r4, bf16_bits, 4, 4)

// ---------------------------------------------------------------------------------
// lmhead_overlay_scatter_{f32,bf16}(p, ldp, seq_slot, active, n_rows, ids_all, bases,
//                                   counts, num_adapters, cap, n_cols, logits)
// The second half of the GEMM path: P = hidden @ R^T was computed by cuBLAS (bf16 in,
// f32 accumulate, f32 out), R being every adapter's LM-head rows concatenated once.
//   p        : f32[n_rows, ldp], P[r, c] = dot(hidden[r], R[c]) for c < cap
//   seq_slot : int32[n_rows] or nullptr (then every row uses `active`)
//   ids_all  : int32[cap], the token id of R's row c (-1 for padding rows)
//   bases    : int32[num_adapters], adapter s's first row in R; counts[s] rows follow
//   logits   : f32 or bf16 [n_rows, n_cols], in place:
//              logits[r, ids_all[bases[s] + j]] = round(P[r, bases[s] + j]), j < counts[s]
// Grid (x: chunks of overrides, y: rows, grid-stride on both); a row reads back only its
// own adapter's columns of P, contiguous, so loads coalesce and the stores scatter. Rows
// whose slot is < 0 or >= num_adapters are untouched; ids < 0 or >= n_cols are skipped;
// nothing at or beyond `cap` is ever read, whatever bases and counts say.
template <typename LogitT>
__device__ __forceinline__ void lmhead_scatter_impl(
    const float* __restrict__ p, long long ldp, const int* __restrict__ seq_slot, int active,
    long long n_rows, const int* __restrict__ ids_all, const int* __restrict__ bases,
    const int* __restrict__ counts, int num_adapters, long long cap, long long n_cols,
    LogitT* __restrict__ logits) {
    for (long long r = blockIdx.y; r < n_rows; r += gridDim.y) {
        const int s = seq_slot ? seq_slot[r] : active;
        if (s < 0 || s >= num_adapters) continue;
        const long long base = bases[s];
        if (base < 0 || base >= cap) continue;
        const long long room = cap - base;
        const long long count = (long long)counts[s] < room ? (long long)counts[s] : room;
        const float* prow = p + r * ldp + base;
        const int* ids = ids_all + base;
        LogitT* lrow = logits + r * n_cols;
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < count;
             j += (long long)gridDim.x * blockDim.x) {
            const long long col = ids[j];
            if (col >= 0 && col < n_cols) store_logit<LogitT>(lrow + col, prow[j]);
        }
    }
}

extern "C" __global__ void lmhead_overlay_scatter_f32(
    const float* p, long long ldp, const int* seq_slot, int active, long long n_rows,
    const int* ids_all, const int* bases, const int* counts, int num_adapters, long long cap,
    long long n_cols, float* logits) {
    lmhead_scatter_impl<float>(p, ldp, seq_slot, active, n_rows, ids_all, bases, counts,
                               num_adapters, cap, n_cols, logits);
}

extern "C" __global__ void lmhead_overlay_scatter_bf16(
    const float* p, long long ldp, const int* seq_slot, int active, long long n_rows,
    const int* ids_all, const int* bases, const int* counts, int num_adapters, long long cap,
    long long n_cols, bf16_bits* logits) {
    lmhead_scatter_impl<bf16_bits>(p, ldp, seq_slot, active, n_rows, ids_all, bases, counts,
                                   num_adapters, cap, n_cols, logits);
}

// ---------------------------------------------------------------------------------
// lmhead_overlay_mma_{f32,bf16}_t{T}w{W}d{D}(hidden, seq_slot, active, n_rows,
//     hidden_size, rows_all, ids_all, tile_adapter, num_tiles, num_adapters, n_cols, vec,
//     logits)
// The tensor-core path: one kernel reads every routed adapter's packed LM-head rows once.
//   hidden       : bf16[n_rows, hidden_size]
//   seq_slot     : int32[n_rows] or nullptr (then every row uses `active`)
//   rows_all     : bf16[16 * num_tiles, hidden_size], every adapter's rows packed so that
//                  each 16-row tile holds one adapter's rows only (padding rows: id -1)
//   ids_all      : int32[16 * num_tiles], the token id of each row of rows_all (-1: padding)
//   tile_adapter : int32[num_tiles], the adapter owning each tile (-1: padding only)
//   logits       : f32 or bf16 [n_rows, n_cols], in place: logits[r, ids_all[c]] =
//                  round(dot_f32(hidden[r], rows_all[c])) for each row r routed to the
//                  adapter s = tile_adapter[c / 16] (0 <= s < num_adapters), skipping ids
//                  < 0 or >= n_cols
//   vec          : 1 when hidden_size % 8 == 0 and hidden, rows_all are 16-byte aligned
// Dynamic shared memory: D * (2T + 4) * 32W * 16 bytes.
// Block b owns tiles T*b .. T*b+T-1, W warps; runs of tiles of one adapter s are handled
// in turn (one run when adapters' blocks are aligned to T tiles). The block compacts the
// rows routed to s (ballots, ascending row order, chunks of 32W rows); for each group of
// up to 32 routed rows the warps split K by k-blocks of 32 columns (warp w takes k-blocks
// w, w + W, ...) and run mma.sync m16n8k16 (bf16 in, f32 accumulate): A = 16 tile rows,
// B = 8 routed hidden rows. Each lane copies the 16-byte chunks it will use itself (rows
// g and g + 8 of each tile and routed row g of each n-group, columns kb + 8t .. + 7) into
// its own shared-memory slots with cp.async, through a ring of D k-blocks: D - 1 k-blocks
// are in flight while one is multiplied, without registers held and without barriers (a
// lane reads only what it copied). The fragment registers are filled from those vectors
// under one permutation of k shared by A and B (a dot product does not care in which
// order k is summed). The warps' partial sums are added by a fixed tree through shared
// memory, so results do not depend on timing, and warp 0 stores them. Nothing is read
// outside the arrays: columns past hidden_size are zeros, absent routed rows are zeros
// and never stored.
#define MMA_GROUP 32  // routed rows per pass (4 mma n-groups of 8)

__device__ __forceinline__ uint4 load_chunk8(const bf16_bits* __restrict__ row, int k, int K,
                                             int vec) {
    if (vec && k + 8 <= K) return __ldg(reinterpret_cast<const uint4*>(row + k));
    unsigned int w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const unsigned int lo = (k + 2 * e < K) ? (unsigned int)__ldg(row + k + 2 * e) : 0u;
        const unsigned int hi = (k + 2 * e + 1 < K) ? (unsigned int)__ldg(row + k + 2 * e + 1) : 0u;
        w[e] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void cp_async16(uint4* smem_dst, const bf16_bits* gmem_src) {
    const unsigned int dst = (unsigned int)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem_src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// d += A (16x16, row) * B (16x8, col); bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float* d, unsigned int a0, unsigned int a1,
                                               unsigned int a2, unsigned int a3,
                                               unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One k-block of 32 columns: a[tt][h] holds columns kb + 8t .. kb + 8t + 7 of tile rows
// 16tt + g (h = 0) and 16tt + g + 8 (h = 1), b[ng] those of routed row 8ng + g. Two
// m16n8k16 steps use the vectors' words (x, y), then (z, w): logical k = 2t, 2t + 1 maps
// to the words' first halves and k = 2t + 8, 2t + 9 to their second, the same for A and B.
template <int T>
__device__ __forceinline__ void mma_kblock(float (&acc)[T][4][4], const uint4 (&a)[T][2],
                                           const uint4 (&b)[4], int n_ok, int ngroups) {
#pragma unroll
    for (int tt = 0; tt < T; ++tt)
#pragma unroll
        for (int ng = 0; ng < 4; ++ng)
            if (tt < n_ok && ng < ngroups) {  // uniform in the warp
                mma_bf16_16816(acc[tt][ng], a[tt][0].x, a[tt][1].x, a[tt][0].y, a[tt][1].y,
                               b[ng].x, b[ng].y);
                mma_bf16_16816(acc[tt][ng], a[tt][0].z, a[tt][1].z, a[tt][0].w, a[tt][1].w,
                               b[ng].z, b[ng].w);
            }
}

template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <typename LogitT, int T, int W, int D>
__device__ __forceinline__ void lmhead_mma_impl(
    const bf16_bits* __restrict__ hidden, const int* __restrict__ seq_slot, int active,
    long long n_rows, int K, const bf16_bits* __restrict__ rows_all,
    const int* __restrict__ ids_all, const int* __restrict__ tile_adapter, long long num_tiles,
    int num_adapters, long long n_cols, int vec, LogitT* __restrict__ logits) {
    constexpr int NT = W * 32;
    constexpr int MS = 16 * T + 4;  // row stride of `red` (the fragment stores hit distinct banks)
    constexpr int HALF = W / 2;
    constexpr int SLOTS = 2 * T + 4;  // chunks per lane per k-block: tile rows, routed rows
    __shared__ float red[HALF][MMA_GROUP][MS];
    __shared__ int rowlist[NT];
    __shared__ int warp_count[W];
    extern __shared__ uint4 slots[];  // [D][SLOTS][NT]: lane-private chunks, a ring

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int kb_per_warp = ((K + 31) / 32 + W - 1) / W;  // k-blocks kb = 32 (warp + j W)
    // The first chunk's slots, loaded before the tile table (no dependency between them).
    const int slot_first =
        threadIdx.x < n_rows ? (seq_slot ? seq_slot[threadIdx.x] : active) : -1;
    // The blocks together ask L2 for all hidden rows (each line once), so the routed
    // rows' copies below find them there.
    {
        const char* hb = reinterpret_cast<const char*>(hidden);
        const long long hbytes = n_rows * K * 2LL;
        for (long long o = ((long long)blockIdx.x * NT + threadIdx.x) * 128; o < hbytes;
             o += (long long)gridDim.x * NT * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(hb + o));
    }

    for (int seg = 0; seg < T;) {
        const long long tile0 = (long long)blockIdx.x * T + seg;
        if (tile0 >= num_tiles) break;
        const int s = tile_adapter[tile0];
        int n_ok = 1;  // tiles of this run: tile0 .. tile0 + n_ok - 1 (uniform in the block)
#pragma unroll
        for (int tt = 1; tt < T; ++tt)
            if (n_ok == tt && seg + tt < T && tile0 + tt < num_tiles &&
                tile_adapter[tile0 + tt] == s)
                n_ok = tt + 1;
        seg += n_ok;
        if (s < 0 || s >= num_adapters) continue;

        const bf16_bits* tile_rows = rows_all + tile0 * 16 * (long long)K;
        const bf16_bits* arow[T][2];
#pragma unroll
        for (int tt = 0; tt < T; ++tt) {
            arow[tt][0] = tile_rows + (long long)(16 * tt + g) * K;
            arow[tt][1] = tile_rows + (long long)(16 * tt + g + 8) * K;
        }

        for (long long c0 = 0; c0 < n_rows; c0 += NT) {
            // Rows c0 .. c0 + NT - 1 routed to s, compacted in ascending order.
            const long long r = c0 + threadIdx.x;
            const bool mine =
                r < n_rows && (c0 == 0 ? slot_first : (seq_slot ? seq_slot[r] : active)) == s;
            const unsigned int bal = __ballot_sync(FULL_MASK, mine);
            if (lane == 0) warp_count[warp] = __popc(bal);
            __syncthreads();
            int off = 0, total = 0;
#pragma unroll
            for (int w2 = 0; w2 < W; ++w2) {
                const int cnt = warp_count[w2];
                off += (w2 < warp) ? cnt : 0;
                total += cnt;
            }
            if (mine) rowlist[off + __popc(bal & ((1u << lane) - 1u))] = threadIdx.x;
            __syncthreads();
            if (total == 0) continue;
            for (int p0 = 0; p0 < total; p0 += MMA_GROUP) {
                const int nrows = min(MMA_GROUP, total - p0);
                const int ngroups = (nrows + 7) >> 3;
                const bf16_bits* brow[4];
                bool bok[4];
#pragma unroll
                for (int ng = 0; ng < 4; ++ng) {
                    const int idx = p0 + ng * 8 + g;
                    bok[ng] = ng < ngroups && idx < total;
                    brow[ng] = hidden + (c0 + (bok[ng] ? rowlist[idx] : 0)) * (long long)K;
                }
                // This lane's chunks of its warp's j-th k-block into ring slot j % D (one
                // cp.async group per k-block, empty past the last one).
                auto issue = [&](int j) {
                    const int kb = (warp + j * W) * 32;
                    if (j < kb_per_warp && kb < K) {
                        const int k = kb + 8 * t;
                        const bool full = vec && kb + 32 <= K;  // uniform in the warp
                        uint4* st = slots + (j % D) * SLOTS * NT + threadIdx.x;
#pragma unroll
                        for (int tt = 0; tt < T; ++tt)
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                if (tt >= n_ok) continue;
                                uint4* dst = st + (tt * 2 + h) * NT;
                                if (full)
                                    cp_async16(dst, arow[tt][h] + k);
                                else
                                    *dst = load_chunk8(arow[tt][h], k, K, vec);
                            }
#pragma unroll
                        for (int ng = 0; ng < 4; ++ng) {
                            if (!bok[ng]) continue;
                            uint4* dst = st + (2 * T + ng) * NT;
                            if (full)
                                cp_async16(dst, brow[ng] + k);
                            else
                                *dst = load_chunk8(brow[ng], k, K, vec);
                        }
                    }
                    cp_async_commit();
                };
                float acc[T][4][4];
#pragma unroll
                for (int tt = 0; tt < T; ++tt)
#pragma unroll
                    for (int ng = 0; ng < 4; ++ng)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[tt][ng][e] = 0.0f;
#pragma unroll
                for (int j = 0; j < D - 1; ++j) issue(j);
                for (int j = 0; j < kb_per_warp; ++j) {
                    issue(j + D - 1);  // overwrites the slot read in iteration j - 1
                    cp_async_wait_group<D - 1>();  // k-block j has landed
                    if ((warp + j * W) * 32 >= K) continue;  // uniform in the warp
                    const uint4* st = slots + (j % D) * SLOTS * NT + threadIdx.x;
                    uint4 a[T][2];
                    uint4 b[4];
#pragma unroll
                    for (int tt = 0; tt < T; ++tt)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            a[tt][h] =
                                tt < n_ok ? st[(tt * 2 + h) * NT] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                    for (int ng = 0; ng < 4; ++ng)
                        b[ng] = bok[ng] ? st[(2 * T + ng) * NT] : make_uint4(0u, 0u, 0u, 0u);
                    mma_kblock<T>(acc, a, b, n_ok, ngroups);
                }
                cp_async_wait_all();  // (only empty groups are left) the ring is free
                // Tree sum over warps: w += w + half, half = W/2 .. 1 (a fixed order).
                // acc[tt][ng]: (m, n) = (16tt + g, 8ng + 2t), (.., +1), (+8, ..), (+8, +1)
#pragma unroll
                for (int half = HALF; half >= 1; half >>= 1) {
                    if (warp >= half && warp < 2 * half) {
#pragma unroll
                        for (int tt = 0; tt < T; ++tt)
#pragma unroll
                            for (int ng = 0; ng < 4; ++ng) {
                                const int m = 16 * tt + g, n = 8 * ng + 2 * t;
                                float(*dst)[MS] = red[warp - half];
                                dst[n][m] = acc[tt][ng][0];
                                dst[n + 1][m] = acc[tt][ng][1];
                                dst[n][m + 8] = acc[tt][ng][2];
                                dst[n + 1][m + 8] = acc[tt][ng][3];
                            }
                    }
                    __syncthreads();
                    if (warp < half) {
#pragma unroll
                        for (int tt = 0; tt < T; ++tt)
#pragma unroll
                            for (int ng = 0; ng < 4; ++ng) {
                                const int m = 16 * tt + g, n = 8 * ng + 2 * t;
                                const float(*src)[MS] = red[warp];
                                acc[tt][ng][0] += src[n][m];
                                acc[tt][ng][1] += src[n + 1][m];
                                acc[tt][ng][2] += src[n][m + 8];
                                acc[tt][ng][3] += src[n + 1][m + 8];
                            }
                    }
                    __syncthreads();
                }
                if (warp == 0) {
#pragma unroll
                    for (int tt = 0; tt < T; ++tt)
#pragma unroll
                        for (int ng = 0; ng < 4; ++ng)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int m = 16 * tt + g + ((e & 2) ? 8 : 0);
                                const int n = 8 * ng + 2 * t + (e & 1);
                                if (tt >= n_ok || n >= nrows) continue;
                                const long long col = ids_all[tile0 * 16 + m];
                                if (col < 0 || col >= n_cols) continue;
                                store_logit<LogitT>(
                                    logits + (c0 + rowlist[p0 + n]) * n_cols + col, acc[tt][ng][e]);
                            }
                }
            }
        }
    }
}

#define LMHEAD_MMA_ENTRY(NAME, LT, T, W, D)                                                    \
    extern "C" __global__ void __launch_bounds__(W * 32)                                       \
        NAME(const bf16_bits* hidden, const int* seq_slot, int active, long long n_rows,       \
             int hidden_size, const bf16_bits* rows_all, const int* ids_all,                   \
             const int* tile_adapter, long long num_tiles, int num_adapters, long long n_cols, \
             int vec, LT* logits) {                                                            \
        lmhead_mma_impl<LT, T, W, D>(hidden, seq_slot, active, n_rows, hidden_size, rows_all,  \
                                     ids_all, tile_adapter, num_tiles, num_adapters, n_cols,   \
                                     vec, logits);                                             \
    }

LMHEAD_MMA_ENTRY(lmhead_overlay_mma_f32_t1w8d4, float, 1, 8, 4)
LMHEAD_MMA_ENTRY(lmhead_overlay_mma_f32_t2w8d4, float, 2, 8, 4)
LMHEAD_MMA_ENTRY(lmhead_overlay_mma_bf16_t1w8d4, bf16_bits, 1, 8, 4)
LMHEAD_MMA_ENTRY(lmhead_overlay_mma_bf16_t2w8d4, bf16_bits, 2, 8, 4)
