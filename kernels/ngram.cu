// N-gram embedding kernels: the LongCat hash of every (table, position), and the
// final scaled sum of the word row and the projected n-gram rows.
// Their NumPy references (the specification) are in kernels/ngram.py.
#include <cuda_bf16.h>

// out[i * L + t] = (sum_j xt(t - j) * mult[i * N + j]) mod rows[i]
// with xt(t) = tokens[t], and for j >= 1 xt(t - j) = tokens[t - j] while t - j >= 0
// and no EOS lies in positions t - j .. t - 1 (else 0 and the look-back stops).
// mult[i, j] = V^j mod rows[i] for j < order(i), 0 beyond: every term fits int64.
// With has_starts, the look-back of t also stops before starts[t] (the first position
// of t's sequence when several sequences are hashed in one launch).
extern "C" __global__ void ngram_hash(const long long* __restrict__ tokens,
                                      const long long* __restrict__ starts,
                                      const long long* __restrict__ mult,
                                      const long long* __restrict__ rows,
                                      long long* __restrict__ out,
                                      long long L, int T, int N, long long eos,
                                      int has_starts) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * L) return;
    int i = (int)(idx / L);
    long long t = idx - (long long)i * L;
    const long long* m = mult + (long long)i * N;
    long long first = has_starts ? starts[t] : 0;
    long long acc = tokens[t] * m[0];
    for (int j = 1; j < N; ++j) {
        long long p = t - j;
        if (p < first) break;
        long long x = tokens[p];
        if (x == eos) break;
        acc += x * m[j];
    }
    out[idx] = acc % rows[i];
}

// out[k] = bf16_rn((float(word[k]) + proj[k]) / denom): IEEE division, as NumPy does.
extern "C" __global__ void ngram_scale_sum(const __nv_bfloat16* __restrict__ word,
                                           const float* __restrict__ proj,
                                           __nv_bfloat16* __restrict__ out,
                                           long long n, float denom) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    float acc = __bfloat162float(word[k]) + proj[k];
    out[k] = __float2bfloat16_rn(__fdiv_rn(acc, denom));
}
