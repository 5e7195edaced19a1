// Run-time choice of the CPU code path. The hot CPU loops (overflow_impl.inc, optim_impl.inc,
// gemm_impl.inc) are compiled up to three times from the same source by isa_clones.inc: baseline
// x86-64 ("scalar"), AVX2+FMA+F16C ("avx2") and AVX-512F/BW/VL/DQ with FMA+F16C and 512-bit vectors
// ("avx512"). cpu_isa() picks one path for every CPU kernel: the best the CPU supports, or the one
// named by the environment variable MPFUSED_CPU_ISA (scalar|avx2|avx512|auto), read once.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#define MPF_HAVE_AVX2_CLONES 1
#define MPF_HAVE_AVX512_CLONES 1
#else
#define MPF_HAVE_AVX2_CLONES 0
#define MPF_HAVE_AVX512_CLONES 0
#endif

#if MPF_HAVE_AVX2_CLONES
// The explicit intrinsics of the avx2 and avx512 clones. GCC 12 reports thousands of false
// -Wmaybe-uninitialized and -Wuninitialized warnings inside its own AVX-512 headers (their "undefined"
// source operands, declared as `__m512i __Y = __Y;`), located in the headers: ignored there only, so
// that the build log shows the warnings about our code.
#pragma GCC diagnostic push
#if !defined(__clang__)  // (clang has no such warning group, and would warn about the name)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace mpf {

enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr int kNumCpuIsa = 3;

inline const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// Whether this build has the path and this CPU can run it.
inline bool cpu_supports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2:
#if MPF_HAVE_AVX2_CLONES
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
      return false;
#endif
    case CpuIsa::kAvx512:
#if MPF_HAVE_AVX512_CLONES
      return cpu_supports(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
      return false;
#endif
  }
  return false;
}

// "scalar, avx2" (best last): the paths MPFUSED_CPU_ISA may name on this machine.
inline std::string cpu_supported_isas() {
  std::string s;
  for (int i = 0; i < kNumCpuIsa; ++i)
    if (cpu_supports(static_cast<CpuIsa>(i))) s += std::string(s.empty() ? "" : ", ") + cpu_isa_name(static_cast<CpuIsa>(i));
  return s;
}

// The path named by `value` (nullptr, "" or "auto": the best supported). Throws std::invalid_argument
// naming the variable, the value and the supported paths for an unknown or unsupported value.
inline CpuIsa parse_cpu_isa(const char* value) {
  const std::string v = value ? value : "";
  if (v.empty() || v == "auto") {
    for (int i = kNumCpuIsa - 1; i > 0; --i)
      if (cpu_supports(static_cast<CpuIsa>(i))) return static_cast<CpuIsa>(i);
    return CpuIsa::kScalar;
  }
  for (int i = 0; i < kNumCpuIsa; ++i) {
    const CpuIsa isa = static_cast<CpuIsa>(i);
    if (v != cpu_isa_name(isa)) continue;
    if (cpu_supports(isa)) return isa;
    throw std::invalid_argument("MPFUSED_CPU_ISA='" + v + "': this CPU does not support the " + v +
                                " path; supported here: " + cpu_supported_isas() + " (or auto)");
  }
  throw std::invalid_argument("MPFUSED_CPU_ISA='" + v + "' is not a CPU path; expected one of auto, scalar, avx2, avx512"
                              " (supported here: " + cpu_supported_isas() + ")");
}

// Threads worth waking for `total` elements: at least `grain` elements each (a small list is not worth
// waking, or waiting for, a team; a busy core would stall every call), at most num_threads.
inline int cpu_threads(int num_threads, int64_t total, int64_t grain) {
  const int64_t by_work = total / grain;
  return static_cast<int>(by_work < 1 ? 1 : by_work < num_threads ? by_work : (num_threads < 1 ? 1 : num_threads));
}

// body(i) for i in [0, n), on `threads` OpenMP threads (static schedule). With one thread, a plain loop: an
// OpenMP region whose if() clause is false still starts and ends a team of one in libgomp, and the team's
// barrier makes a futex system call (one per optimizer step, measured with strace), which a small step
// must not pay.
template <class F>
inline void parallel_for(int64_t n, int threads, F&& body) {
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) body(i);
}

// body(begin, end) over [0, n) cut into one contiguous range per thread: for what a thread carries from one
// index to the next (the stochastic step's last Philox block). One thread: body(0, n), no OpenMP region.
template <class F>
inline void parallel_ranges(int64_t n, int threads, F&& body) {
  if (n <= 0) return;
  if (threads <= 1 || n == 1) {
    body(int64_t{0}, n);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int r = 0; r < threads; ++r) {
    const int64_t begin = n * r / threads, end = n * (r + 1) / threads;
    if (begin < end) body(begin, end);
  }
}

// The path every CPU kernel uses, chosen once from MPFUSED_CPU_ISA (a bad value throws on every call).
inline CpuIsa cpu_isa() {
  static const CpuIsa isa = parse_cpu_isa(std::getenv("MPFUSED_CPU_ISA"));
  return isa;
}

}  // namespace mpf

// Calls NS::call for the namespace of the selected path (the clones isa_clones.inc compiled).
#if MPF_HAVE_AVX512_CLONES
#define MPF_CPU_DISPATCH(call)                                 \
  do {                                                         \
    switch (::mpf::cpu_isa()) {                                \
      case ::mpf::CpuIsa::kAvx512: return avx512::call;        \
      case ::mpf::CpuIsa::kAvx2: return avx2::call;            \
      default: return baseline::call;                          \
    }                                                          \
  } while (0)
#else
#define MPF_CPU_DISPATCH(call) return baseline::call
#endif
