// Fused router exit: norm -> down -> SiLU -> up -> sigmoid -> score > threshold, in one launch.
//
// One block per row of `hidden` [B, H]. All arithmetic is fp32 whatever the storage dtype:
//   1. row statistics (mean for LayerNorm, then the mean square about it) by block reduction;
//   2. the normed row, kept in shared memory as fp32 [H];
//   3. one warp per bottleneck unit r: dot(down_weight[r], normed) + down_bias[r], SiLU, times up_weight[r];
//   4. the block sums those into the logit, adds up_bias, applies the sigmoid and compares with the threshold.
// The launch goes on the current CUDA stream and nothing waits for it on the host.

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

constexpr int kRmsNorm = 0;       // x * rsqrt(mean(x^2) + eps) * w
constexpr int kGemmaRmsNorm = 1;  // x * rsqrt(mean(x^2) + eps) * (1 + w)
constexpr int kLayerNorm = 2;     // (x - mean) * rsqrt(var + eps) * w + b

constexpr size_t kDefaultSharedBytes = 48 * 1024;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) router_exit_kernel(
    const scalar_t* __restrict__ hidden, int64_t hidden_row_stride,
    const scalar_t* __restrict__ norm_weight, const scalar_t* __restrict__ norm_bias,  // bias may be null
    int norm_kind, float eps,
    const scalar_t* __restrict__ down_weight, const scalar_t* __restrict__ down_bias,  // [R, H], [R]
    const scalar_t* __restrict__ up_weight, const scalar_t* __restrict__ up_bias,      // [R], [1]
    float threshold, int hidden_size, int bottleneck,
    float* __restrict__ scores, bool* __restrict__ exit_mask) {
  extern __shared__ float normed[];  // [H]
  __shared__ float scratch[kWarps];

  const int64_t row = blockIdx.x;
  const scalar_t* x = hidden + row * hidden_row_stride;
  const int H = hidden_size;

  // 1. Statistics, fp32.
  float mean = 0.f;
  if (norm_kind == kLayerNorm) {
    float sum = 0.f;
    for (int h = threadIdx.x; h < H; h += kThreads) sum += static_cast<float>(x[h]);
    mean = block_sum(sum, scratch) / H;
  }
  float square_sum = 0.f;
  for (int h = threadIdx.x; h < H; h += kThreads) {
    const float centered = static_cast<float>(x[h]) - mean;
    square_sum += centered * centered;
  }
  const float rstd = rsqrtf(block_sum(square_sum, scratch) / H + eps);

  // 2. Normed row into shared memory.
  const float weight_offset = norm_kind == kGemmaRmsNorm ? 1.f : 0.f;
  for (int h = threadIdx.x; h < H; h += kThreads) {
    float value = (static_cast<float>(x[h]) - mean) * rstd * (static_cast<float>(norm_weight[h]) + weight_offset);
    if (norm_bias != nullptr) value += static_cast<float>(norm_bias[h]);
    normed[h] = value;
  }
  __syncthreads();

  // 3. down -> SiLU -> times up, one warp per bottleneck unit.
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float partial = 0.f;  // this warp's share of the logit (identical in every lane)
  for (int r = warp; r < bottleneck; r += kWarps) {
    const scalar_t* w = down_weight + static_cast<int64_t>(r) * H;
    float acc = 0.f;
    for (int h = lane; h < H; h += 32) acc += static_cast<float>(w[h]) * normed[h];
    const float z = warp_sum(acc) + static_cast<float>(down_bias[r]);
    const float activated = z / (1.f + expf(-z));  // SiLU
    partial += activated * static_cast<float>(up_weight[r]);
  }

  // 4. Logit, score, decision.
  const float logit = block_sum(lane == 0 ? partial : 0.f, scratch) + static_cast<float>(up_bias[0]);
  if (threadIdx.x == 0) {
    const float score = 1.f / (1.f + expf(-logit));
    scores[row] = score;
    exit_mask[row] = score > threshold;
  }
}

void check_param(const torch::Tensor& t, const torch::Tensor& hidden, int64_t numel, const char* name) {
  TORCH_CHECK(t.device() == hidden.device(), "router_exit: ", name, " is on ", t.device(), ", hidden on ",
              hidden.device());
  TORCH_CHECK(t.scalar_type() == hidden.scalar_type(), "router_exit: ", name, " has dtype ", t.scalar_type(),
              ", hidden has ", hidden.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "router_exit: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "router_exit: ", name, " has ", t.numel(), " elements, expected ", numel);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> router_exit(
    const torch::Tensor& hidden, const torch::Tensor& norm_weight, const std::optional<torch::Tensor>& norm_bias,
    int64_t norm_kind, double eps, const torch::Tensor& down_weight, const torch::Tensor& down_bias,
    const torch::Tensor& up_weight, const torch::Tensor& up_bias, double threshold) {
  TORCH_CHECK(hidden.is_cuda(), "router_exit: hidden must be a CUDA tensor");
  TORCH_CHECK(hidden.dim() == 2, "router_exit: hidden must be [B, H], got ", hidden.sizes());
  TORCH_CHECK(hidden.size(1) == 0 || hidden.stride(1) == 1, "router_exit: hidden rows must be contiguous");
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "router_exit: hidden must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(norm_kind == kRmsNorm || norm_kind == kGemmaRmsNorm || norm_kind == kLayerNorm,
              "router_exit: norm_kind must be 0 (RMSNorm), 1 (Gemma RMSNorm) or 2 (LayerNorm), got ", norm_kind);
  TORCH_CHECK(down_weight.dim() == 2 && down_weight.size(1) == hidden.size(1),
              "router_exit: down_weight must be [R, H] with H = ", hidden.size(1), ", got ", down_weight.sizes());

  const int64_t batch = hidden.size(0);
  const int64_t hidden_size = hidden.size(1);
  const int64_t bottleneck = down_weight.size(0);
  check_param(norm_weight, hidden, hidden_size, "norm_weight");
  if (norm_bias.has_value()) check_param(*norm_bias, hidden, hidden_size, "norm_bias");
  check_param(down_weight, hidden, bottleneck * hidden_size, "down_weight");
  check_param(down_bias, hidden, bottleneck, "down_bias");
  check_param(up_weight, hidden, bottleneck, "up_weight");
  check_param(up_bias, hidden, 1, "up_bias");
  TORCH_CHECK(hidden_size > 0 && hidden_size <= INT32_MAX && bottleneck <= INT32_MAX,
              "router_exit: unsupported sizes H = ", hidden_size, ", R = ", bottleneck);

  auto scores = torch::empty({batch}, hidden.options().dtype(at::kFloat));
  auto exit_mask = torch::empty({batch}, hidden.options().dtype(at::kBool));
  if (batch == 0) return {scores, exit_mask};

  const c10::cuda::CUDAGuard device_guard(hidden.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const size_t shared_bytes = static_cast<size_t>(hidden_size) * sizeof(float);
  const size_t shared_limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  TORCH_CHECK(shared_bytes + kWarps * sizeof(float) <= shared_limit, "router_exit: H = ", hidden_size,
              " needs more shared memory than this device offers per block");

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "router_exit", [&] {
    auto kernel = router_exit_kernel<scalar_t>;
    if (shared_bytes > kDefaultSharedBytes) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(shared_bytes)));
    }
    kernel<<<static_cast<unsigned int>(batch), kThreads, shared_bytes, stream>>>(
        hidden.data_ptr<scalar_t>(), hidden.stride(0), norm_weight.data_ptr<scalar_t>(),
        norm_bias.has_value() ? norm_bias->data_ptr<scalar_t>() : nullptr, static_cast<int>(norm_kind),
        static_cast<float>(eps), down_weight.data_ptr<scalar_t>(), down_bias.data_ptr<scalar_t>(),
        up_weight.data_ptr<scalar_t>(), up_bias.data_ptr<scalar_t>(), static_cast<float>(threshold),
        static_cast<int>(hidden_size), static_cast<int>(bottleneck), scores.data_ptr<float>(),
        exit_mask.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {scores, exit_mask};
}
