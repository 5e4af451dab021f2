// A linear layer on the CPU through oneDNN as one autograd node (see src/gemm.rs).
//
// libtorch's own route, `mkldnn_linear(x.to_mkldnn(), w).to_dense()`, keeps for the backward a
// oneDNN-layout copy of every projection's input and output (ToDenseBackward saves its whole
// input only to learn its layout), which grew the peak memory of a SmolLM2 forward+backward by
// 45%. This node saves the dense input and the weight, as `torch.nn.functional.linear` does, and
// converts to oneDNN's layout only inside the forward and the backward.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

at::Tensor forward_through_onednn(const at::Tensor& x, const at::Tensor& w,
                                  const std::optional<at::Tensor>& bias) {
  return at::mkldnn_linear(x.contiguous().to_mkldnn(), w.contiguous(), bias).to_dense();
}

// The gradients of `x`, `w` and (when `has_bias`) the bias, each only where autograd needs it.
variable_list backward_through_onednn(AutogradContext* ctx, const at::Tensor& grad,
                                      bool has_bias) {
  auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  const at::Tensor w = saved[1].contiguous();
  const at::Tensor g = grad.contiguous().to_mkldnn();
  at::Tensor gx, gw, gb;
  if (ctx->needs_input_grad(0)) {
    gx = at::mkldnn_linear_backward_input(x.sizes(), g, w).to_dense();
  }
  const bool want_gb = has_bias && ctx->needs_input_grad(2);
  if (ctx->needs_input_grad(1) || want_gb) {
    auto r = at::mkldnn_linear_backward_weights(g, x.contiguous().to_mkldnn(), w, has_bias);
    if (ctx->needs_input_grad(1)) gw = std::get<0>(r);
    if (want_gb) gb = std::get<1>(r);
  }
  if (has_bias) return {gx, gw, gb};
  return {gx, gw};
}

// Autograd's custom functions take no undefined tensor, hence one node with a bias and one
// without.
struct OneDnnLinear : public Function<OneDnnLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return forward_through_onednn(x, w, std::nullopt);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return backward_through_onednn(ctx, grads[0], false);
  }
};

struct OneDnnLinearBias : public Function<OneDnnLinearBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b) {
    ctx->save_for_backward({x, w});
    return forward_through_onednn(x, w, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return backward_through_onednn(ctx, grads[0], true);
  }
};

char* error_text(const char* what) {
  const size_t n = std::strlen(what) + 1;
  char* out = static_cast<char*>(std::malloc(n));
  if (out != nullptr) std::memcpy(out, what, n);
  return out;
}

}  // namespace

// `x · wᵀ + b` into `*out` (a new tensor the caller owns); `b` may be null. Returns null, or an
// error text the caller frees with `rl_onednn_free`.
extern "C" char* rl_onednn_linear(at::Tensor** out, const at::Tensor* x, const at::Tensor* w,
                                  const at::Tensor* b) {
  try {
    *out = new at::Tensor(b != nullptr ? OneDnnLinearBias::apply(*x, *w, *b)
                                       : OneDnnLinear::apply(*x, *w));
    return nullptr;
  } catch (const std::exception& e) {
    return error_text(e.what());
  } catch (...) {
    return error_text("unknown C++ exception");
  }
}

extern "C" void rl_onednn_free(char* text) { std::free(text); }
