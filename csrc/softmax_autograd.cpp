// attnkit::softmax_fwd's autograd in C++ for softmax_attention's eager calls without score
// options (issue 25's call path): a torch::autograd::Function whose forward calls the op below
// autograd and whose backward calls attnkit::softmax_bwd, with no Python frame in either.
//
// Why: at B=H=1 N=16 D=64 float32 the kernels take ~5 us forward and ~11 us backward (below
// autograd, Xeon with AMX), while the Python autograd.Function around them (its apply,
// setup_context, ctx.saved_tensors, the Python backward) cost ~10 us more.  `python -m attnkit
// bench --quick --match N16-` (Xeon with AMX, 2 threads, alternating, best of 5 x 500 calls),
// forward+backward over SDPA's time: 1.25 with the Python Function, 0.99-1.03 with this one.
//
// The backward does the usual call only: grad_out given, no gradient for the lse, grad mode
// off (no create_graph).  Every other case -- a gradient for the lse, a double backward --
// goes to the Python backward registered by attnkit (set_softmax_backward_fallback), which
// takes the saved tensors and returns (dq, dk, dv): one rule for both paths.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>

#include "message.h"
#include "softmax_autograd.h"

namespace attnkit {
namespace {

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Python's fallback backward: fn(q, k, v, out, lse, mask, scale, is_causal, grad_out, grad_lse)
// -> (dq, dk, dv), any of the gradients None.  Leaked on purpose: a static py::object would be
// destroyed after the interpreter, at exit.
py::object* backward_fallback = nullptr;

}  // namespace

std::tuple<at::Tensor, at::Tensor> call_softmax_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const std::optional<at::Tensor>& mask, double scale,
                                                    bool is_causal) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnkit::softmax_fwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&, double, bool, int64_t, int64_t,
                                                    double, const std::optional<at::Tensor>&,
                                                    const std::optional<at::Tensor>&)>();
  return op.call(q, k, v, mask, scale, is_causal, -1, -1, 0.0, std::nullopt, std::nullopt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_softmax_bwd(const at::Tensor& grad_out, const at::Tensor& q,
                                                                const at::Tensor& k, const at::Tensor& v,
                                                                const at::Tensor& out, const at::Tensor& lse,
                                                                const std::optional<at::Tensor>& mask, double scale,
                                                                bool is_causal) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnkit::softmax_bwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const std::optional<at::Tensor>&, double, bool, int64_t, int64_t, double,
              const std::optional<at::Tensor>&)>();
  return op.call(grad_out, q, k, v, out, lse, mask, scale, is_causal, -1, -1, 0.0, std::nullopt);
}

// Named outside the anonymous namespace: grad_fn.name() and profiles show
// torch::autograd::CppNode<attnkit::SoftmaxAttentionFunction>.
struct SoftmaxAttentionFunction : public torch::autograd::Function<SoftmaxAttentionFunction> {
  // (A mask that requires grad never comes here: softmax_attention routes it to the reference.)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& mask, double scale, bool is_causal) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = call_softmax_fwd(q, k, v, mask, scale, is_causal);
    ctx->save_for_backward({q, k, v, out, lse, mask ? *mask : at::Tensor()});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["is_causal"] = is_causal;
    // An unused lse gets an undefined gradient, not zeros: no second kernel call.
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4],
                     &mask = saved[5];
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    const at::Tensor& grad_out = grads[0];
    const at::Tensor& grad_lse = grads[1];
    const std::optional<at::Tensor> mask_opt = mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
    if (grad_out.defined() && !grad_lse.defined() && !at::GradMode::is_enabled()) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      auto [dq, dk, dv] = call_softmax_bwd(grad_out, q, k, v, out, lse, mask_opt, scale, is_causal);
      return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
    }
    ATTNKIT_CHECK(backward_fallback != nullptr,
                "attnkit: softmax_attention's backward needs its Python fallback (attnkit._C."
                "set_softmax_backward_fallback), which attnkit.ops.softmax registers on import");
    py::gil_scoped_acquire gil;
    py::object none = py::none();
    auto as_object = [&](const at::Tensor& t) -> py::object { return t.defined() ? py::cast(t) : none; };
    py::tuple result = (*backward_fallback)(q, k, v, out, lse, as_object(mask), scale, is_causal,
                                            as_object(grad_out), as_object(grad_lse));
    ATTNKIT_CHECK(result.size() == 3, "attnkit: the softmax backward fallback returned ", result.size(),
                " values, 3 expected (dq, dk, dv)");
    variable_list grads_in(6);
    for (size_t i = 0; i < 3; ++i)
      if (!result[i].is_none()) grads_in[i] = result[i].cast<at::Tensor>();
    return grads_in;
  }
};

void bind_softmax_autograd(pybind11::module_& module) {
  module.def(
      "softmax_fwd_autograd",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
         double scale, bool is_causal) {
        variable_list outs = SoftmaxAttentionFunction::apply(q, k, v, mask, scale, is_causal);
        return std::make_tuple(outs[0], outs[1]);
      },
      "attnkit::softmax_fwd(q, k, v, mask, scale, is_causal) -> (out, lse) with its autograd in C++ "
      "(eager calls outside functorch transforms; no score options)");
  module.def(
      "set_softmax_backward_fallback",
      [](py::object fn) {
        if (backward_fallback == nullptr) backward_fallback = new py::object();
        *backward_fallback = std::move(fn);
      },
      "the Python backward for what the C++ one does not do itself: fn(q, k, v, out, lse, mask, scale, "
      "is_causal, grad_out, grad_lse) -> (dq, dk, dv)");
}

}  // namespace attnkit
