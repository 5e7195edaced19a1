// Where a cp.async copy lands (sim.h), and the garbage its destination holds until then: 16 bytes of shared memory, the first src_bytes from global memory and the
// rest zero. In a file of its own so that ThreadSanitizer sees the copy as the issuing thread's accesses (sim.cpp,
// the scheduler, is not instrumented).
#include "sim.h"

namespace mpf_sim {

void land_copy16(void* dst, const void* src, int src_bytes) {
  unsigned char* d = static_cast<unsigned char*>(dst);
  const unsigned char* s = static_cast<const unsigned char*>(src);
  for (int i = 0; i < 16; ++i) d[i] = i < src_bytes ? s[i] : 0;
}

void land_poison16(void* dst) {
  unsigned char* d = static_cast<unsigned char*>(dst);
  for (int i = 0; i < 16; ++i) d[i] = 0xff;
}

}  // namespace mpf_sim
