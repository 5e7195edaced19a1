// Following a write from outside the optimizer step: the per-element rules, for the host and the device.
//
// A 16-bit param kept with an FP32 master (master_weights=True) holds what the last step wrote from its
// master: the master rounded to nearest, or with rounding="stochastic" one of the master's two neighbours
// in the param's format (core/stochastic.h). Code outside the step may write the param (model.load_state_dict,
// an init_, a clamp_, an Embedding's max_norm renorm); then the elements it changed keep what was written,
// and their masters take the param's value, as with torch's optimizers, where the param is the weight.
// An element that still holds what the step could have written from its master keeps its master, low bits
// included: so a write that changes nothing (a copy-back of the same values) costs the master nothing.
//
//   - Nearest: the master is kept where the param equals the master rounded to nearest (values compared:
//     +0 and -0 are equal, a NaN equals nothing).
//   - Stochastic: the master is kept where the param equals the master, or lies on the master's side of its
//     next value toward the master (so nothing of the grid lies between them: the param is one of the
//     master's two neighbours), or is the inf of the master's sign with the master beyond the largest finite
//     value (the grid's step past it is infinity, core/stochastic.h). A write that lands on one of the
//     master's neighbours looks like the step's own rounding and is not followed.
//
// A BF16 param with an int16 remainder (master_weights="remainder", core/master_split.h): the param's bits
// are the master's high half, so a written value stands with the old low bits below it, less than half a
// step of BF16; except where those would make the master a NaN: a negative remainder below a written zero
// (of either sign: the bits wrap) or a positive one below an inf. Those remainders become 0. (A negative one
// below an inf is a real split: a master within half a step of 2^128, which the step writes as inf; a
// positive one below a zero, a master below 2^-133.)
//
// mpfused/optim/_base.py (_follow_writes) says when a param is followed: when its version counter or memory
// moved since the last step saw it.
#pragma once

#include <cmath>
#include <cstdint>

#include "numeric.h"

namespace mpf {

// The 16-bit pattern next to h toward +inf (up) or -inf (!up), as C's nextafter on the format: patterns of one
// sign are ordered like their magnitudes; from a zero of either sign the next is the smallest subnormal of
// the direction's sign; a NaN stays itself. (The callers never step an inf outward: a master is at most inf.)
template <DType D>
MPF_HD uint16_t bits_toward(uint16_t h, bool up) {
  constexpr uint32_t exp_mask = D == DType::kFloat16 ? kF16ExpMask : kBF16ExpMask;
  const uint32_t mag = h & 0x7fffu;
  const bool neg = (h & 0x8000u) != 0;
  const uint32_t from_zero = up ? 0x0001u : 0x8001u;
  const bool away = neg != up;  // away from zero: up from a positive, down from a negative
  const uint32_t stepped = away ? static_cast<uint32_t>(h) + 1u : static_cast<uint32_t>(h) - 1u;
  const uint32_t nan = mag > exp_mask;
  return static_cast<uint16_t>(select_bits(nan != 0, h, select_bits(mag == 0, from_zero, stepped)));
}

// Whether a param q (widened: qf) still holds what a nearest step wrote from `master`.
template <DType D>
MPF_HD bool follow_keeps_nearest(float qf, float master) {
  return qf == Storage<D>::load(Storage<D>::store(master));
}

// Whether a param q (widened: qf; its next value toward the master, widened: toward) still holds what a
// stochastic step could have written from `master`.
template <DType D>
MPF_HD bool follow_keeps_stochastic(float qf, float toward, float master) {
  constexpr float max_finite = D == DType::kFloat16 ? 65504.0f : 0x1.fep127f;
  // (bitwise operators, not && and ||: the host loops over these vectorise only without branches)
  const bool between = (qf == master) | (fabsf(master - qf) < fabsf(toward - qf));
  // (of the master's sign: there qf is an inf and the master past the largest finite value, both nonzero)
  const bool beyond = (fabsf(qf) == INFINITY) & (fabsf(master) > max_finite) & (master * qf > 0.0f);
  return between | beyond;
}

// The direction in which a stochastic step's rounding of `master` lies from the param qf (toward +inf when
// the master is above it; a NaN master: toward -inf, as torch.where(master > q, inf, -inf) gives).
MPF_HD bool follow_up(float qf, float master) { return master > qf; }

// Whether the master of param q keeps its value (else it takes qf, q widened, which this returns in qf).
template <DType D, bool Stochastic>
MPF_HD bool follow_keeps(uint16_t q, float master, float& qf) {
  qf = Storage<D>::load(q);
  if constexpr (Stochastic)
    return follow_keeps_stochastic<D>(qf, Storage<D>::load(bits_toward<D>(q, follow_up(qf, master))), master);
  else
    return follow_keeps_nearest<D>(qf, master);
}

// The remainder below a BF16 param q after a write: 0 where the pair would be a NaN, else unchanged.
MPF_HD int16_t follow_remainder(uint16_t q, int16_t remainder) {
  const uint32_t mag = q & 0x7fffu;
  const bool nan = ((mag == 0) & (remainder < 0)) | ((mag == kBF16ExpMask) & (remainder > 0));
  return static_cast<int16_t>(static_cast<uint16_t>(select_bits(nan, 0u, static_cast<uint16_t>(remainder))));
}

}  // namespace mpf
