// The cache's fault path: write staged store records into arena slots, launched by
// kernels/scatter.py and specified by scatter_records_reference (kernels/reference.py):
//   table[slots[r], :] = first row_bytes bytes of records[r]           (bf16 or FP8 codes)
//   scales[slots[r]]   = little-endian float32 at byte scale_offset of records[r]  (FP8 only)
// Slots are trusted to be distinct and inside the arena (the launcher documents it).
//
// Same layout as gather.cu: (TX, TY) blocks, one team of TX threads per record, teams
// striding over the batch; words are V-sized (16, 8, 4, 2 or 1 bytes), the widest
// dividing row_bytes, both row strides and both base pointers. FP8 records are
// dim + 4 bytes long, so for most dims only narrow words are aligned; the scale sits
// at an arbitrary byte offset and is assembled from bytes. The records may live in
// pinned host memory mapped into the device (the staging buffer).

template <typename V, typename I>
__device__ __forceinline__ void scatter_rows(const V* __restrict__ records,
                                             const I* __restrict__ slots,
                                             V* __restrict__ table,
                                             float* __restrict__ scales,
                                             long long n,
                                             long long words,
                                             long long records_stride,
                                             long long table_stride,
                                             long long scale_offset) {
    const long long step = (long long)gridDim.x * blockDim.y;
    for (long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; r < n; r += step) {
        const long long slot = (long long)slots[r];
        const V* src = records + r * records_stride;
        V* dst = table + slot * table_stride;
        for (long long w = threadIdx.x; w < words; w += blockDim.x) {
            dst[w] = src[w];
        }
        if (scales != nullptr && threadIdx.x == 0) {
            const unsigned char* b = reinterpret_cast<const unsigned char*>(src) + scale_offset;
            const unsigned int bits = (unsigned int)b[0] | ((unsigned int)b[1] << 8) |
                                      ((unsigned int)b[2] << 16) | ((unsigned int)b[3] << 24);
            scales[slot] = __uint_as_float(bits);
        }
    }
}

#define SCATTER_ROWS(NAME, V, I)                                                        \
    extern "C" __global__ void NAME(const V* __restrict__ records,                      \
                                    const I* __restrict__ slots,                        \
                                    V* __restrict__ table,                              \
                                    float* __restrict__ scales,                         \
                                    long long n,                                        \
                                    long long words,                                    \
                                    long long records_stride,                           \
                                    long long table_stride,                             \
                                    long long scale_offset) {                           \
        scatter_rows<V, I>(records, slots, table, scales, n, words, records_stride,     \
                           table_stride, scale_offset);                                 \
    }

SCATTER_ROWS(scatter_rows_16_i32, uint4, int)
SCATTER_ROWS(scatter_rows_16_i64, uint4, long long)
SCATTER_ROWS(scatter_rows_8_i32, uint2, int)
SCATTER_ROWS(scatter_rows_8_i64, uint2, long long)
SCATTER_ROWS(scatter_rows_4_i32, unsigned int, int)
SCATTER_ROWS(scatter_rows_4_i64, unsigned int, long long)
SCATTER_ROWS(scatter_rows_2_i32, unsigned short, int)
SCATTER_ROWS(scatter_rows_2_i64, unsigned short, long long)
SCATTER_ROWS(scatter_rows_1_i32, unsigned char, int)
SCATTER_ROWS(scatter_rows_1_i64, unsigned char, long long)
