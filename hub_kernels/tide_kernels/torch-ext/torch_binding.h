#pragma once

#include <torch/torch.h>

#include <optional>
#include <tuple>

// hidden [B, H] -> (scores float32 [B], exit_mask bool [B]); see router_exit/router_exit.cu.
std::tuple<torch::Tensor, torch::Tensor> router_exit(
    const torch::Tensor& hidden, const torch::Tensor& norm_weight, const std::optional<torch::Tensor>& norm_bias,
    int64_t norm_kind, double eps, const torch::Tensor& down_weight, const torch::Tensor& down_bias,
    const torch::Tensor& up_weight, const torch::Tensor& up_bias, double threshold);

// hidden [N, H] -> (scores float32 [N], exits bool [N], exit states [N, H] in hidden's dtype); see
// checkpoint_test/checkpoint_test.cu.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> checkpoint_test(
    const torch::Tensor& hidden, const std::optional<torch::Tensor>& translate_weight,
    const std::optional<torch::Tensor>& translate_bias, const torch::Tensor& down_bias,
    const torch::Tensor& down_weight, const torch::Tensor& up_bias, const torch::Tensor& up_weight, bool layer_norm,
    double eps, double threshold);
