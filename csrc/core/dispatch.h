// Runtime values to template parameters, in one place.
//
// The kernels are templates over the storage dtype and over flags that decide branches of the inner
// loop (a master copy, which states exist, which variant of an update): the CPU instantiates each
// combination so that its loops have no branches and vectorise. These helpers turn the runtime value
// into a type and call `f` with it; every backend and every kernel uses them instead of its own switch.
#pragma once

#include <cstdint>
#include <type_traits>

#include "numeric.h"

namespace mpf {

template <DType D>
using DTypeConst = std::integral_constant<DType, D>;

// f(DTypeConst<d>{}) for a storage dtype.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class F>
MPF_HD void dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kFloat32: f(DTypeConst<DType::kFloat32>{}); return;
    case DType::kFloat16: f(DTypeConst<DType::kFloat16>{}); return;
    case DType::kBFloat16: f(DTypeConst<DType::kBFloat16>{}); return;
  }
}

// f(std::true_type{}) or f(std::false_type{}).
template <class F>
inline void dispatch_bool(bool b, F&& f) {
  if (b) f(std::true_type{});
  else f(std::false_type{});
}

// A set of flags (bit i = flag i) known at compile time, or at run time; both answer has(i), so one
// update function serves the CPU's instantiations and CUDA's uniform run-time branches.
template <uint32_t M>
struct StaticFlags {
  static constexpr uint32_t mask = M;
  static constexpr bool has(int i) { return ((M >> i) & 1u) != 0; }
};
struct RuntimeFlags {
  uint32_t mask;
  MPF_HD bool has(int i) const { return ((mask >> i) & 1u) != 0; }
};

// f(StaticFlags<m>{}) for a run-time mask of kBits flags: 2^kBits instantiations.
template <int kBits, uint32_t kAcc = 0, class F>
inline void dispatch_flags(uint32_t m, F&& f) {
  if constexpr (kBits == 0) {
    f(StaticFlags<kAcc>{});
  } else {
    constexpr uint32_t bit = 1u << (kBits - 1);
    if (m & bit) dispatch_flags<kBits - 1, kAcc | bit>(m, f);
    else dispatch_flags<kBits - 1, kAcc>(m, f);
  }
}

}  // namespace mpf
