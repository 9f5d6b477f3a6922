// The scaled sum after the projection GEMM: the word row plus the (split) GEMM's parts,
// divided and rounded to bf16. Its NumPy reference (the specification) is in
// kernels/gemm.py (scale_sum_reference).
#include <cuda_bf16.h>

// out[k] = bf16_rn((float(word[k]) + proj) / denom) with proj = proj[0][k] + proj[1][k]
// + ... over `parts` parts of n elements each (the split GEMM's, summed in that order):
// IEEE division and float adds, as NumPy does.
extern "C" __global__ void ngram_scale_sum(const __nv_bfloat16* __restrict__ word,
                                           const float* __restrict__ proj,
                                           __nv_bfloat16* __restrict__ out,
                                           long long n, float denom, int parts) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    float p = proj[k];
    for (int j = 1; j < parts; ++j) p = __fadd_rn(p, proj[(long long)j * n + k]);
    float acc = __fadd_rn(__bfloat162float(word[k]), p);
    out[k] = __float2bfloat16_rn(__fdiv_rn(acc, denom));
}
