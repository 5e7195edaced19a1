// CUDA backend of the fused optimizer step: unscale + inf-skip + Adam(W)/SGD update of the FP32 master
// (or FP32 param) + store of the low-precision param, in one pass over each element.
//
// One launch covers a param group's tensors on one device (up to kMaxTensors, any sizes; longer lists
// are split by core/multi_tensor_plan.h). The update reads the step count at its start and uses
// step + 1, so the increment must wait for every block: with a counter lent by the caller (OptimArgs::
// counter, zeroed once and left zeroed) the last block of each launch increments the steps of the
// tensors that end in it, so a step is one launch per group; without one, a second small launch after
// the updates increments them. Either way nothing is incremented when found_inf is set.
// Nothing syncs with the host: lr, tensor betas and weight decay, inv_scale, the clip coefficient,
// found_inf and the steps are read on the device, so step() can be captured in a CUDA graph.
// Tensors may have any dense layout (channels_last, ...) as long as a param, its grad, master and state
// share it: the update is element-wise, so each is read as a flat array.
#include <cstdint>
#include <vector>

#include "../core/optim.h"
#include "../kernels.h"
#include "common.cuh"
#include "multi_tensor.cuh"

namespace mpf {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;  // elements per thread per iteration: 16-byte FP32 and 8-byte FP16/BF16 accesses
constexpr int kMaxTensors = static_cast<int>(kCudaOptimLimits.max_tensors);
constexpr int64_t kChunk = kCudaOptimLimits.chunk_size;
constexpr int kMaxSteps = 3900;  // step pointers per increment launch

struct OptimLaunch {
  void* param[kMaxTensors];
  void* grad[kMaxTensors];
  float* master[kMaxTensors];
  float* state0[kMaxTensors];
  float* state1[kMaxTensors];
  float* state2[kMaxTensors];
  float* step[kMaxTensors];
  int64_t numel[kMaxTensors];
  WorkIndex<kMaxTensors> work;
  uint8_t dtype[kMaxTensors];
  uint8_t finishes[kMaxTensors];  // this launch holds the tensor's last chunk: its step is incremented here
};

struct OptimConsts {
  AdamHyper adam;
  SgdHyper sgd;
  HyperRefs hyper;
  double lr;
  const float* lr_ptr;
  const float* inv_scale;
  const float* grad_scale;
  const float* clip_coef;
  const float* clip_sumsq;
  float max_norm;
  const float* found_inf;
  bool write_grad;
  unsigned int* counter;
};
static_assert(kChunk % kVec == 0, "chunks must keep vector alignment");
static_assert(sizeof(OptimLaunch) + sizeof(OptimConsts) <= 32764, "launch arguments exceed 32 KB");

struct StepLaunch {
  float* step[kMaxSteps];
  int32_t n;
};
static_assert(sizeof(StepLaunch) + sizeof(void*) <= 32764, "step launch arguments exceed 32 KB");

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Per-tensor values shared by the block: the update's scalars and whether SGD's buffer is unset.
struct TensorScalars {
  AdamScalars adam;
  AdamRuntimeVariant adam_variant;
  SgdScalars sgd;
  SgdRuntimeVariant sgd_variant;
  bool first_step;
};

template <OptimKind K>
__device__ __forceinline__ void update(float& p, float& s0, float& s1, float& s2, float g, const OptimConsts& c,
                                       const TensorScalars& ts) {
  if constexpr (K == OptimKind::kAdam) adam_update(p, s0, s1, s2, g, ts.adam_variant, ts.adam);
  else sgd_update(p, s0, g, ts.sgd_variant, ts.sgd, ts.first_step);
}

template <DType D, OptimKind K>
__device__ __forceinline__ void process_chunk(const OptimLaunch& a, int slot, int64_t begin, int64_t n,
                                              const OptimConsts& c, const TensorScalars& ts, float gmul,
                                              float clip) {
  using S = Storage<D>;
  using T = typename S::type;
  T* param = static_cast<T*>(a.param[slot]) + begin;
  T* grad = static_cast<T*>(a.grad[slot]) + begin;
  float* master = a.master[slot] ? a.master[slot] + begin : nullptr;
  float* s0 = a.state0[slot] ? a.state0[slot] + begin : nullptr;
  float* s1 = a.state1[slot] ? a.state1[slot] + begin : nullptr;
  float* s2 = a.state2[slot] ? a.state2[slot] + begin : nullptr;
  const bool has_s0 = s0 != nullptr, has_s1 = s1 != nullptr, has_s2 = s2 != nullptr;

  const auto aligned = [](const void* ptr, int bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; };
  const bool vec = aligned(param, sizeof(T) * kVec) && aligned(grad, sizeof(T) * kVec) &&
                   (!master || aligned(master, 16)) && (!has_s0 || aligned(s0, 16)) &&
                   (!has_s1 || aligned(s1, 16)) && (!has_s2 || aligned(s2, 16));
  int64_t head = 0;
  if (vec) {
    head = n / kVec * kVec;
    for (int64_t i = int64_t{threadIdx.x} * kVec; i < head; i += int64_t{kThreads} * kVec) {
      const Pack<T, kVec> gv = *reinterpret_cast<const Pack<T, kVec>*>(grad + i);
      Pack<float, kVec> pv, m0 = {}, m1 = {}, m2 = {};  // absent state stays zero in registers, unused
      if (master) pv = *reinterpret_cast<const Pack<float, kVec>*>(master + i);
      else {
        const Pack<T, kVec> raw = *reinterpret_cast<const Pack<T, kVec>*>(param + i);
#pragma unroll
        for (int e = 0; e < kVec; ++e) pv.v[e] = S::load(raw.v[e]);
      }
      if (has_s0) m0 = *reinterpret_cast<const Pack<float, kVec>*>(s0 + i);
      if (has_s1) m1 = *reinterpret_cast<const Pack<float, kVec>*>(s1 + i);
      if (has_s2) m2 = *reinterpret_cast<const Pack<float, kVec>*>(s2 + i);
      Pack<T, kVec> used;  // the gradient the update used, for write_grad
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float g = fmul(fmul(S::load(gv.v[e]), gmul), clip);
        used.v[e] = S::store(g);
        update<K>(pv.v[e], m0.v[e], m1.v[e], m2.v[e], g, c, ts);
      }
      if (c.write_grad) *reinterpret_cast<Pack<T, kVec>*>(grad + i) = used;
      Pack<T, kVec> out;
#pragma unroll
      for (int e = 0; e < kVec; ++e) out.v[e] = S::store(pv.v[e]);
      *reinterpret_cast<Pack<T, kVec>*>(param + i) = out;
      if (master) *reinterpret_cast<Pack<float, kVec>*>(master + i) = pv;
      if (has_s0) *reinterpret_cast<Pack<float, kVec>*>(s0 + i) = m0;
      if (has_s1) *reinterpret_cast<Pack<float, kVec>*>(s1 + i) = m1;
      if (has_s2) *reinterpret_cast<Pack<float, kVec>*>(s2 + i) = m2;
    }
  }
  for (int64_t i = head + threadIdx.x; i < n; i += kThreads) {
    const float g = fmul(fmul(S::load(grad[i]), gmul), clip);
    if (c.write_grad) grad[i] = S::store(g);
    float p = master ? master[i] : S::load(param[i]);
    float x0 = has_s0 ? s0[i] : 0.f, x1 = has_s1 ? s1[i] : 0.f, x2 = has_s2 ? s2[i] : 0.f;
    update<K>(p, x0, x1, x2, g, c, ts);
    if (has_s0) s0[i] = x0;
    if (has_s1) s1[i] = x1;
    if (has_s2) s2[i] = x2;
    if (master) master[i] = p;
    param[i] = S::store(p);
  }
}

template <OptimKind K>
__device__ __forceinline__ void optim_block(const OptimLaunch& a, const OptimConsts& c) {
  const WorkItem item = a.work.find(blockIdx.x);
  const int slot = item.slot;
  const int64_t begin = item.chunk * kChunk;
  const int64_t n = a.numel[slot] - begin < kChunk ? a.numel[slot] - begin : kChunk;
  const double lr = c.lr_ptr ? static_cast<double>(*c.lr_ptr) : c.lr;
  const float step = a.step[slot] ? *a.step[slot] : 0.f;
  TensorScalars ts;
  if constexpr (K == OptimKind::kAdam) {
    const AdamHyper h = resolve_hyper(c.adam, c.hyper);  // tensor betas are read here, on the device
    ts.adam = adam_scalars(h, lr, static_cast<double>(step) + 1.0);
    ts.adam_variant = adam_variant(h, ts.adam);
  } else {
    const SgdHyper h = resolve_hyper(c.sgd, c.hyper);
    ts.sgd = sgd_scalars(h, lr);
    ts.sgd_variant = sgd_variant(h);
  }
  ts.first_step = step == 0.f;
  const float gmul = unscale_factor(c.inv_scale, c.grad_scale);
  float clip = c.clip_coef ? *c.clip_coef : 1.f;
  if (c.clip_sumsq) clip = fmul(clip, clip_coefficient(*c.clip_sumsq, c.max_norm));
  switch (static_cast<DType>(a.dtype[slot])) {
    case DType::kFloat32: process_chunk<DType::kFloat32, K>(a, slot, begin, n, c, ts, gmul, clip); break;
    case DType::kFloat16: process_chunk<DType::kFloat16, K>(a, slot, begin, n, c, ts, gmul, clip); break;
    case DType::kBFloat16: process_chunk<DType::kBFloat16, K>(a, slot, begin, n, c, ts, gmul, clip); break;
  }
}

template <OptimKind K>
__global__ void __launch_bounds__(kThreads, 2) optim_kernel(const __grid_constant__ OptimLaunch a, const OptimConsts c) {
  if (c.found_inf && *c.found_inf != 0.f) return;  // skipped step: nothing is written, steps included
  optim_block<K>(a, c);
  if (!c.counter) return;  // the steps are incremented by a second launch
  // Every thread of the block has read its step (at the start of optim_block); the last block to get
  // here increments the steps of the tensors that end in this launch, and zeroes the counter again.
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(c.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int s = threadIdx.x; s < a.work.num_slots; s += kThreads)
    if (a.finishes[s] && a.step[s]) *a.step[s] += 1.f;
  if (threadIdx.x == 0) *c.counter = 0u;
}

__global__ void step_increment_kernel(const __grid_constant__ StepLaunch s, const float* found_inf) {
  if (found_inf && *found_inf != 0.f) return;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < s.n; i += gridDim.x * blockDim.x) *s.step[i] += 1.f;
}

}  // namespace

void optim_step_cuda(const OptimArgs& a, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  std::vector<int64_t> numel(static_cast<size_t>(a.num_tensors));
  for (int64_t t = 0; t < a.num_tensors; ++t) numel[t] = a.tensors[t].numel;
  const std::vector<PlanLaunch> plan = plan_multi_tensor(numel.data(), a.num_tensors, kCudaOptimLimits);
  const OptimConsts consts{a.adam,      a.sgd,        a.hyper,    a.lr,        a.lr_ptr,     a.inv_scale, a.grad_scale,
                           a.clip_coef, a.clip_sumsq, a.max_norm, a.found_inf, a.write_grad, a.counter};

  OptimLaunch args;
  for (const PlanLaunch& launch : plan) {
    for (size_t s = 0; s < launch.tensors.size(); ++s) {
      const OptimTensor& t = a.tensors[launch.tensors[s]];
      args.param[s] = t.param;
      args.grad[s] = t.grad;
      args.master[s] = t.master;
      args.state0[s] = t.state0;
      args.state1[s] = t.state1;
      args.state2[s] = t.state2;
      args.step[s] = t.step;
      args.numel[s] = t.numel;
      args.dtype[s] = static_cast<uint8_t>(t.dtype);
      args.finishes[s] = 0;
    }
    for (const PlanItem& it : launch.items) {  // the launch holding a tensor's last chunk finishes it
      const int64_t n = args.numel[it.slot];
      if (it.chunk == (n + kChunk - 1) / kChunk - 1) args.finishes[it.slot] = 1;
    }
    const int items = args.work.fill(launch);
    if (a.kind == OptimKind::kAdam) optim_kernel<OptimKind::kAdam><<<items, kThreads, 0, stream>>>(args, consts);
    else optim_kernel<OptimKind::kSgd><<<items, kThreads, 0, stream>>>(args, consts);
    cuda_check(cudaGetLastError(), "launching the optimizer kernel");
  }

  if (a.counter) return;  // the update launches' last blocks incremented the steps
  // After every update block has read its step: increment the counters (unless the step was skipped).
  StepLaunch steps;
  steps.n = 0;
  auto flush = [&]() {
    if (steps.n == 0) return;
    step_increment_kernel<<<(steps.n + 255) / 256, 256, 0, stream>>>(steps, a.found_inf);
    cuda_check(cudaGetLastError(), "launching the step increment");
    steps.n = 0;
  };
  for (int64_t t = 0; t < a.num_tensors; ++t) {
    if (!a.tensors[t].step) continue;
    if (steps.n == kMaxSteps) flush();
    steps.step[steps.n++] = a.tensors[t].step;
  }
  flush();
}

}  // namespace mpf
