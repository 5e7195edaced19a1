// Storage formats and exact conversions shared by the CPU and CUDA backends.
//
// FP16 and BF16 are storage formats only: every value is widened to FP32, computed on in FP32 and
// rounded back with round-to-nearest-even. The host conversions are bit-exact with the CUDA
// intrinsics (and with torch's c10::Half / c10::BFloat16) for every non-NaN input, so the CPU backend
// produces the same bits as the GPU backend. A NaN stays a NaN; its payload is not preserved.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define MPF_HD __host__ __device__ __forceinline__
#else
// Forced inline on the host as on the device: the CPU loops vectorise only where every per-element call
// (a policy's update, a conversion, a rounding) is inlined, and GCC's inliner stops inlining even small
// functions once a translation unit has grown past its limits (the optimizer's clones did: each policy's
// update became an out-of-line scalar call per element). .ci/check_isa_clones.py checks the result.
#define MPF_HD inline __attribute__((always_inline))
#endif

namespace mpf {

// The storage dtypes the kernels accept. The numbering is part of the kernel ABI (kernels.h).
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

MPF_HD const char* dtype_name(DType d) {
  return d == DType::kFloat32 ? "float32" : d == DType::kFloat16 ? "float16" : "bfloat16";
}

MPF_HD int64_t dtype_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

MPF_HD float bits_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

MPF_HD uint32_t float_as_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// ---- non-finite tests on the stored bits: all exponent bits set means inf or NaN ----------------
constexpr uint32_t kF32ExpMask = 0x7f800000u;
constexpr uint16_t kF16ExpMask = 0x7c00u;
constexpr uint16_t kBF16ExpMask = 0x7f80u;

MPF_HD bool f32_bits_nonfinite(uint32_t u) { return (u & kF32ExpMask) == kF32ExpMask; }
MPF_HD bool f16_bits_nonfinite(uint16_t h) { return (h & kF16ExpMask) == kF16ExpMask; }
MPF_HD bool bf16_bits_nonfinite(uint16_t h) { return (h & kBF16ExpMask) == kBF16ExpMask; }
MPF_HD bool is_finite(float f) { return !f32_bits_nonfinite(float_as_bits(f)); }

// cond ? a : b on bits, without a branch: host loops that use it stay vectorisable.
MPF_HD uint32_t select_bits(bool cond, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(cond);
  return (a & m) | (b & ~m);
}

// ---- FP16 ----------------------------------------------------------------------------------------
// Exact widening. Branch-free so that host loops vectorise: normal numbers are rebiased by a
// multiply with 2^-112, subnormals are rebuilt by subtracting a magic 0.5.
MPF_HD float f16_bits_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;  // exponent and mantissa, sign shifted out
  // Normal (and inf/NaN): move the 5-bit exponent into the 8-bit field, adding 224 to the biased
  // exponent (overflowing 31 to 255 keeps inf/NaN), then scale by 2^-112 to finish the rebias.
  const float normalized = bits_as_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Subnormal: mantissa * 2^-24 == (0.5 + mantissa * 2^-24) - 0.5, exactly.
  const float denormalized = bits_as_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t mag = select_bits(two_w < (1u << 27), float_as_bits(denormalized), float_as_bits(normalized));
  return bits_as_float(sign | mag);
#endif
}

// Round-to-nearest-even narrowing, including subnormal results and overflow to inf.
MPF_HD uint16_t float_to_f16_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t w = float_as_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  // Scaling by 2^112 then 2^-110 makes |f| >= 65520 overflow to inf in FP32 itself, and performs the
  // rounding of the subnormal range through the addition below.
  float base = (bits_as_float(float_as_bits(f) & 0x7fffffffu) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;  // a max: the smallest exponent FP16 rounds at
  // Adding 2^(e+2) (a number whose ulp is the FP16 ulp of f) rounds base to FP16 precision.
  base = bits_as_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_as_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | select_bits(shl1_w > 0xFF000000u, 0x7E00u, nonsign));
#endif
}

// ---- BF16 ----------------------------------------------------------------------------------------
MPF_HD float bf16_bits_to_float(uint16_t h) { return bits_as_float(static_cast<uint32_t>(h) << 16); }

MPF_HD uint16_t float_to_bf16_bits(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // One conversion instruction (two values per instruction where the compiler pairs them) in place of the
  // integer rounding below: the same bits for every non-NaN input. The hardware's NaN is 0x7FFF; the host's
  // 0x7FC0 is kept. In the optimizer's loops the integer rounding cost about 15 instructions an element.
  const uint16_t h = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  return f != f ? static_cast<uint16_t>(0x7FC0u) : h;
#else
  const uint32_t u = float_as_bits(f);
  // Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate. A NaN becomes
  // the quiet NaN 0x7FC0 (rounding could otherwise carry a NaN's payload into an inf).
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(select_bits((u & 0x7fffffffu) > 0x7f800000u, 0x7FC0u, rounded));
#endif
}

// ---- per-dtype access, so templated loops read the same for every storage format ---------------
template <DType D>
struct Storage;

template <>
struct Storage<DType::kFloat32> {
  using type = float;
  static MPF_HD float load(float x) { return x; }
  static MPF_HD float store(float x) { return x; }
  static MPF_HD uint32_t nonfinite_bits(float x) { return float_as_bits(x) & kF32ExpMask; }
  static constexpr uint32_t kExpMask = kF32ExpMask;
};

template <>
struct Storage<DType::kFloat16> {
  using type = uint16_t;
  static MPF_HD float load(uint16_t x) { return f16_bits_to_float(x); }
  static MPF_HD uint16_t store(float x) { return float_to_f16_bits(x); }
  static MPF_HD uint32_t nonfinite_bits(uint16_t x) { return x & kF16ExpMask; }
  static constexpr uint32_t kExpMask = kF16ExpMask;
};

template <>
struct Storage<DType::kBFloat16> {
  using type = uint16_t;
  static MPF_HD float load(uint16_t x) { return bf16_bits_to_float(x); }
  static MPF_HD uint16_t store(float x) { return float_to_bf16_bits(x); }
  static MPF_HD uint32_t nonfinite_bits(uint16_t x) { return x & kBF16ExpMask; }
  static constexpr uint32_t kExpMask = kBF16ExpMask;
};

}  // namespace mpf
