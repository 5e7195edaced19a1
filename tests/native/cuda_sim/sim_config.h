// The CUDA simulator's device settings and counters, for the tests that drive it (sim.h has the rest and
// is included only by the simulated .cu sources).
#pragma once

#include <cstddef>

namespace mpf_sim {

// The simulated device. Tests may change it between launches.
struct Config {
  int sms = 2;                 // multiprocessors: few, so that grid-stride loops loop
  int cc_major = 9, cc_minor = 0;
  int driver_version = 13000;  // cudaDriverGetVersion
  size_t static_smem_limit = 48 * 1024;
  size_t dynamic_smem_default = 48 * 1024;
  size_t smem_optin_limit = 227 * 1024;  // per block, static + dynamic (sm_90; sm_80: 163 KB, sm_75: 64 KB)
  bool shuffle_blocks = true;
  unsigned max_grid_y = 65535;      // grid.y and grid.z limit (cudaDevAttrMaxGridDimY); lower it to have kernels loop
  bool refuse_tensor_maps = false;  // cuTensorMapEncodeTiled returns CUDA_ERROR_INVALID_VALUE (as a driver may)
  int func_regs = 168;              // cudaFuncGetAttributes' numRegs, of every kernel (what ptxas gives the Hopper GEMM)
};
Config& config();

// Counts of what ran, for tests that check launch counts.
struct Stats {
  long launches = 0, blocks = 0;
  size_t last_dynamic_smem = 0;  // of the last launch that ran: tells the GEMM's kernels apart
};
Stats& stats();

// cudaError_t values (sim.h), for the tests that do not include it.
constexpr int kErrorInvalidValue = 1;
constexpr int kErrorInvalidConfiguration = 9;
constexpr int kErrorLaunchFailure = 719;

}  // namespace mpf_sim
