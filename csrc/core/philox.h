// Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011),
// the counter-based generator behind every random bit mpfused uses (stochastic rounding). One
// definition for the host and the device: a pure function of (counter, key), so a value depends only on
// which element it is for, never on threads, chunking, launch shape or device.
//
// How mpfused keys it: key = the 64-bit seed (low word first); counter = (block index, low and high words;
// stream, two words). One block gives 128 bits: eight elements of 16 bits each. Element e of a stream
// takes the 16 bits of block e / 8, word (e / 2) % 4, low half for even e and high half for odd e, so
// element e gets the same bits whichever slice of the data it arrives in (round_stochastic(x[k:],
// offset=k)). 16 bits per element are exactly the bits BF16 rounding drops, and cost half the Philox
// rounds of a word per element: on the CPU the generator, not memory, bounds stochastic rounding.
#pragma once

#include <cstdint>

#include "numeric.h"

namespace mpf {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;  // the round multipliers
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // the key schedule's increments (golden ratio, sqrt(3) - 1)
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// Streams: the two high counter words. Distinct users of one seed draw from distinct streams.
constexpr uint32_t kStreamRound = 0;  // round_stochastic, fixed_point.quantize/matmul: (0, 0)
constexpr uint32_t kStreamOptim = 1;  // an optimizer step's write-back: (step, kStreamOptim)

struct Philox4 {
  uint32_t v[4];
};

MPF_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// The key of every round: the key schedule of (k0, k1), done once. A CUDA kernel takes it among its
// arguments, so that its rounds read the keys from the constant bank: no registers of their own (the
// schedule folded into the loop kept 18 of them live in the optimizer's stochastic loop, at its limit of 128).
struct PhiloxKeys {
  uint32_t k0[kPhiloxRounds], k1[kPhiloxRounds];
};

MPF_HD PhiloxKeys philox_keys(uint32_t k0, uint32_t k1) {
  PhiloxKeys k{};
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < kPhiloxRounds; ++round) {  // the key advances between rounds (wrapping)
    k.k0[round] = k0 + static_cast<uint32_t>(round) * kPhiloxW0;
    k.k1[round] = k1 + static_cast<uint32_t>(round) * kPhiloxW1;
  }
  return k;
}

MPF_HD PhiloxKeys philox_keys(uint64_t seed) {
  return philox_keys(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// The ten rounds on counter c under the round keys k.
MPF_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, const PhiloxKeys& k) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint32_t hi0 = mulhi32(kPhiloxM0, c0), lo0 = kPhiloxM0 * c0;
    const uint32_t hi1 = mulhi32(kPhiloxM1, c2), lo1 = kPhiloxM1 * c2;
    c0 = hi1 ^ c1 ^ k.k0[round];
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k.k1[round];
    c3 = lo0;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The ten rounds on counter c with key (k0, k1).
MPF_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  return philox4x32_10(c0, c1, c2, c3, philox_keys(k0, k1));
}

constexpr int kElementsPerBlock = 8;

// Block `block` of stream (s0, s1) under `seed`: the random bits of elements 8 * block .. 8 * block + 7.
MPF_HD Philox4 philox_block(const PhiloxKeys& keys, uint64_t block, uint32_t s0, uint32_t s1) {
  return philox4x32_10(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), s0, s1, keys);
}

MPF_HD Philox4 philox_block(uint64_t seed, uint64_t block, uint32_t s0, uint32_t s1) {
  return philox_block(philox_keys(seed), block, s0, s1);
}

// The random bits of element k (0..7) of a block, as the top 16 bits of a 32-bit value (the low 16 are
// zero): what the rounding functions take as `r` (they compare with its top bits).
MPF_HD uint32_t philox_bits(const Philox4& p, int k) {
  // Selects, not p.v[k >> 1]: a run-time index into the words would put them in GPU local memory.
  const int i = k >> 1;
  const uint32_t w = i == 0 ? p.v[0] : i == 1 ? p.v[1] : i == 2 ? p.v[2] : p.v[3];
  return (k & 1) ? (w & 0xFFFF0000u) : (w << 16);
}

// The random bits of element `index` of stream (s0, s1) (computes its whole block: loops over consecutive
// elements should call philox_block once per eight and philox_bits for each).
MPF_HD uint32_t philox_word(uint64_t seed, uint64_t index, uint32_t s0, uint32_t s1) {
  return philox_bits(philox_block(seed, index >> 3, s0, s1), static_cast<int>(index & 7));
}

}  // namespace mpf
