#include <torch/library.h>

#include "registration.h"
#include "torch_binding.h"

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def(
      "router_exit(Tensor hidden, Tensor norm_weight, Tensor? norm_bias, int norm_kind, float eps, "
      "Tensor down_weight, Tensor down_bias, Tensor up_weight, Tensor up_bias, float threshold) "
      "-> (Tensor scores, Tensor exit_mask)");
  ops.impl("router_exit", torch::kCUDA, &router_exit);
  ops.def(
      "checkpoint_test(Tensor hidden, Tensor? translate_weight, Tensor? translate_bias, Tensor down_bias, "
      "Tensor down_weight, Tensor up_bias, Tensor up_weight, bool layer_norm, float eps, float threshold) "
      "-> (Tensor scores, Tensor exits, Tensor state)");
  ops.impl("checkpoint_test", torch::kCUDA, &checkpoint_test);
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
