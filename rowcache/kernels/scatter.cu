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

// The whole GPU side of a fault in one launch (rowcache.cache.row_cache): scatter_rows of the staged
// records into their slots, then the row -> slot map's update, all read from pinned host
// memory mapped into the device (no copies first). side = [slots (n) | rows (n) |
// evicted rows (n_evicted) | out (n_out)], int32. Specified by fault_commit_reference
// (kernels/scatter.py):
//   table/scales as scatter_rows;  row_map[evicted[e]] = -1;  row_map[rows[r]] = slots[r];
//   out[i] = side[2 n + n_evicted + i] (a resolve's slots, in its input order; none: n_out 0)
// Evicted rows and new rows are disjoint (a row evicted and faulted in by one call would
// have been a hit), so the order of the map writes is moot.
// A deferred fault (rowcache.cache.fault): its records are still being read by a host thread when
// these launches are queued. fault_wait (one thread) holds the stream until the thread has
// written ctl[0] = seq (pinned host memory mapped into the device, written after the
// records), or timeout_ns passed; fault_commit with ctl then does nothing unless ctl[0] and
// ctl[1] both say seq (the read was clean): no record, map or out written, so the caches
// stay as they were and the host raises the read's error.
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void fault_wait(const volatile int* ctl, long long seq, long long timeout_ns) {
    const unsigned long long t0 = global_ns();
    while (ctl[0] != (int)seq && global_ns() - t0 < (unsigned long long)timeout_ns) {
        __nanosleep(2000);
    }
}

template <typename V>
__device__ __forceinline__ void fault_commit(const V* __restrict__ records,
                                             const int* __restrict__ side,
                                             V* __restrict__ table,
                                             float* __restrict__ scales,
                                             int* __restrict__ row_map,
                                             int* __restrict__ out,
                                             long long n,
                                             long long n_evicted,
                                             long long n_out,
                                             long long words,
                                             long long records_stride,
                                             long long table_stride,
                                             long long scale_offset,
                                             const volatile int* ctl,
                                             long long seq) {
    if (ctl != nullptr) {  // a deferred fault: only after a clean read (fault_wait)
        __shared__ int clean;
        if (threadIdx.x == 0 && threadIdx.y == 0) {
            clean = ctl[0] == (int)seq && ctl[1] == (int)seq;
        }
        __syncthreads();
        if (!clean) {
            return;
        }
    }
    scatter_rows<V, int>(records, side, table, scales, n, words, records_stride, table_stride,
                         scale_offset);
    const long long tid = ((long long)blockIdx.x * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    const long long all = (long long)gridDim.x * blockDim.y * blockDim.x;
    for (long long i = tid; i < n_out; i += all) {
        out[i] = side[2 * n + n_evicted + i];
    }
    if (row_map == nullptr) {
        return;
    }
    for (long long e = tid; e < n_evicted; e += all) {
        row_map[side[2 * n + e]] = -1;
    }
    for (long long r = tid; r < n; r += all) {
        row_map[side[n + r]] = side[r];
    }
}

#define FAULT_COMMIT(NAME, V)                                                            \
    extern "C" __global__ void NAME(const V* __restrict__ records,                       \
                                    const int* __restrict__ side,                        \
                                    V* __restrict__ table,                               \
                                    float* __restrict__ scales,                          \
                                    int* __restrict__ row_map,                           \
                                    int* __restrict__ out,                               \
                                    long long n,                                         \
                                    long long n_evicted,                                 \
                                    long long n_out,                                     \
                                    long long words,                                     \
                                    long long records_stride,                            \
                                    long long table_stride,                              \
                                    long long scale_offset,                              \
                                    const volatile int* ctl,                             \
                                    long long seq) {                                     \
        fault_commit<V>(records, side, table, scales, row_map, out, n, n_evicted, n_out, \
                        words, records_stride, table_stride, scale_offset, ctl, seq);    \
    }

FAULT_COMMIT(fault_commit_16, uint4)
FAULT_COMMIT(fault_commit_8, uint2)
FAULT_COMMIT(fault_commit_4, unsigned int)
FAULT_COMMIT(fault_commit_2, unsigned short)
FAULT_COMMIT(fault_commit_1, unsigned char)
