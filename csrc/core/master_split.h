// Where an optimizer step takes the FP32 weight of a param from, and the split master of
// master_weights="remainder": an FP32 master kept as a BF16 param plus a 16-bit remainder.
//
// The master's bit pattern m is (param << 16) + remainder, a 32-bit two's complement add with the remainder
// sign-extended, so the pair holds the FP32 master exactly in 4 bytes, of which the model reads the 2 of the
// param. The param is m rounded to nearest with ties away from zero, on the bit pattern: (m + 0x8000) >> 16.
// Then m - (param << 16) lies in [-0x8000, 0x7FFF] and fits an int16. Ties to even would not do: its
// difference ranges over [-0x8000, 0x8000], 65537 values, one more than 16 bits hold. (Bit patterns of one
// sign are ordered like their magnitudes, so adding half a BF16 step to the pattern rounds the magnitude,
// across binades; a master within half a step of 2^128 gives an inf param and stays exact in the pair.)
//
// NaN: a NaN master gives the param 0x7FC0 (the NaN of float_to_bf16_bits) and the remainder 0, so the
// reconstructed master is the quiet NaN 0x7FC00000: a NaN stays a NaN, its sign and payload are not kept.
#pragma once

#include <cstdint>

#include "numeric.h"

namespace mpf {

// The FP32 weight of a param in an optimizer step: numbering part of the kernel ABI (CUDA launch arguments).
enum class WeightSource : uint8_t {
  kParam = 0,      // an FP32 param, or a 16-bit param updated without a master (master_weights=False)
  kMaster = 1,     // an FP32 master tensor
  kRemainder = 2,  // a BF16 param joined with its int16 remainder
};

MPF_HD float join_master(uint16_t hi, int16_t lo) {
  return bits_as_float((static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(lo)));
}

MPF_HD bool f32_bits_nan(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// The BF16 param of master bits m: m rounded to nearest, ties away from zero; 0x7FC0 for a NaN.
MPF_HD uint16_t split_master_hi(uint32_t m) {
  return static_cast<uint16_t>(select_bits(f32_bits_nan(m), 0x7FC0u, (m + 0x8000u) >> 16));
}

// The remainder of master bits m beside its param hi = split_master_hi(m): exact, in [-0x8000, 0x7FFF]; 0 for
// a NaN.
MPF_HD int16_t split_master_lo(uint32_t m, uint16_t hi) {
  const uint32_t lo = m - (static_cast<uint32_t>(hi) << 16);
  return static_cast<int16_t>(static_cast<uint16_t>(select_bits(f32_bits_nan(m), 0u, lo)));
}

}  // namespace mpf
