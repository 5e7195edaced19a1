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
uint32_t element_address(const Desc& d, bool mn_major, int row, int k) {
  const uint32_t off = mn_major ? static_cast<uint32_t>(row % 64 * 2 + row / 64 * d.lbo + k % 8 * 128 + k / 8 * d.sbo)
                                : static_cast<uint32_t>(row % 8 * 128 + row / 8 * d.sbo + k * 2);
  const uint32_t a = d.start + off;
  return a ^ (((a >> 7) & 7u) << 4);
}

float element(const Desc& d, bool mn_major, int row, int k, bool bf16, uint64_t& hash) {
  const unsigned char* p = shared_at(element_address(d, mn_major, row, k), 2);
  const uint16_t bits = static_cast<uint16_t>(p[0] | (p[1] << 8));
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

}  // namespace

uint64_t wgmma_operands(float* d, int n, uint64_t desc_a, uint64_t desc_b, int trans_a, int trans_b, bool bf16, unsigned t) {
  if (n < 8 || n > 256 || n % 8 != 0) trap("wgmma: N must be a multiple of 8 from 8 to 256");
  const Desc da = decode(desc_a), db = decode(desc_b);
  uint64_t hash = 0xcbf29ce484222325ull;
  const int warp = static_cast<int>(t / 32), lane = static_cast<int>(t % 32);
  for (int i = 0; i < n / 2; ++i) {
    const int row = 16 * warp + lane / 4 + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
    float sum = d ? d[i] : 0.0f;
    for (int k = 0; k < 16; ++k)
      sum += element(da, trans_a != 0, row, k, bf16, hash) * element(db, trans_b != 0, col, k, bf16, hash);
    if (d) d[i] = sum;
  }
  return hash;
}

}  // namespace mpf_sim
