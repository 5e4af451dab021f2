// A linear layer on the CPU through oneDNN as one autograd node (see src/gemm.rs).
//
// libtorch's own route, `mkldnn_linear(x.to_mkldnn(), w).to_dense()`, keeps for the backward a
// oneDNN-layout copy of every projection's input and output (ToDenseBackward saves its whole
// input only to learn its layout), which grew the peak memory of a SmolLM2 forward+backward by
// 45%. This node saves the dense input and the weight, as `torch.nn.functional.linear` does, and
// converts to oneDNN's layout only inside the forward and the backward.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>

#include "shim.h"

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

// The two operators PyTorch's inference compiler uses for frozen weights (registered by
// libtorch under `mkldnn::`, not in the generated C++ API): a weight reordered once into
// oneDNN's blocked layout, and a product with such a weight.
c10::OperatorHandle mkldnn_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor call_boxed(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

}  // namespace

// `x · wᵀ + b` into `*out` (a new tensor the caller owns); `b` may be null. Returns null, or an
// error text the caller frees with `rl_onednn_free`.
extern "C" char* rl_onednn_linear(at::Tensor** out, const at::Tensor* x, const at::Tensor* w,
                                  const at::Tensor* b) {
  return rl_shim::guarded([&] {
    *out = new at::Tensor(b != nullptr ? OneDnnLinearBias::apply(*x, *w, *b)
                                       : OneDnnLinear::apply(*x, *w));
  });
}

extern "C" void rl_onednn_free(char* text) { std::free(text); }

// `w` copied into oneDNN's blocked layout for products without gradients (`*out`, a new tensor
// the caller owns). Returns null or an error text, as `rl_onednn_linear`.
extern "C" char* rl_onednn_pack(at::Tensor** out, const at::Tensor* w) {
  return rl_shim::guarded([&] {
    static const c10::OperatorHandle reorder = mkldnn_op("mkldnn::_reorder_linear_weight");
    *out = new at::Tensor(call_boxed(reorder, {w->detach().contiguous(), c10::IValue()}));
  });
}

// `x · wᵀ + b` with `packed` from `rl_onednn_pack`; `b` may be null. Refused while autograd is
// recording: the packed copy is not the weight autograd would differentiate.
extern "C" char* rl_onednn_linear_packed(at::Tensor** out, const at::Tensor* x,
                                         const at::Tensor* packed, const at::Tensor* b) {
  return rl_shim::guarded([&] {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "a packed weight is for products without gradients");
    static const c10::OperatorHandle pointwise = mkldnn_op("mkldnn::_linear_pointwise");
    c10::IValue bias = b != nullptr ? c10::IValue(*b) : c10::IValue();
    *out = new at::Tensor(call_boxed(
        pointwise, {x->contiguous(), *packed, bias, std::string("none"),
                    c10::List<std::optional<at::Scalar>>(), c10::IValue()}));
  });
}

// How many times `x` was changed in place (autograd's version counter: a packed copy made at
// one version is stale at another), or -1 where `x` is not a contiguous tensor that owns all of
// its memory (a view, e.g. ZeRO-3's gathered parameters, which live for one use).
extern "C" int64_t rl_packable_version(const at::Tensor* x) {
  const bool owns = x->is_contiguous() && x->storage_offset() == 0 && x->has_storage() &&
                    x->storage().nbytes() == x->nbytes();
  return owns ? static_cast<int64_t>(x->_version()) : -1;
}
