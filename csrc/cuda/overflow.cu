// CUDA backend of the multi-tensor overflow reduction.
//
// One launch covers a whole list of tensors of mixed dtypes and any sizes (up to kMaxTensors tensors,
// what fits in the 32 KB parameter space of CUDA >= 12.1); a longer list is split on the host by
// core/multi_tensor_plan.h. Each block owns one (tensor, chunk) work item, found by a binary search of
// its block index in the launch's per-tensor prefix of first blocks (cuda/multi_tensor.cuh), and reads
// it with 16-byte loads when the data is aligned. The dtype is per tensor, so the branch is uniform.
//
// Sum of squares: each block writes its partial to scratch; the last block to finish (a counter
// incremented after a fence) adds the partials in block order in FP64 and does *sumsq += total. The
// result is deterministic, with no second kernel. found_inf is written as 1.0f by any block that saw a
// non-finite value (a benign race: every writer stores the same value).
//
// Overwrite mode (the scaler's sync-free iteration): found_inf, sumsq and the norm are this call's result
// alone, so the caller needs no zero-filled tensors: blocks leave per-block flags, and the last block
// writes found_inf (0 or 1), sumsq and sqrt(sumsq). With a counter lent by the caller (zeroed once, and
// zeroed again by every last block) the call is exactly one launch per list: no memset, no fill, no
// sqrt kernel.
#include <cstdint>
#include <vector>

#include "../core/overflow.h"
#include "../core/dispatch.h"
#include "../kernels.h"
#include "common.cuh"
#include "multi_tensor.cuh"

namespace mpf {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kMaxTensors = static_cast<int>(kCudaOverflowLimits.max_tensors);
constexpr int64_t kChunk = kCudaOverflowLimits.chunk_size;

// Where a launch stands in the call: overwrite mode starts found_inf and sumsq from zero in the first
// launch; the norm is written by the last.
struct LaunchRole {
  bool overwrite, first, final;
};

struct OverflowLaunch {
  void* ptr[kMaxTensors];
  int64_t numel[kMaxTensors];
  WorkIndex<kMaxTensors> work;
  uint8_t dtype[kMaxTensors];
};
static_assert(kChunk % 8 == 0, "chunks must keep 16-byte alignment of 2-byte data");
// 32764 bytes is the CUDA >= 12.1 limit for all kernel parameters together; the five pointers follow.
static_assert(sizeof(OverflowLaunch) + 7 * sizeof(void*) + sizeof(LaunchRole) <= 32764, "launch arguments exceed 32 KB");

template <DType D, class Mode>
__device__ __forceinline__ void process_chunk(void* base, int64_t n, float inv_scale, uint32_t& bad, float& acc) {
  using T = typename Storage<D>::type;
  using V = Vec16<T>;
  T* p = static_cast<T*>(base);
  int64_t head = 0;  // elements covered by the vector loop
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    V* vp = reinterpret_cast<V*>(p);
    const int64_t nvec = n / V::N;
    head = nvec * V::N;
    for (int64_t i0 = threadIdx.x; i0 < nvec; i0 += int64_t{kThreads} * kUnroll) {
      V r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t{u} * kThreads;
        if (i < nvec) r[u] = vp[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t{u} * kThreads;
        if (i < nvec) {
#pragma unroll
          for (int e = 0; e < V::N; ++e) overflow_step<D, Mode>(r[u].v[e], inv_scale, bad, acc);
          if (Mode::kUnscale) vp[i] = r[u];
        }
      }
    }
  }
  for (int64_t i = head + threadIdx.x; i < n; i += kThreads) overflow_step<D, Mode>(p[i], inv_scale, bad, acc);
}

// At least 2 blocks per SM: lets ptxas use up to 128 registers (without it, sm_75 capped the kernel at
// 64 and spilled).
template <class Mode>
__global__ void __launch_bounds__(kThreads, 2)
    overflow_kernel(const __grid_constant__ OverflowLaunch args, float* found_inf, const float* inv_scale_ptr,
                    float* sumsq, float* norm, float* partials, unsigned int* flags, unsigned int* counter,
                    LaunchRole role) {
  const WorkItem item = args.work.find(blockIdx.x);
  const int slot = item.slot;
  const int64_t begin = item.chunk * kChunk;
  const int64_t numel = args.numel[slot];
  const int64_t n = numel - begin < kChunk ? numel - begin : kChunk;
  const float inv_scale = Mode::kScale ? *inv_scale_ptr : 1.f;
  uint32_t bad = 0;
  float acc = 0.f;
  dispatch_dtype(static_cast<DType>(args.dtype[slot]), [&](auto d) {
    using T = typename Storage<decltype(d)::value>::type;
    process_chunk<decltype(d)::value, Mode>(static_cast<T*>(args.ptr[slot]) + begin, n, inv_scale, bad, acc);
  });
  const bool any_bad = __syncthreads_or(bad) != 0;
  if (!role.overwrite && any_bad && threadIdx.x == 0) *found_inf = 1.0f;  // a benign race: all store 1.0
  if (!Mode::kSumsq && !role.overwrite) return;

  // The last block to finish reduces what the blocks left in scratch: per-block partial sums of squares
  // and, in overwrite mode, per-block flags.
  __shared__ bool is_last;
  float block_total = 0.f;
  if constexpr (Mode::kSumsq) block_total = block_sum<float, kThreads>(acc);
  if (threadIdx.x == 0) {
    if constexpr (Mode::kSumsq) partials[blockIdx.x] = block_total;
    if (role.overwrite) flags[blockIdx.x] = any_bad ? 1u : 0u;
    is_last = arrive_last(counter);  // after the partial and the flag are published
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();  // acquire side: order the reads of the partials after the counter
  if constexpr (Mode::kSumsq) {
    double d = 0.0;
    for (unsigned i = threadIdx.x; i < gridDim.x; i += kThreads) d += static_cast<double>(__ldcg(partials + i));
    d = block_sum<double, kThreads>(d);
    if (threadIdx.x == 0) {
      const float before = role.overwrite && role.first ? 0.f : *sumsq;
      const float total = before + static_cast<float>(d);
      *sumsq = total;
      if (norm && role.final) *norm = __fsqrt_rn(total);
    }
  }
  if (role.overwrite) {
    unsigned any = 0;
    for (unsigned i = threadIdx.x; i < gridDim.x; i += kThreads) any |= __ldcg(flags + i);
    any = __syncthreads_or(any);
    if (threadIdx.x == 0) {
      if (any) *found_inf = 1.0f;
      else if (role.first) *found_inf = 0.0f;
    }
  }
  if (threadIdx.x == 0) *counter = 0u;  // zeroed again for the next launch on the stream
}

// The norm of a call that checks no element (every tensor empty) and accumulates: sqrt(*sumsq) of the sum
// as it stands, as the call's contract says (OverflowArgs::norm).
__global__ void norm_kernel(const float* sumsq, float* norm) { *norm = __fsqrt_rn(*sumsq); }

}  // namespace

void overflow_check_cuda(const OverflowArgs& a, const ScratchAllocator& scratch, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  std::vector<int64_t> numel(static_cast<size_t>(a.num_tensors));
  for (int64_t t = 0; t < a.num_tensors; ++t) numel[t] = a.tensors[t].numel;
  const std::vector<PlanLaunch> plan = plan_multi_tensor(numel.data(), a.num_tensors, kCudaOverflowLimits);
  if (!plan.empty()) require_large_kernel_params();
  if (plan.empty()) {
    if (a.overwrite) {  // nothing to check: found_inf, sumsq and the norm are zero
      cuda_check(cudaMemsetAsync(a.found_inf, 0, sizeof(float), stream), "zeroing found_inf");
      if (a.sumsq) cuda_check(cudaMemsetAsync(a.sumsq, 0, sizeof(float), stream), "zeroing sumsq");
      if (a.norm && a.sumsq) cuda_check(cudaMemsetAsync(a.norm, 0, sizeof(float), stream), "zeroing norm");
    } else if (a.norm && a.sumsq) {
      norm_kernel<<<1, 1, 0, stream>>>(a.sumsq, a.norm);
      cuda_check(cudaGetLastError(), "launching the norm kernel");
    }
    return;
  }

  // Scratch for the last-block reduction: per-block partials and flags, and (unless the caller lends
  // a zeroed counter that the kernel leaves zeroed) one counter per launch, zeroed by a memset.
  float* partials = nullptr;
  unsigned int* flags = nullptr;
  unsigned int* counters = nullptr;
  const bool reduce = a.sumsq != nullptr || a.overwrite;
  if (reduce) {
    const int64_t items = plan_total_items(plan);
    const int64_t launches = static_cast<int64_t>(plan.size());
    const int64_t own_counters = a.counter ? 0 : launches;
    char* ws = static_cast<char*>(scratch.alloc(scratch.ctx, items * int64_t{sizeof(float) + sizeof(unsigned)} +
                                                                own_counters * int64_t{sizeof(unsigned)}));
    partials = reinterpret_cast<float*>(ws);
    flags = reinterpret_cast<unsigned int*>(partials + items);
    if (own_counters) {
      counters = flags + items;
      cuda_check(cudaMemsetAsync(counters, 0, own_counters * sizeof(unsigned), stream), "zeroing reduction counters");
    }
  }

  OverflowLaunch args;  // ~32 KB: filled per launch, copied into the parameter space by the launch
  int64_t item_offset = 0;
  for (size_t l = 0; l < plan.size(); ++l) {
    const PlanLaunch& launch = plan[l];
    for (size_t s = 0; s < launch.tensors.size(); ++s) {
      const TensorRef& t = a.tensors[launch.tensors[s]];
      args.ptr[s] = t.data;
      args.numel[s] = t.numel;
      args.dtype[s] = static_cast<uint8_t>(t.dtype);
    }
    const int items = args.work.fill(launch);
    float* launch_partials = partials ? partials + item_offset : nullptr;
    unsigned int* launch_flags = flags ? flags + item_offset : nullptr;
    unsigned int* launch_counter = !reduce ? nullptr : a.counter ? a.counter : counters + l;
    const LaunchRole role{a.overwrite, l == 0, l + 1 == plan.size()};
    dispatch_overflow_mode(a.inv_scale != nullptr, a.unscale, a.sumsq != nullptr, [&](auto mode) {
      overflow_kernel<decltype(mode)><<<items, kThreads, 0, stream>>>(
          args, a.found_inf, a.inv_scale, a.sumsq, a.sumsq ? a.norm : nullptr, launch_partials, launch_flags,
          launch_counter, role);
    });
    cuda_check(cudaGetLastError(), "launching the overflow kernel");
    item_offset += items;
  }
}

int cuda_runtime_version_compiled() { return CUDART_VERSION; }

}  // namespace mpf
