// Token-overlay kernels: find changed vocab rows (embed_rowdiff), overwrite gathered
// embedding rows with an adapter's rows (embed_overlay_routed), and recompute the
// logits of an adapter's overridden tokens (lmhead_overlay_routed).
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
// lmhead_overlay_routed_{f32,bf16}(hidden, seq_slot, active, n_rows, hidden_size, id_ptrs,
//                                  row_ptrs, counts, num_adapters, row_tile, n_cols, vec,
//                                  logits)
//   hidden   : bf16[n_rows, hidden_size]
//   seq_slot : int32[n_rows] or nullptr (then every row uses `active`)
//   id_ptrs  : u64[num_adapters], adapter s's overridden token ids int32[counts[s]] (distinct)
//   row_ptrs : u64[num_adapters], adapter s's LM-head rows bf16[counts[s], hidden_size]
//   logits   : f32 or bf16 [n_rows, n_cols], in place:
//              logits[r, ids_s[j]] = round(dot_f32(hidden[r], rows_s[j])) for rows routed to s
// Grid (x: override blocks, y: adapter s, z: tiles of row_tile rows). Each (row, j) dot is
// one warp's work: lanes accumulate strided products in f32 and a shuffle tree sums them.
// A warp keeps its override j for every row of its tile routed to s, so the override row
// comes from DRAM once per tile and from L1 afterwards. Ids < 0 or >= n_cols are skipped.
template <typename LogitT>
__device__ __forceinline__ void store_logit(LogitT* p, float v);

template <>
__device__ __forceinline__ void store_logit<float>(float* p, float v) { *p = v; }

template <>
__device__ __forceinline__ void store_logit<bf16_bits>(bf16_bits* p, float v) {
    *p = __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

template <typename LogitT>
__device__ __forceinline__ void lmhead_overlay_impl(
    const bf16_bits* __restrict__ hidden, const int* __restrict__ seq_slot, int active,
    long long n_rows, int hidden_size, const u64* __restrict__ id_ptrs,
    const u64* __restrict__ row_ptrs, const int* __restrict__ counts, int num_adapters,
    int row_tile, long long n_cols, int vec, LogitT* __restrict__ logits) {
    const int s = blockIdx.y;
    if (s >= num_adapters) return;
    if (seq_slot == nullptr && active != s) return;
    const int count = counts[s];
    if (count <= 0) return;
    const int* ids = reinterpret_cast<const int*>(id_ptrs[s]);
    const bf16_bits* rows = reinterpret_cast<const bf16_bits*>(row_ptrs[s]);
    const int lane = threadIdx.x & 31;
    const int warps_per_block = blockDim.x >> 5;
    const long long row0 = (long long)blockIdx.z * row_tile;
    const long long row_end = (row0 + row_tile < n_rows) ? row0 + row_tile : n_rows;
    for (int j = blockIdx.x * warps_per_block + (threadIdx.x >> 5); j < count;
         j += gridDim.x * warps_per_block) {
        const long long col = (long long)ids[j];
        if (col < 0 || col >= n_cols) continue;
        const bf16_bits* w = rows + (long long)j * hidden_size;
        for (long long r = row0; r < row_end; ++r) {
            const int sr = seq_slot ? seq_slot[r] : active;
            if (sr != s) continue;
            const bf16_bits* h = hidden + r * hidden_size;
            float acc = 0.0f;
            if (vec) {
#pragma unroll 4
                for (int k = lane * 8; k < hidden_size; k += 256) {
                    const uint4 a = __ldg(reinterpret_cast<const uint4*>(h + k));
                    const uint4 b = __ldg(reinterpret_cast<const uint4*>(w + k));
                    acc = fmaf(bf16_lo(a.x), bf16_lo(b.x), acc);
                    acc = fmaf(bf16_hi(a.x), bf16_hi(b.x), acc);
                    acc = fmaf(bf16_lo(a.y), bf16_lo(b.y), acc);
                    acc = fmaf(bf16_hi(a.y), bf16_hi(b.y), acc);
                    acc = fmaf(bf16_lo(a.z), bf16_lo(b.z), acc);
                    acc = fmaf(bf16_hi(a.z), bf16_hi(b.z), acc);
                    acc = fmaf(bf16_lo(a.w), bf16_lo(b.w), acc);
                    acc = fmaf(bf16_hi(a.w), bf16_hi(b.w), acc);
                }
            } else {
                for (int k = lane; k < hidden_size; k += 32) {
                    const float x = __uint_as_float(((unsigned int)h[k]) << 16);
                    const float y = __uint_as_float(((unsigned int)w[k]) << 16);
                    acc = fmaf(x, y, acc);
                }
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(FULL_MASK, acc, off);
            if (lane == 0) store_logit<LogitT>(logits + r * n_cols + col, acc);
        }
    }
}

extern "C" __global__ void lmhead_overlay_routed_f32(
    const bf16_bits* hidden, const int* seq_slot, int active, long long n_rows, int hidden_size,
    const u64* id_ptrs, const u64* row_ptrs, const int* counts, int num_adapters, int row_tile,
    long long n_cols, int vec, float* logits) {
    lmhead_overlay_impl<float>(hidden, seq_slot, active, n_rows, hidden_size, id_ptrs, row_ptrs,
                               counts, num_adapters, row_tile, n_cols, vec, logits);
}

extern "C" __global__ void lmhead_overlay_routed_bf16(
    const bf16_bits* hidden, const int* seq_slot, int active, long long n_rows, int hidden_size,
    const u64* id_ptrs, const u64* row_ptrs, const int* counts, int num_adapters, int row_tile,
    long long n_cols, int vec, bf16_bits* logits) {
    lmhead_overlay_impl<bf16_bits>(hidden, seq_slot, active, n_rows, hidden_size, id_ptrs,
                                   row_ptrs, counts, num_adapters, row_tile, n_cols, vec, logits);
}
