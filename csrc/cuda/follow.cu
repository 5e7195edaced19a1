// CUDA backend of following a write from outside the optimizer step (core/follow.h).
//
// One launch covers a list of followed params of both 16-bit dtypes, each with its FP32 master or its BF16
// remainder (up to kMaxTensors; a longer list is split on the host by core/multi_tensor_plan.h). Each block
// owns one (tensor, chunk) work item (cuda/multi_tensor.cuh). A thread judges eight elements at a time, read
// with 16-byte loads where the param and its master (or remainder) allow them, and stores the eight only
// where one of them changes: a write that changed nothing costs the masters no write.
#include <cstdint>
#include <cstring>
#include <vector>

#include "../kernels.h"
#include "common.cuh"
#include "multi_tensor.cuh"

namespace mpf {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxTensors = static_cast<int>(kCudaFollowLimits.max_tensors);
constexpr int64_t kChunk = kCudaFollowLimits.chunk_size;

enum class FollowKind : uint8_t { kF16Master = 0, kBF16Master = 1, kRemainder = 2 };

struct FollowLaunch {
  const void* param[kMaxTensors];
  void* target[kMaxTensors];  // the master (float) or the remainder (int16)
  int64_t numel[kMaxTensors];
  WorkIndex<kMaxTensors> work;
  uint8_t kind[kMaxTensors];
};
static_assert(kChunk % 8 == 0, "chunks keep 16-byte alignment");
static_assert(sizeof(FollowLaunch) <= 32764, "launch arguments exceed 32 KB");

// Eight elements at a time where the param and its target (master or remainder, T) allow 16-byte accesses:
// eight(q16, t) judges the eight 16-bit params q16 (four words) and their targets t (16 bytes of T, in place)
// and returns whether any changed; one(q, t) judges one element (the rest, or all of an unaligned chunk).
template <class T, class Eight, class One>
__device__ __forceinline__ void follow_chunk(const uint16_t* __restrict__ q, T* __restrict__ target, int64_t n,
                                             Eight eight, One one) {
  constexpr int kVecs = 8 * sizeof(T) / 16;  // 16-byte vectors of the target per eight elements
  int64_t head = 0;
  if ((reinterpret_cast<uintptr_t>(q) & 15) == 0 && (reinterpret_cast<uintptr_t>(target) & 15) == 0) {
    const int64_t nvec = n / 8;
    head = nvec * 8;
    for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
      const uint4 qv = reinterpret_cast<const uint4*>(q)[i];
      uint4* tp = reinterpret_cast<uint4*>(target) + kVecs * i;
      uint4 raw[kVecs];
#pragma unroll
      for (int v = 0; v < kVecs; ++v) raw[v] = tp[v];
      T t[8];
      memcpy(t, raw, sizeof(t));  // (registers: no copy is made)
      const uint32_t qw[4] = {qv.x, qv.y, qv.z, qv.w};
      if (eight(qw, t)) {
        memcpy(raw, t, sizeof(t));
#pragma unroll
        for (int v = 0; v < kVecs; ++v) tp[v] = raw[v];
      }
    }
  }
  for (int64_t i = head + threadIdx.x; i < n; i += kThreads) one(q[i], target[i]);
}

template <DType D, bool S>
__device__ __forceinline__ void master_chunk(const uint16_t* __restrict__ q, float* __restrict__ master, int64_t n) {
  follow_chunk(
      q, master, n,
      [](const uint32_t* qw, float* m) {
        bool changed = false;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          float qf;
          if (!follow_keeps<D, S>(static_cast<uint16_t>(qw[k / 2] >> (16 * (k % 2))), m[k], qf)) {
            m[k] = qf;
            changed = true;
          }
        }
        return changed;
      },
      [](uint16_t h, float& m) {
        float qf;
        if (!follow_keeps<D, S>(h, m, qf)) m = qf;
      });
}

__device__ __forceinline__ void remainder_chunk(const uint16_t* __restrict__ q, int16_t* __restrict__ rem, int64_t n) {
  follow_chunk(
      q, rem, n,
      [](const uint32_t* qw, int16_t* r) {
        bool changed = false;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int16_t f = follow_remainder(static_cast<uint16_t>(qw[k / 2] >> (16 * (k % 2))), r[k]);
          changed |= f != r[k];
          r[k] = f;
        }
        return changed;
      },
      [](uint16_t h, int16_t& r) {
        const int16_t f = follow_remainder(h, r);
        if (f != r) r = f;
      });
}

template <bool S>
__global__ void __launch_bounds__(kThreads) follow_kernel(const __grid_constant__ FollowLaunch args) {
  const WorkItem item = args.work.find(blockIdx.x);
  const int slot = item.slot;
  const int64_t begin = item.chunk * kChunk;
  const int64_t numel = args.numel[slot];
  const int64_t n = numel - begin < kChunk ? numel - begin : kChunk;
  const uint16_t* q = static_cast<const uint16_t*>(args.param[slot]) + begin;
  switch (static_cast<FollowKind>(args.kind[slot])) {  // uniform per block
    case FollowKind::kF16Master:
      master_chunk<DType::kFloat16, S>(q, static_cast<float*>(args.target[slot]) + begin, n);
      break;
    case FollowKind::kBF16Master:
      master_chunk<DType::kBFloat16, S>(q, static_cast<float*>(args.target[slot]) + begin, n);
      break;
    case FollowKind::kRemainder:
      remainder_chunk(q, static_cast<int16_t*>(args.target[slot]) + begin, n);
      break;
  }
}

}  // namespace

void follow_writes_cuda(const FollowArgs& a, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  std::vector<int64_t> numel(static_cast<size_t>(a.num_tensors));
  for (int64_t t = 0; t < a.num_tensors; ++t) numel[static_cast<size_t>(t)] = a.tensors[t].numel;
  const std::vector<PlanLaunch> plan = plan_multi_tensor(numel.data(), a.num_tensors, kCudaFollowLimits);
  if (plan.empty()) return;
  require_large_kernel_params();
  FollowLaunch args;  // ~17 KB: filled per launch, copied into the parameter space by the launch
  for (const PlanLaunch& launch : plan) {
    for (size_t s = 0; s < launch.tensors.size(); ++s) {
      const FollowTensor& t = a.tensors[launch.tensors[s]];
      args.param[s] = t.param;
      args.target[s] = t.remainder ? static_cast<void*>(t.remainder) : static_cast<void*>(t.master);
      args.numel[s] = t.numel;
      args.kind[s] = static_cast<uint8_t>(t.remainder ? FollowKind::kRemainder
                                          : t.dtype == DType::kFloat16 ? FollowKind::kF16Master
                                                                       : FollowKind::kBF16Master);
    }
    const int items = args.work.fill(launch);
    if (a.stochastic) follow_kernel<true><<<items, kThreads, 0, stream>>>(args);
    else follow_kernel<false><<<items, kThreads, 0, stream>>>(args);
    cuda_check(cudaGetLastError(), "launching the follow kernel");
  }
}

}  // namespace mpf
