// Warp and block sums shared by the kernels: one block of kThreads threads per row.
#pragma once

namespace tide_kernels {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Sum of `value` over the block, returned to every thread. `scratch` holds kWarps floats.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  value = warp_sum(value);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

}  // namespace tide_kernels
