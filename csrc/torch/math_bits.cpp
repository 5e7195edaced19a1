// The operators that write their arguments in place, taken at the Negative and Conjugate dispatch keys.
//
// torch marks some views with a lazy "math bit" instead of computing them: x.conj().imag is a float tensor with
// the negation bit, x.conj() of a complex one carries the conjugation bit. For such arguments the dispatcher
// first runs torch's math-bits fallback, which materialises them, calls the operator on copies, copies the
// mutated ones back, and then takes the operator's return value to be the mutated argument (in-place ops
// return it). mpfused's in-place operators return nothing, so that last step read past the end of the call's
// arguments: an internal assert, a crash or a clone left unwritten (a found_inf that never showed the inf).
// This kernel runs instead, at both keys: an argument the operator writes that carries a math bit is refused,
// naming it, before anything is written (mpfused writes through the tensor's memory, which holds the
// un-negated values); an argument it only reads is materialised (resolve_conj / resolve_neg, as torch's
// fallback does), and the call goes on to the backend kernel. The functional operators (gemm, round_stochastic,
// ...) return new tensors: torch's fallback serves them as any ATen function.
#include "common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace mpf_torch {
namespace {

bool has_math_bit(const at::Tensor& t) { return t.defined() && (t.is_neg() || t.is_conj()); }

at::Tensor resolved(const at::Tensor& t, bool written, const std::string& name) {
  // First the storage check that the kernels make (check_dense): resolving copies the tensor, which would read
  // past the end of a freed or shrunk storage.
  if (t.layout() == at::kStrided && t.has_storage() && !t.key_set().has(c10::DispatchKey::Python)) check_in_storage(t, name);
  if (written)
    fail(name + " is a view with torch's lazy " + (t.is_conj() ? "conjugation" : "negation") +
         " bit set (such as x.conj().imag), which mpfused cannot write in place; pass a tensor without it (made by "
         "t.resolve_conj().resolve_neg(), a copy)");
  return t.resolve_conj().resolve_neg();
}

void math_bits_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  TORCH_INTERNAL_ASSERT(stack->size() >= n);
  const size_t base = stack->size() - n;
  for (size_t i = 0; i < n; ++i) {
    const bool written = args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    c10::IValue& v = (*stack)[base + i];
    const std::string& name = args[i].name();
    if (v.isTensor()) {
      if (has_math_bit(v.toTensor())) v = resolved(v.toTensor(), written, name);
    } else if (v.isTensorList()) {  // Tensor[]: a copy of the list, with the resolved tensors
      c10::List<at::Tensor> list = v.toTensorList();
      bool any = false;
      for (size_t j = 0; j < list.size() && !any; ++j) any = has_math_bit(list.get(j));
      if (!any) continue;
      c10::List<at::Tensor> copy = list.copy();
      for (size_t j = 0; j < copy.size(); ++j)
        if (has_math_bit(copy.get(j))) copy.set(j, resolved(copy.get(j), written, name + "[" + std::to_string(j) + "]"));
      v = c10::IValue(copy);
    } else if (v.isList()) {  // Tensor?[]
      c10::impl::GenericList list = v.toList();
      bool any = false;
      for (size_t j = 0; j < list.size() && !any; ++j) any = list.get(j).isTensor() && has_math_bit(list.get(j).toTensor());
      if (!any) continue;
      c10::impl::GenericList copy = list.copy();
      for (size_t j = 0; j < copy.size(); ++j) {
        const c10::IValue e = copy.get(j);
        if (e.isTensor() && has_math_bit(e.toTensor()))
          copy.set(j, c10::IValue(resolved(e.toTensor(), written, name + "[" + std::to_string(j) + "]")));
      }
      v = c10::IValue(copy);
    }
  }
  // On to the kernels below both keys (Negative is taken before Conjugate).
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Conjugate), stack);
}

// Every operator of mpfused that writes an argument (its schema marks it `(a!)`); tests/test_torch_ops.py checks
// that the list holds all of them.
constexpr const char* kInPlaceOps[] = {"fixed_point_quantize_out_", "follow_writes_", "loss_scale_update_",
                                       "non_finite_check_",         "optim_step_",    "philox_words_",
                                       "round_stochastic_out_",     "unscale_check_"};

}  // namespace

TORCH_LIBRARY_IMPL(mpfused, Negative, m) {
  for (const char* op : kInPlaceOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&math_bits_kernel>());
}
TORCH_LIBRARY_IMPL(mpfused, Conjugate, m) {
  for (const char* op : kInPlaceOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&math_bits_kernel>());
}

}  // namespace mpf_torch
