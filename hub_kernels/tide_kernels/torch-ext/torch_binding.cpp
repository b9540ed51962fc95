#include <torch/library.h>

#include "registration.h"
#include "torch_binding.h"

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def(
      "router_exit(Tensor hidden, Tensor norm_weight, Tensor? norm_bias, int norm_kind, float eps, "
      "Tensor down_weight, Tensor down_bias, Tensor up_weight, Tensor up_bias, float threshold) "
      "-> (Tensor scores, Tensor exit_mask)");
  ops.impl("router_exit", torch::kCUDA, &router_exit);
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
