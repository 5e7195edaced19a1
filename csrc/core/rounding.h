// Explicitly rounded FP32 operations, shared by the CPU and CUDA backends.
//
// nvcc contracts a * b + c into an FMA by default and host compilers may too; these functions pin each
// operation to one IEEE-rounded FP32 result, so both backends compute the same bits (host code is also
// built with -ffp-contract=off).
#pragma once

#include <cmath>

#include "numeric.h"

namespace mpf {

// IEEE single-precision operations that the compiler may not fuse into an FMA.
MPF_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // host code is built with -ffp-contract=off
#endif
}
MPF_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MPF_HD float fsub(float a, float b) { return fadd(a, -b); }
MPF_HD float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MPF_HD float fsqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

}  // namespace mpf
