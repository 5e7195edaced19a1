// The autograd kernel of the rounding operators (round_stochastic, fixed_point_quantize and their out_
// forms). Rounding is flat almost everywhere: it has no useful derivative, and a gradient must never be
// dropped in silence. So this kernel, registered for the Autograd keys of those four ops:
// - refuses forward-mode AD (a dual tensor, torch.func.jvp), before anything is computed;
// - refuses an out_ form when x or out takes part in autograd (grad mode on and either requires grad), as
//   torch does for its own out= arguments, before anything is written;
// - otherwise computes below autograd and, when x requires grad, gives a floating output a grad_fn that
//   raises in backward with the way out: detach, or a straight-through estimator.
// One boxed kernel serves the four schemas: x is the first argument, out the last of an out_ form.
// Registered in C++ (not torch.library.register_autograd in Python) because torch's Python path forwards
// a call whose inputs carry only forward-mode tangents below autograd, dropping the tangent, and costs
// about 4 us a call.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <type_traits>

#include "common.h"

namespace mpf_torch {
namespace {

namespace ag = torch::autograd;

// A graph node owned the way this torch's Edge holds it (std::shared_ptr before torch's move to
// c10::intrusive_ptr, intrusive_ptr after), so the file builds against either.
template <class Ptr>
struct NodeMaker;
template <class T>
struct NodeMaker<std::shared_ptr<T>> {
  template <class U, class... A>
  static std::shared_ptr<T> make(A&&... a) { return std::make_shared<U>(std::forward<A>(a)...); }
};
template <class T>
struct NodeMaker<c10::intrusive_ptr<T>> {
  template <class U, class... A>
  static c10::intrusive_ptr<T> make(A&&... a) { return c10::make_intrusive<U>(std::forward<A>(a)...); }
};
using NodePtr = std::remove_cv_t<decltype(ag::Edge::function)>;

// The Python function a user called, for the messages.
std::string public_name(const std::string& op) {
  if (op.rfind("mpfused::round_stochastic", 0) == 0) return "mpfused.round_stochastic";
  return "mpfused.fixed_point.quantize / encode";
}

constexpr const char* kStraightThrough =
    "detach its input, or pass the gradient straight through: x + (rounded - x).detach()";

void no_derivative(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const bool out_form = schema.name().back() == '_';
  const c10::IValue& x_arg = (*stack)[stack->size() - nargs];
  const c10::IValue& out_arg = stack->back();
  const std::string name = public_name(schema.name());
  const bool have_x = x_arg.isTensor() && x_arg.toTensor().defined();
  const bool have_out = out_form && out_arg.isTensor() && out_arg.toTensor().defined();

  if ((have_x && x_arg.toTensor()._fw_grad(0).defined()) || (have_out && out_arg.toTensor()._fw_grad(0).defined()))
    TORCH_CHECK(false, name, " has no derivative (rounding is flat almost everywhere), in forward mode (dual "
                "tensors, torch.func.jvp) as in backward; ", kStraightThrough);
  if (out_form && c10::GradMode::is_enabled() &&
      ((have_x && x_arg.toTensor().requires_grad()) || (have_out && out_arg.toTensor().requires_grad())))
    TORCH_CHECK(false, name, " with out= takes no part in autograd (as torch's out= arguments), but ",
                (have_x && x_arg.toTensor().requires_grad()) ? "x" : "out", " requires grad; call it under "
                "torch.no_grad(), pass detached tensors, or leave out=None (then a backward through the result "
                "raises)");
  const at::Tensor x = !out_form && have_x ? x_arg.toTensor() : at::Tensor();
  const bool record = x.defined() && ag::compute_requires_grad(x);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  if (!record) return;
  const at::Tensor out = stack->back().toTensor();
  if (!at::isFloatingType(out.scalar_type())) return;  // codes: integers take no gradient
  NodePtr node = NodeMaker<NodePtr>::make<ag::Error>(
      name + " has no derivative (rounding is flat almost everywhere); " + kStraightThrough,
      ag::collect_next_edges(x));
  ag::set_history(out, node);
}

}  // namespace
}  // namespace mpf_torch

TORCH_LIBRARY_IMPL(mpfused, Autograd, m) {
  for (const char* op : {"round_stochastic", "round_stochastic_out_", "fixed_point_quantize",
                         "fixed_point_quantize_out_"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&mpf_torch::no_derivative>());
}
