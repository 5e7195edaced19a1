// The autograd kernel of the rounding operators (round_stochastic, fixed_point_quantize and their out_
// forms), and the GEMM's refusal of forward-mode AD. Rounding is flat almost everywhere: it has no useful
// derivative, and a gradient must never be dropped in silence. So this kernel, registered for the
// Autograd keys of those four ops:
// - refuses forward-mode AD (a tangent on x or out: a dual tensor, torch.func.jvp), before anything is
//   computed;
// - refuses an out_ form when x or out takes part in autograd (grad mode on and either requires grad), as
//   torch does for its own out= arguments, before anything is written; counts the write in out's version
//   (torch's in-place ops do that at ADInplaceOrView, which this kernel's redispatch passes by);
// - otherwise computes below autograd and, when x requires grad, gives the output a grad_fn that raises
//   in backward with the way out: round a detached x, or a straight-through estimator built on one;
// - lets integer codes (encode) through unchecked: integers carry no gradient and no tangent in torch.
// One boxed kernel serves the four schemas: x is the first argument, out the last of an out_ form.
// The GEMM ops get a forward-mode check of their own, below their Python autograd (no_forward_derivative).
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

// The Python function a user called, for the messages: encode when the output holds integer codes.
std::string public_name(const std::string& op, bool codes) {
  if (op.rfind("mpfused::round_stochastic", 0) == 0) return "mpfused.round_stochastic";
  return codes ? "mpfused.fixed_point.encode" : "mpfused.fixed_point.quantize";
}

// The way out, in both modes: round a detached x, so that no tangent or gradient reaches the rounding.
constexpr const char* kStraightThrough =
    "round x.detach() instead, and to pass the gradient straight through use x + (rounded - x).detach() with "
    "rounded computed from x.detach()";

void no_derivative(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const bool out_form = schema.name().back() == '_';
  const c10::IValue& x_arg = (*stack)[stack->size() - nargs];
  const c10::IValue& last = stack->back();
  const at::Tensor x = x_arg.isTensor() ? x_arg.toTensor() : at::Tensor();
  const at::Tensor out = out_form && last.isTensor() ? last.toTensor() : at::Tensor();
  // Integer codes (encode) carry no gradient and no tangent, as torch's integer-valued ops (argmax) do:
  // nothing can be dropped, so nothing is refused. The output's dtype: out's, or the out_dtype argument.
  const bool fixed_point = schema.name().rfind("mpfused::fixed_point", 0) == 0;
  bool codes = false;
  if (out.defined()) codes = !at::isFloatingType(out.scalar_type());
  else if (fixed_point && !out_form && last.isInt()) codes = !at::isFloatingType(last.toScalarType());

  if (!codes) {
    const auto tangent_of = [](const at::Tensor& t) { return t.defined() && t._fw_grad(0).defined(); };
    const char* tangent = tangent_of(x) ? "x" : tangent_of(out) ? "out" : nullptr;
    if (tangent)
      TORCH_CHECK(false, public_name(schema.name(), codes), " has no derivative (rounding is flat almost everywhere), "
                  "in forward mode as in backward, but ", tangent, " carries a tangent (a dual tensor, "
                  "torch.func.jvp); ", kStraightThrough);
    if (out_form && c10::GradMode::is_enabled()) {
      const auto needs_grad = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
      const char* grad = needs_grad(x) ? "x" : needs_grad(out) ? "out" : nullptr;
      if (grad)
        TORCH_CHECK(false, public_name(schema.name(), codes), " with out= takes no part in autograd (as torch's out= "
                    "arguments), but ", grad, " requires grad; call it under torch.no_grad(), pass detached tensors, "
                    "or leave out=None (then a backward through the result raises)");
    }
  }
  // An out_ form writes out in place: an inference tensor may only be written inside inference mode (where
  // this kernel does not run), as torch says for its own in-place ops; refused before anything is written.
  if (out.defined() && out.is_inference())
    TORCH_CHECK(false, "out is an inference tensor (made under torch.inference_mode()); it can be written in place "
                "only inside inference mode: write into a clone made outside it, or call this inside it");
  const bool record = !out_form && !codes && x.defined() && ag::compute_requires_grad(x);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  // out was written in place, past ADInplaceOrView (which counts the writes of torch's own in-place ops):
  // count this one, so that a graph that saved out for its backward refuses to use the new values
  if (out.defined()) ag::impl::bump_version(out);
  if (!record) return;
  NodePtr node = NodeMaker<NodePtr>::make<ag::Error>(public_name(schema.name(), codes) +
                                                         " has no derivative (rounding is flat almost everywhere); " +
                                                         kStraightThrough,
                                                     ag::collect_next_edges(x));
  ag::set_history(stack->back().toTensor(), node);
}

// The GEMM's reverse-mode formula is registered in Python (mpfused/_ops.py), and it has no forward-mode
// formula. torch's Python autograd path forwards a call whose inputs carry only forward-mode tangents below
// autograd, which would return the product with its tangent dropped (None for a dual tensor, zeros under
// torch.func.jvp). This kernel sits at ADInplaceOrView, which every call through autograd passes with
// the caller's tensors, and refuses a tangent before anything is computed.
void no_forward_derivative(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor()._fw_grad(0).defined())
      TORCH_CHECK(false, "mpfused.gemm (and FusedLinear) has no forward-mode derivative, but ", args[i].name(),
                  " carries a tangent (a dual tensor, torch.func.jvp); use reverse mode (loss.backward() or "
                  "torch.autograd.grad), or torch's matmul for forward-mode AD");
  }
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

}  // namespace
}  // namespace mpf_torch

TORCH_LIBRARY_IMPL(mpfused, Autograd, m) {
  for (const char* op : {"round_stochastic", "round_stochastic_out_", "fixed_point_quantize",
                         "fixed_point_quantize_out_"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&mpf_torch::no_derivative>());
}

TORCH_LIBRARY_IMPL(mpfused, ADInplaceOrView, m) {
  for (const char* op : {"gemm", "gemm_with_pre"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&mpf_torch::no_forward_derivative>());
}
