// Fused checkpoint test: the exit state, its norm statistics, the router (with the final norm's weight folded
// into its first projection), the sigmoid and the threshold, for Tide's tuned exit head and the logit lens.
//
//   x      = hidden @ T + t         (tuned exit head, fp32; T is the head's weight transposed, [H, H]: one cuBLAS
//                                     GEMM, which reads T at the GPU's full bandwidth), or a state already
//                                     translated by a low-rank head, or hidden itself (logit lens)
//   state  = x in hidden's dtype     (what the final norm and the LM head read when the token exits)
//   x      = x - mean(x)             (LayerNorm only)
//   z      = silu(b_d + (x @ D) * rsqrt(mean(x^2) + eps))     D [H, R]: the router's down weight with the norm folded in
//   score  = sigmoid(b_u + z @ u),   exit = score > threshold
//
// After the GEMM, one block per row does the rest in one launch: the fp32 row sits in shared memory; the
// down projection runs in tiles of 32 columns, one column per lane and the rows of D split across the warps,
// so each warp reads 128 contiguous bytes of D per step. Everything runs on the current stream, with no host
// synchronization, so CUDA graphs capture it.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <optional>
#include <tuple>

#include "../common/reductions.cuh"

namespace {

using tide_kernels::block_sum;
using tide_kernels::kThreads;
using tide_kernels::kWarps;
using tide_kernels::warp_sum;

constexpr size_t kDefaultSharedBytes = 48 * 1024;

template <typename in_t, typename out_t>
__global__ void __launch_bounds__(kThreads) checkpoint_test_kernel(
    const in_t* __restrict__ rows, int64_t row_stride,  // x [N, H]
    out_t* __restrict__ state,                           // [N, H], contiguous
    bool layer_norm, float eps,
    const float* __restrict__ down_bias, const float* __restrict__ down_weight,  // [R], [H, R]
    const float* __restrict__ up_bias, const float* __restrict__ up_weight,      // [1], [R]
    float threshold, int hidden_size, int bottleneck, float* __restrict__ scores, bool* __restrict__ exits) {
  extern __shared__ float x[];  // [H], fp32
  __shared__ float scratch[kWarps];
  __shared__ float tile[kWarps][33];  // per warp, its partial dot products for one tile of 32 columns

  const int H = hidden_size;
  const int R = bottleneck;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const in_t* source = rows + static_cast<int64_t>(blockIdx.x) * row_stride;
  out_t* out = state + static_cast<int64_t>(blockIdx.x) * H;

  // 1. The row in fp32, the exit state in the model's dtype, and the mean (LayerNorm).
  float sum = 0.f;
  for (int h = threadIdx.x; h < H; h += kThreads) {
    const float value = static_cast<float>(source[h]);
    out[h] = static_cast<out_t>(value);
    x[h] = value;
    sum += value;
  }
  const float mean = layer_norm ? block_sum(sum, scratch) / H : 0.f;

  // 2. Centre (LayerNorm) and the inverse RMS.
  float square_sum = 0.f;
  for (int h = threadIdx.x; h < H; h += kThreads) {  // the same elements this thread wrote above
    const float centred = x[h] - mean;
    x[h] = centred;
    square_sum += centred * centred;
  }
  const float inv_rms = rsqrtf(block_sum(square_sum, scratch) / H + eps);  // block_sum syncs: x is complete

  // 3. z = silu(b_d + (x @ D) * inv_rms), times u, in tiles of 32 columns of D.
  float partial = 0.f;  // warp 0, lane r: its columns' share of the logit
  for (int base = 0; base < R; base += 32) {
    const int r = base + lane;
    float acc = 0.f;
    if (r < R) {
      for (int h = warp; h < H; h += kWarps) acc += x[h] * down_weight[static_cast<int64_t>(h) * R + r];
    }
    tile[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && r < R) {
      float dot = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) dot += tile[w][lane];
      const float pre = down_bias[r] + dot * inv_rms;
      const float activated = pre / (1.f + expf(-pre));  // SiLU
      partial += activated * up_weight[r];
    }
    __syncthreads();  // tile is read before the next tile overwrites it
  }

  // 4. The logit, the score and the decision.
  if (warp == 0) {
    const float logit = warp_sum(partial) + up_bias[0];
    if (lane == 0) {
      const float score = 1.f / (1.f + expf(-logit));
      scores[blockIdx.x] = score;
      exits[blockIdx.x] = score > threshold;
    }
  }
}

void check_fp32(const torch::Tensor& t, const torch::Tensor& hidden, int64_t numel, const char* name) {
  TORCH_CHECK(t.device() == hidden.device(), "checkpoint_test: ", name, " is on ", t.device(), ", hidden on ",
              hidden.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "checkpoint_test: ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "checkpoint_test: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "checkpoint_test: ", name, " has ", t.numel(), " elements, expected ", numel);
}

template <typename in_t, typename out_t>
void launch(const torch::Tensor& x, torch::Tensor& state, bool layer_norm, double eps, const torch::Tensor& down_bias,
            const torch::Tensor& down_weight, const torch::Tensor& up_bias, const torch::Tensor& up_weight,
            double threshold, int64_t rows, int64_t hidden_size, int64_t bottleneck, torch::Tensor& scores,
            torch::Tensor& exits, cudaStream_t stream) {
  const size_t shared_bytes = static_cast<size_t>(hidden_size) * sizeof(float);
  auto kernel = checkpoint_test_kernel<in_t, out_t>;
  if (shared_bytes > kDefaultSharedBytes) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared_bytes)));
  }
  kernel<<<static_cast<unsigned int>(rows), kThreads, shared_bytes, stream>>>(
      x.data_ptr<in_t>(), x.stride(0), state.data_ptr<out_t>(), layer_norm, static_cast<float>(eps),
      down_bias.data_ptr<float>(), down_weight.data_ptr<float>(), up_bias.data_ptr<float>(),
      up_weight.data_ptr<float>(), static_cast<float>(threshold), static_cast<int>(hidden_size),
      static_cast<int>(bottleneck), scores.data_ptr<float>(), exits.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> checkpoint_test(
    const torch::Tensor& hidden, const std::optional<torch::Tensor>& translate_weight,
    const std::optional<torch::Tensor>& translate_bias, const torch::Tensor& down_bias,
    const torch::Tensor& down_weight, const torch::Tensor& up_bias, const torch::Tensor& up_weight, bool layer_norm,
    double eps, double threshold) {
  TORCH_CHECK(hidden.is_cuda(), "checkpoint_test: hidden must be a CUDA tensor");
  TORCH_CHECK(hidden.dim() == 2, "checkpoint_test: hidden must be [N, H], got ", hidden.sizes());
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "checkpoint_test: hidden must be float32, float16 or bfloat16, got ", dtype);
  const int64_t rows = hidden.size(0);
  const int64_t hidden_size = hidden.size(1);
  TORCH_CHECK(down_weight.dim() == 2 && down_weight.size(0) == hidden_size,
              "checkpoint_test: down_weight must be [H, R] with H = ", hidden_size, ", got ", down_weight.sizes());
  const int64_t bottleneck = down_weight.size(1);
  check_fp32(down_weight, hidden, hidden_size * bottleneck, "down_weight");
  check_fp32(down_bias, hidden, bottleneck, "down_bias");
  check_fp32(up_weight, hidden, bottleneck, "up_weight");
  check_fp32(up_bias, hidden, 1, "up_bias");
  TORCH_CHECK(hidden_size > 0 && hidden_size <= INT32_MAX && bottleneck > 0 && bottleneck <= INT32_MAX,
              "checkpoint_test: unsupported sizes H = ", hidden_size, ", R = ", bottleneck);

  const c10::cuda::CUDAGuard device_guard(hidden.device());
  // The exit state before the norm: translated by the tuned head, handed in translated, or hidden itself.
  torch::Tensor x;
  if (translate_bias.has_value()) {
    TORCH_CHECK(translate_weight.has_value(), "checkpoint_test: translate_bias needs translate_weight");
    check_fp32(*translate_weight, hidden, hidden_size * hidden_size, "translate_weight");
    check_fp32(*translate_bias, hidden, hidden_size, "translate_bias");
    x = at::addmm(*translate_bias, hidden.to(at::kFloat), translate_weight->view({hidden_size, hidden_size}));
  } else if (translate_weight.has_value()) {  // a low-rank head's output, [N, H] fp32
    TORCH_CHECK(translate_weight->dim() == 2 && translate_weight->size(0) == rows &&
                    translate_weight->size(1) == hidden_size && translate_weight->scalar_type() == at::kFloat &&
                    translate_weight->device() == hidden.device(),
                "checkpoint_test: a translated state (translate_weight without translate_bias) must be float32 [",
                rows, ", ", hidden_size, "] on hidden's device, got ", translate_weight->sizes());
    x = *translate_weight;
  } else {
    x = hidden;
  }
  if (x.size(1) > 0 && x.stride(1) != 1) x = x.contiguous();

  auto scores = torch::empty({rows}, hidden.options().dtype(at::kFloat));
  auto exits = torch::empty({rows}, hidden.options().dtype(at::kBool));
  auto state = torch::empty({rows, hidden_size}, hidden.options());
  if (rows == 0) return {scores, exits, state};

  const size_t shared_limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  TORCH_CHECK(static_cast<size_t>(hidden_size) * sizeof(float) <= shared_limit, "checkpoint_test: H = ",
              hidden_size, " needs more shared memory than this device offers per block");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool fp32_rows = x.scalar_type() == at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "checkpoint_test", [&] {
    if (fp32_rows) {
      launch<float, scalar_t>(x, state, layer_norm, eps, down_bias, down_weight, up_bias, up_weight, threshold, rows,
                              hidden_size, bottleneck, scores, exits, stream);
    } else {
      launch<scalar_t, scalar_t>(x, state, layer_norm, eps, down_bias, down_weight, up_bias, up_weight, threshold,
                                 rows, hidden_size, bottleneck, scores, exits, stream);
    }
  });
  return {scores, exits, state};
}
