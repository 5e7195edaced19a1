// Run-time choice of the CPU code path. The hot CPU loops are compiled twice: for baseline x86-64 and,
// with GCC/Clang on x86-64, for AVX2+FMA+F16C (see overflow.cpp). Both compile the same source. (GCC 12's
// _Float16 conversions were tried for FP16 and measured slower than the portable branch-free code,
// which vectorises: they are not used.)
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define MPF_HAVE_AVX2_CLONES 1
#else
#define MPF_HAVE_AVX2_CLONES 0
#endif

namespace mpf {

inline bool cpu_has_avx2() {
#if MPF_HAVE_AVX2_CLONES
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

}  // namespace mpf
