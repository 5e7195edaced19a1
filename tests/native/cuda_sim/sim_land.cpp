// Where a cp.async copy lands (sim.h), and the garbage its destination holds until then: 16 bytes of shared memory, the first src_bytes from global memory and the
// rest zero; and what a wgmma.mma_async reads of shared memory and computes. In a file of its own so that
// ThreadSanitizer sees the copy and the MMA's reads as the issuing thread's accesses (sim.cpp, the scheduler, is
// not instrumented).
#include "sim.h"

#include <cstring>

namespace mpf_sim {

void land_copy16(void* dst, const void* src, int src_bytes) {
  unsigned char* d = static_cast<unsigned char*>(dst);
  const unsigned char* s = static_cast<const unsigned char*>(src);
  // compute-sanitizer's memcheck takes a cp.async of cp-size 16 for a 16-byte read of its source whatever its
  // src-size: on an H200 it reported the GEMM's zero-filled tails (src-size 2 at the last element of an
  // operand) as reads past the allocation. So the simulator reads all 16 bytes, and AddressSanitizer reports
  // what memcheck would.
  unsigned char window[16];
  std::memcpy(window, s, 16);
  for (int i = 0; i < 16; ++i) d[i] = i < src_bytes ? window[i] : 0;
}

void land_poison16(void* dst) {
  unsigned char* d = static_cast<unsigned char*>(dst);
  for (int i = 0; i < 16; ++i) d[i] = 0xff;
}

void land_poison(unsigned char* dst, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) dst[i] = 0xff;
}

// A TMA box, element by element: box row (i1, i2) is one 128-byte line, its 16-byte chunks swizzled with the
// line's index mod 8 (the 128-byte swizzle over a 1024-byte aligned destination). Elements outside the map's
// extents are zeros and are not read.
void land_tma_box(unsigned char* dst, const TmaBox& b) {
  const size_t es = b.strides[0];
  for (uint32_t i2 = 0; i2 < b.box[2]; ++i2)
    for (uint32_t i1 = 0; i1 < b.box[1]; ++i1)
      for (uint32_t i0 = 0; i0 < b.box[0]; ++i0) {
        const int64_t x[3] = {int64_t{b.coord[0]} + i0, int64_t{b.coord[1]} + i1, int64_t{b.coord[2]} + i2};
        const bool inside = x[0] >= 0 && x[1] >= 0 && x[2] >= 0 && static_cast<uint64_t>(x[0]) < b.dims[0] &&
                            static_cast<uint64_t>(x[1]) < b.dims[1] && static_cast<uint64_t>(x[2]) < b.dims[2];
        const size_t off = ((size_t{i2} * b.box[1] + i1) * b.box[0] + i0) * es;
        const size_t to = off ^ (((off >> 7) & 7u) << 4);
        if (inside)
          std::memcpy(dst + to, b.base + x[0] * b.strides[0] + x[1] * b.strides[1] + x[2] * b.strides[2], es);
        else
          std::memset(dst + to, 0, es);
      }
}

namespace {

// A shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride
// dimension byte offsets, base offset, swizzle mode.
struct Desc {
  uint32_t start, lbo, sbo;
};
Desc decode(uint64_t d) {
  if ((d >> 62) != 1) trap("wgmma: a descriptor without the 128-byte swizzle (the only mode simulated)");
  if (((d >> 49) & 7u) != 0) trap("wgmma: a descriptor with a base offset (the simulator models tiles on 1024-byte boundaries)");
  return Desc{static_cast<uint32_t>(d & 0x3FFFu) << 4, static_cast<uint32_t>((d >> 16) & 0x3FFFu) << 4,
              static_cast<uint32_t>((d >> 32) & 0x3FFFu) << 4};
}

// The shared address of element (row, k) of an operand: row along M (A) or N (B), k along K; the canonical
// layouts of the 128-byte swizzle for 16-bit elements: K-major ((8, m), (8, 2k)) : ((64, SBO), (1, 8)), MN-major
// ((8, 8, m), (8, k)) : ((1, 8, LBO), (64, SBO)) in elements, then bits [4, 7) of the address XORed with [7, 10).
// (Not watched by ThreadSanitizer, as `multiply` below: they touch only the thread's own values.)
__attribute__((no_sanitize("thread"))) uint32_t element_address(const Desc& d, bool mn_major, int row, int k) {
  const uint32_t off = mn_major ? static_cast<uint32_t>(row % 64 * 2 + row / 64 * d.lbo + k % 8 * 128 + k / 8 * d.sbo)
                                : static_cast<uint32_t>(row % 8 * 128 + row / 8 * d.sbo + k * 2);
  const uint32_t a = d.start + off;
  return a ^ (((a >> 7) & 7u) << 4);
}

__attribute__((no_sanitize("thread"))) float widen(uint16_t bits, bool bf16, uint64_t& hash) {
  hash = (hash ^ bits) * 0x100000001b3ull;  // FNV-1a over the values in the order read
  uint32_t u;
  if (bf16) {
    u = static_cast<uint32_t>(bits) << 16;
  } else {  // FP16 -> FP32, exactly
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16, e = (bits >> 10) & 0x1Fu, m = bits & 0x3FFu;
    if (e == 0x1F) {
      u = sign | 0x7F800000u | (m << 13);
    } else if (e != 0) {
      u = sign | ((e + 112) << 23) | (m << 13);
    } else {
      float f = static_cast<float>(m) * 0x1p-24f;
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The 16 elements k = 0..15 of one row of an operand. K-major, they are two 16-byte chunks (the swizzle moves
// whole chunks), read as such; MN-major, 16 elements 128 bytes apart, read one by one. (Read as the hardware
// would, in as few accesses as the layout allows: under ThreadSanitizer each access costs far more than the
// arithmetic.)
void operand_row(const Desc& d, bool mn_major, int row, bool bf16, uint64_t& hash, float out[16]) {
  uint16_t bits[16];  // (the simulated host is little-endian, as the device)
  if (mn_major) {
    for (int k = 0; k < 16; ++k) std::memcpy(&bits[k], shared_at(element_address(d, true, row, k), 2), 2);
  } else {
    std::memcpy(&bits[0], shared_at(element_address(d, false, row, 0), 16), 16);
    std::memcpy(&bits[8], shared_at(element_address(d, false, row, 8), 16), 16);
  }
  for (int k = 0; k < 16; ++k) out[k] = widen(bits[k], bf16, hash);
}

// The thread's n/2 accumulators from its operand values: on its own registers (the arrays here), which
// ThreadSanitizer need not watch (it would, as they escaped into operand_row, and take longer than the reads).
__attribute__((no_sanitize("thread"))) void multiply(float* d, int n, const float (*a)[16], const float (*b)[16]) {
  for (int i = 0; i < n / 2; ++i) {
    const float* ar = a[(i / 2) % 2];
    const float* bc = b[(i / 4) * 2 + i % 2];
    float sum = d[i];
    for (int k = 0; k < 16; ++k) sum += ar[k] * bc[k];
    d[i] = sum;
  }
}

}  // namespace

uint64_t wgmma_operands(float* d, int n, uint64_t desc_a, uint64_t desc_b, int trans_a, int trans_b, bool bf16, unsigned t) {
  if (n < 8 || n > 256 || n % 8 != 0) trap("wgmma: N must be a multiple of 8 from 8 to 256");
  const Desc da = decode(desc_a), db = decode(desc_b);
  uint64_t hash = 0xcbf29ce484222325ull;
  const int warp = static_cast<int>(t / 32), lane = static_cast<int>(t % 32);
  // The thread's accumulators i in [0, n/2) lie in 2 rows of A (16 warp + lane/4, 8 more) and n/4 columns of B
  // (8 (i/4) + 2 (lane%4) + i%2): each of those operand elements is read once, then multiplied out of registers.
  // (Reading them once per product, 4 times as many reads, made the Hopper kernel's sanitizer runs 4 times slower
  // for the same accesses.)
  float a[2][16], b[64][16];
  for (int r = 0; r < 2; ++r) operand_row(da, trans_a != 0, 16 * warp + lane / 4 + 8 * r, bf16, hash, a[r]);
  for (int c = 0; c < n / 4; ++c) operand_row(db, trans_b != 0, 8 * (c / 2) + 2 * (lane % 4) + c % 2, bf16, hash, b[c]);
  if (d) multiply(d, n, a, b);
  return hash;
}

}  // namespace mpf_sim
