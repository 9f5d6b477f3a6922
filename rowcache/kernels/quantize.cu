// Per-row absmax E4M3 quantization, launched by kernels/quantize.py and specified by
// quantize_fp8_reference (kernels/reference.py):
//   scale[r]    = amax(|x[r, :]|) / 448.0f, or 1.0f where that is 0 (an all-zero row, or
//                 one so small the division underflows: its codes are then signed zeros)
//   codes[r, j] = satfinite_e4m3_rn(x[r, j] / scale[r])
// Bit-exact with the reference for non-NaN inputs because every step is exactly
// rounded: |x| and max are exact, the two divisions are IEEE float32 divisions (NVRTC's
// default -prec-div=true, no fast-math; x * (1/scale) would round differently) and
// the E4M3 conversion is round-to-nearest-even with saturation to +-448.
// One block per row (the grid strides over rows); blockDim.x is a multiple of 32.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float warp_max(float m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    }
    return m;
}

template <typename T>
__device__ __forceinline__ void quantize_rows(const T* __restrict__ x,
                                              unsigned char* __restrict__ codes,
                                              float* __restrict__ scales,
                                              long long n,
                                              long long dim,
                                              long long x_stride,
                                              long long codes_stride) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    for (long long r = blockIdx.x; r < n; r += gridDim.x) {
        const T* row = x + r * x_stride;
        float m = 0.0f;
        for (long long j = threadIdx.x; j < dim; j += blockDim.x) {
            m = fmaxf(m, fabsf(to_float(row[j])));
        }
        m = warp_max(m);
        if (lane == 0) partial[warp] = m;
        __syncthreads();
        if (warp == 0) {
            m = warp_max(lane < warps ? partial[lane] : 0.0f);
            if (lane == 0) partial[0] = m;
        }
        __syncthreads();
        const float amax = partial[0];
        __syncthreads();  // partial[] is rewritten by the next row
        const float q = amax / 448.0f;
        const float scale = q == 0.0f ? 1.0f : q;
        if (threadIdx.x == 0) scales[r] = scale;
        unsigned char* out = codes + r * codes_stride;
        for (long long j = threadIdx.x; j < dim; j += blockDim.x) {
            out[j] = __nv_cvt_float_to_fp8(to_float(row[j]) / scale, __NV_SATFINITE, __NV_E4M3);
        }
    }
}

extern "C" __global__ void quantize_bf16_to_fp8(const __nv_bfloat16* __restrict__ x,
                                                unsigned char* __restrict__ codes,
                                                float* __restrict__ scales,
                                                long long n,
                                                long long dim,
                                                long long x_stride,
                                                long long codes_stride) {
    quantize_rows<__nv_bfloat16>(x, codes, scales, n, dim, x_stride, codes_stride);
}

extern "C" __global__ void quantize_f32_to_fp8(const float* __restrict__ x,
                                               unsigned char* __restrict__ codes,
                                               float* __restrict__ scales,
                                               long long n,
                                               long long dim,
                                               long long x_stride,
                                               long long codes_stride) {
    quantize_rows<float>(x, codes, scales, n, dim, x_stride, codes_stride);
}
