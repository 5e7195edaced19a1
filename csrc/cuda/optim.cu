// CUDA backend of the fused optimizer step: the generic multi-tensor driver that applies any policy of
// core/optim/ (unscale + inf-skip + update of the FP32 master or FP32 param and the states + store of the
// param in its dtype), in one pass over each element; two for policies with a per-tensor reduction.
//
// One launch covers a param group's tensors on one device (up to kMaxTensors, any sizes; longer lists
// are split by core/multi_tensor_plan.h). The update reads the step count at its start and uses
// step + 1, so the increment must wait for every block: with a counter lent by the caller (OptimArgs::
// counter, zeroed once and left zeroed) the last block of each launch increments the steps of the
// tensors that end in it, so a step is one launch per group (two with a reduction); without one, a
// separate small launch after the updates increments them. Nothing is incremented when found_inf is set.
//
// A two-pass policy: pass 1 writes each block's sums (a fixed-order block reduction, in double) to scratch
// memory; in pass 2 every block of a tensor adds that tensor's partials in the same fixed order, so all
// its blocks derive the same factor without a third launch, and the result does not depend on timing.
//
// The FP32 weight of a param is its master, the param itself, or a BF16 param joined with its int16
// remainder (core/master_split.h); a 16-bit param is written with round-to-nearest, or, with
// OptimArgs::rounding stochastic, with the Philox word of its element index (sr_offset + e) in stream (step
// number, kStreamOptim): the same bits as the CPU backend (the step number is read on the device too).
//
// Nothing syncs with the host: lr, tensor hyperparameters, inv_scale, the clip sum of squares, found_inf
// and the steps are read on the device, so step() can be captured in a CUDA graph. Tensors may have any
// dense layout (channels_last, ...) as long as a param, its grad, master and states share it: the update
// is element-wise, so each is read as a flat array.
#include <cstdint>
#include <stdexcept>
#include <vector>

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
constexpr int kMaxSums = 4;      // per-tensor sums of a two-pass policy

enum class Pass { kUpdate, kReduce, kApply };

struct OptimLaunch {
  void* param[kMaxTensors];
  void* grad[kMaxTensors];
  void* master[kMaxTensors];  // the FP32 master (float), or the int16 remainder: as weight[] says, or nullptr
  float* state[kMaxStates][kMaxTensors];
  float* step[kMaxTensors];
  int64_t numel[kMaxTensors];
  WorkIndex<kMaxTensors> work;
  uint64_t sr_offset[kMaxTensors];  // stochastic rounding: the Philox element index of element 0
  uint8_t dtype[kMaxTensors];
  uint8_t weight[kMaxTensors];    // WeightSource
  uint8_t finishes[kMaxTensors];  // this launch holds the tensor's last chunk: its step is incremented here
};

struct OptimConsts {
  double hyper[kMaxHyper];
  HyperRef hyper_ref[kMaxHyper];
  double lr;
  HyperRef lr_ref;
  const float* inv_scale;
  const float* grad_scale;
  const float* clip_sumsq;
  float max_norm;
  const float* found_inf;
  bool write_grad;
  PhiloxKeys keys;        // stochastic rounding: the seed's round keys (read from the constant bank)
  unsigned int* counter;  // the final pass's last block increments the steps
  double* partial;        // two-pass policies: [item][sum] of this launch
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

// One vector store. Four 16-bit values go out as one 64-bit integer: copied as a Pack, the FP16 params of
// the master-weight loops were stored as four 16-bit stores a vector on sm_90 (the compiler scalarised the
// copy; a uint2 became two 32-bit stores), each covering a quarter of the sectors it touched.
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* dst, const Pack<T, N>& v) {
  if constexpr (sizeof(T) * N == 8) {
    uint32_t w[2];
    memcpy(w, v.v, sizeof w);
    *reinterpret_cast<uint64_t*>(dst) = (static_cast<uint64_t>(w[1]) << 32) | w[0];
  } else {
    *reinterpret_cast<Pack<T, N>*>(dst) = v;
  }
}

// What the block's elements share: the policy's per-tensor scalars and flags, the gradient factors.
template <class P>
struct BlockConsts {
  typename P::Scalars sc;
  RuntimeFlags f;
  float gmul, clip;
  float factor;  // pass 2: the tensor's factor from its sums
  uint32_t sr_s0;  // stochastic rounding: the stream word, this step's number
};

template <class P>
__device__ __forceinline__ BlockConsts<P> block_consts(const OptimLaunch& a, const OptimConsts& c, int slot) {
  double v[kMaxHyper];
#pragma unroll
  for (int i = 0; i < P::kNumHyper; ++i) v[i] = read_hyper(c.hyper_ref[i], c.hyper[i]);  // tensor values, on the device
  const typename P::Hyper h = P::make(v);
  BlockConsts<P> b;
  b.gmul = unscale_factor(c.inv_scale, c.grad_scale);
  b.clip = 1.f;
  double grad_norm = -1.0;
  if (c.clip_sumsq) {
    b.clip = clip_coefficient(*c.clip_sumsq, c.max_norm);
    grad_norm = sqrt(static_cast<double>(*c.clip_sumsq)) * b.clip;
  }
  const double lr = read_hyper(c.lr_ref, c.lr);
  const float taken = a.step[slot] ? *a.step[slot] : 0.f;
  b.sc = P::scalars(h, StepContext{lr, static_cast<double>(taken) + 1.0, grad_norm});
  b.f = RuntimeFlags{P::flags(h)};
  b.factor = 0.f;
  b.sr_s0 = sr_step_word(taken);
  return b;
}

// The states that every flag combination of P reads and writes: the bindings refuse a step without them
// (csrc/torch/optim.cpp), so the loops access them with no test of their pointers; a state past P's own is
// never there. (Tested at run time, the pointers cost the stochastic AdamW loop 18 instructions an iteration
// on sm_90, where its predicates ran short and the tests were redone in the loop.)
template <class P>
__host__ __device__ constexpr uint32_t always_states() {
  uint32_t m = (1u << P::kNumStates) - 1u;
  for (uint32_t f = 0; f < (1u << P::kNumFlags); ++f) m &= P::state_mask(f);
  return m;
}

template <class P>
__device__ __forceinline__ bool has_state(float* const* st, int k) {
  constexpr uint32_t kAlways = always_states<P>();
  return k < P::kNumStates && (((kAlways >> k) & 1u) || st[k] != nullptr);
}

// One element: the gradient as stored in, the gradient used out (for write_grad).
template <class P, Pass kPass>
__device__ __forceinline__ float element(float& p, float* s, float graw, const BlockConsts<P>& b, float* acc) {
  if constexpr (kPass == Pass::kApply) {
    P::apply(p, s, b.f, b.sc, b.factor);
    return 0.f;
  } else {
    const float g = fmul(fmul(graw, b.gmul), b.clip);
    if constexpr (kPass == Pass::kUpdate) {
      P::update(p, s, g, b.f, b.sc);
    } else {
      float terms[P::kNumSums];
      P::reduce(p, s, g, b.f, b.sc, terms);
#pragma unroll
      for (int k = 0; k < P::kNumSums; ++k) acc[k] = fadd(acc[k], terms[k]);
    }
    return g;
  }
}

// Stochastic rounding's random bits (core/philox.h: one Philox block holds eight consecutive elements' 16
// bits; element k of a block takes half-word k of its four words, low half first).
//
// The vector part of a chunk: each warp walks a run of consecutive windows of its own, a window being V
// vectors of its 32 lanes (128 * V elements, 16 * V Philox blocks). Iteration w issues window w's loads,
// computes window w + 1's blocks (one a lane) into the warp's ring of blocks in shared memory while they
// are in flight, then a __syncwarp, then window w's update reads its elements' bits from the ring (window
// 0's blocks are computed before the loop). A run starts at a multiple of 8 elements from the chunk's start,
// so every window's elements sit at the same place `lead` in their blocks; where lead != 0 a window's last
// elements lie in the first block of the next window, which the ring holds by then: each block is computed
// once, by one lane, with no barrier of the whole block. (Before: a window was a vector of every thread of the block, its 129 blocks
// were computed by the first 129 threads, five warps of eight, and every window took a __syncthreads; the
// FP16 loop held 555 sm_90 instructions for 4 elements against 599 for 8 without stochastic rounding, and
// an H200 measured the stochastic step at 1.42x the nearest one.)
//
// The ring holds four windows' blocks: block k of the run (k counted from the run's first) in slot
// k % (4 * 16V). In iteration w a lane writes window w + 1's blocks while a slower lane may still read
// window w - 1's (blocks 16V(w - 1) .. 16Vw; it passed the __syncwarp of iteration w - 1, so none reads an
// earlier window): three windows' slots would do, four make the slot a mask.
constexpr int kWarps = kThreads / 32;
constexpr int kSrRingWindows = 4;
constexpr int kSrMaxBlocks = 16 * 2;  // a window's blocks at V = 2
constexpr int kSrWarpWords = kSrRingWindows * kSrMaxBlocks * 4;

// The block's shared words: the warps' rings in the vector part, one buffer of the whole block (sr_fill) in
// the element-wise part.
__device__ __forceinline__ uint32_t* sr_buffers() {
  __shared__ __align__(16) uint32_t buf[kWarps * kSrWarpWords];
  return buf;
}
static_assert(4 * (kThreads / kElementsPerBlock + 1) <= kWarps * kSrWarpWords, "sr_fill's buffer");

// Fills buf with the blocks of elements index0 .. index0 + count - 1 of stream (s0, kStreamOptim), thread t
// the t-th (the element-wise part: a window of one element a thread, which need not start a block).
__device__ __forceinline__ void sr_fill(uint32_t* buf, const PhiloxKeys& keys, uint64_t index0, int64_t count, uint32_t s0) {
  const int64_t blocks = (static_cast<int64_t>(index0 & 7u) + count + 7) / kElementsPerBlock;
  if (threadIdx.x < blocks) {
    const Philox4 p = philox_block(keys, index0 / kElementsPerBlock + threadIdx.x, s0, kStreamOptim);
    *reinterpret_cast<uint4*>(buf + 4 * threadIdx.x) = make_uint4(p.v[0], p.v[1], p.v[2], p.v[3]);
  }
}

// The bits of element w of a window whose first element is element `lead` of its block: philox_bits' form
// (the top 16 bits of the value).
__device__ __forceinline__ uint32_t sr_bits(const uint32_t* buf, int lead, int w) {
  const int h = lead + w;  // the element's half-word
  const uint32_t word = buf[h >> 1];
  return (h & 1) ? (word & 0xFFFF0000u) : (word << 16);
}

// The bits of four consecutive elements whose first is half-word h of a ring of mask + 1 words: the words
// holding them (two, or three where h is odd), shifted by a half-word where h is odd.
__device__ __forceinline__ void sr_vector_bits(const uint32_t* ring, uint32_t mask, uint32_t h, uint32_t* words) {
  const uint32_t q = h >> 1;
  const uint32_t odd = h & 1u;
  const uint32_t w0 = ring[q & mask], w1 = ring[(q + 1) & mask];
  const uint32_t w2 = odd ? ring[(q + 2) & mask] : 0u;
  const uint32_t y0 = __funnelshift_r(w0, w1, 16 * odd), y1 = __funnelshift_r(w1, w2, 16 * odd);
  words[0] = y0 << 16;
  words[1] = y0 & 0xFFFF0000u;
  words[2] = y1 << 16;
  words[3] = y1 & 0xFFFF0000u;
}

// A 16-bit param's bits from its FP32 result: round to nearest, or stochastically with word r.
template <DType D, bool kSr>
__device__ __forceinline__ typename Storage<D>::type store_param(float x, uint32_t r) {
  if constexpr (D == DType::kFloat32) return x;
  else if constexpr (kSr) return float_to_bits_sr<D>(x, r);
  else return Storage<D>::store(x);
}

// A vector of FP16 params rounded stochastically (words: each element's 16 random bits on top). Where no
// element needs float_to_f16_bits_sr's general formula (core/stochastic.h's f16_sr_normal_range: below
// 2^-14, zero or NaN, rare among weights), the normal-range form: an add and a mask an element and one
// conversion a pair (cvt.rn.f16x2.f32; exact, the value is on the grid), after one compare an element. The
// general formula takes about 17 integer instructions an element. The branch is the thread's: a warp runs the general formula only where one of
// its lanes needs it, and the bits are the same either way.
template <int N>
__device__ __forceinline__ Pack<uint16_t, N> f16_sr_vec(const Pack<float, N>& x, const uint32_t* words) {
  static_assert(N % 2 == 0, "pairs of elements");
  bool normal = true;
#pragma unroll
  for (int e = 0; e < N; ++e) normal &= f16_sr_normal_range(x.v[e]);
  Pack<uint16_t, N> out;
  if (normal) {
#pragma unroll
    for (int e = 0; e < N; e += 2) {
      const __half2 h = __floats2half2_rn(f16_sr_normal_input(float_as_bits(x.v[e]), words[e]),
                                          f16_sr_normal_input(float_as_bits(x.v[e + 1]), words[e + 1]));
      out.v[e] = __half_as_ushort(__low2half(h));
      out.v[e + 1] = __half_as_ushort(__high2half(h));
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out.v[e] = float_to_f16_bits_sr(x.v[e], words[e]);
  }
  return out;
}

// kWs: where the FP32 weight comes from, a template argument so that each loop holds only its own loads,
// stores and conversions (with the source chosen at run time, the BF16 loops carried the remainders' join
// and split beside the plain conversion: 873 instructions for two vectors of AdamW on sm_90 where FP16's
// took 635, and an H200 measured the BF16 step without masters at 69% of the copy roof, FP16's at 89%).
// kSr: the launch's rounding is stochastic (a kernel of its own, so that the round-to-nearest kernels carry
// neither its registers nor its 16 KB of shared memory: with both in one kernel LAMB's update pass took 96
// registers where its nearest loop alone takes 68, which left it two blocks per SM instead of three).
template <class P, DType D, Pass kPass, WeightSource kWs, bool kSr>
__device__ __forceinline__ void process_chunk(const OptimLaunch& a, int slot, int64_t begin, int64_t n,
                                              const OptimConsts& c, const BlockConsts<P>& b, float* acc) {
  using S = Storage<D>;
  using T = typename S::type;
  constexpr bool kReadGrad = kPass != Pass::kApply;
  constexpr bool kWriteParam = kPass != Pass::kReduce;
  constexpr bool kWriteState = kPass != Pass::kApply;
  T* param = static_cast<T*>(a.param[slot]) + begin;
  T* grad = static_cast<T*>(a.grad[slot]) + begin;
  constexpr bool kM = kWs == WeightSource::kMaster;
  constexpr bool kR = kWs == WeightSource::kRemainder;  // BF16 only (the bindings check it; the caller too)
  static_assert(!kR || D == DType::kBFloat16, "remainders are for BF16 params");
  float* master = kM ? static_cast<float*>(a.master[slot]) + begin : nullptr;
  int16_t* rem = kR ? static_cast<int16_t*>(a.master[slot]) + begin : nullptr;
  // Where the param is written with stochastic rounding: a 16-bit param that is no BF16 param with remainders.
  constexpr bool sr = kSr && D != DType::kFloat32 && kWriteParam && !kR;
  const uint64_t first = a.sr_offset[slot] + static_cast<uint64_t>(begin);  // element 0's Philox index
  const bool write_grad = kReadGrad && c.write_grad;
  float* st[kMaxStates];
  const auto aligned = [](const void* ptr, int bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; };
  bool vec = aligned(param, sizeof(T) * kVec) && (!kReadGrad || aligned(grad, sizeof(T) * kVec)) &&
             (!kM || aligned(master, 16)) && (!kR || aligned(rem, sizeof(int16_t) * kVec));
#pragma unroll
  for (int k = 0; k < kMaxStates; ++k) {
    // absent states stay zero in registers; a state P always has is taken as it is (a select with nullptr would
    // hide from the compiler that it points to global memory: generic loads and stores)
    if (k >= P::kNumStates) st[k] = nullptr;
    else if ((always_states<P>() >> k) & 1u) st[k] = a.state[k][slot] + begin;
    else st[k] = a.state[k][slot] ? a.state[k][slot] + begin : nullptr;
    vec = vec && (!has_state<P>(st, k) || aligned(st[k], 16));
  }

  // Elements i .. i + kVec - 1 in 16-byte (FP32) and 8-byte (FP16/BF16) accesses: the loads, then the
  // update and the stores (words: the stochastic rounding's bits, when sr).
  struct VecIn {
    Pack<T, kVec> gv;
    Pack<float, kVec> pv, sv[kMaxStates];
    Pack<int16_t, kVec> rv;
  };
  const auto load_vec = [&](int i, VecIn& d) {
    d.gv = {};
    if (kReadGrad) d.gv = *reinterpret_cast<const Pack<T, kVec>*>(grad + i);
    if constexpr (kM) {
      d.pv = *reinterpret_cast<const Pack<float, kVec>*>(master + i);
    } else {
      const Pack<T, kVec> raw = *reinterpret_cast<const Pack<T, kVec>*>(param + i);
      if constexpr (kR) d.rv = *reinterpret_cast<const Pack<int16_t, kVec>*>(rem + i);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if constexpr (kR) d.pv.v[e] = join_master(raw.v[e], d.rv.v[e]);
        else d.pv.v[e] = S::load(raw.v[e]);
      }
    }
#pragma unroll
    for (int k = 0; k < kMaxStates; ++k) {
      d.sv[k] = {};
      if (has_state<P>(st, k)) d.sv[k] = *reinterpret_cast<const Pack<float, kVec>*>(st[k] + i);
    }
  };
  const auto finish_vec = [&](int i, VecIn& d, const uint32_t* words) {
    Pack<T, kVec> used;  // the gradient the update used, for write_grad
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      float s[kMaxStates];
#pragma unroll
      for (int k = 0; k < kMaxStates; ++k) s[k] = d.sv[k].v[e];
      used.v[e] = S::store(element<P, kPass>(d.pv.v[e], s, S::load(d.gv.v[e]), b, acc));
#pragma unroll
      for (int k = 0; k < kMaxStates; ++k) d.sv[k].v[e] = s[k];
    }
    if (write_grad) store_vec(grad + i, used);
    if (kWriteParam) {
      Pack<T, kVec> out;
      if constexpr (kR) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const uint32_t u = float_as_bits(d.pv.v[e]);
          out.v[e] = split_master_hi(u);
          d.rv.v[e] = split_master_lo(u, out.v[e]);
        }
        store_vec(rem + i, d.rv);
      } else if constexpr (sr && D == DType::kFloat16) {
        out = f16_sr_vec(d.pv, words);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) out.v[e] = store_param<D, sr>(d.pv.v[e], sr ? words[e] : 0u);
      }
      store_vec(param + i, out);
      if constexpr (kM) *reinterpret_cast<Pack<float, kVec>*>(master + i) = d.pv;
    }
    if (kWriteState) {
#pragma unroll
      for (int k = 0; k < kMaxStates; ++k)
        if (has_state<P>(st, k)) *reinterpret_cast<Pack<float, kVec>*>(st[k] + i) = d.sv[k];
    }
  };
  // One element, element by element: misaligned tensors and the tail of a vectorised one.
  const auto scalar = [&](int i, uint32_t r) {
    float p;
    if constexpr (kM) p = master[i];
    else if constexpr (kR) p = join_master(param[i], rem[i]);
    else p = S::load(param[i]);
    float s[kMaxStates];
#pragma unroll
    for (int k = 0; k < kMaxStates; ++k) s[k] = has_state<P>(st, k) ? st[k][i] : 0.f;
    const float g = element<P, kPass>(p, s, kReadGrad ? S::load(grad[i]) : 0.f, b, acc);
    if (write_grad) grad[i] = S::store(g);
    if (kWriteState) {
#pragma unroll
      for (int k = 0; k < kMaxStates; ++k)
        if (has_state<P>(st, k)) st[k][i] = s[k];
    }
    if (kWriteParam) {
      if constexpr (kM) master[i] = p;
      if constexpr (kR) {
        const uint32_t u = float_as_bits(p);
        param[i] = split_master_hi(u);
        rem[i] = split_master_lo(u, param[i]);
      } else {
        param[i] = store_param<D, sr>(p, r);
      }
    }
  };

  // Positions in the chunk are ints (kChunk elements at most): 32-bit offsets address with one IMAD.WIDE
  // where a 64-bit one takes a LEA pair.
  static_assert(kChunk <= (int64_t{1} << 30), "a chunk's positions must fit an int");
  const int len = static_cast<int>(n);
  const int head = vec ? len / kVec * kVec : 0;
  // Two vectors a thread in flight, for single-pass policies: the loads of an iteration cannot pass the
  // stores of the one before (the compiler cannot tell that they do not alias), so one vector an iteration
  // left a thread one vector's bytes in flight: 56-64 bytes, about 30 KB per SM at the two blocks per SM
  // that AdamW's 96 registers allowed, which measured 85-87% of the copy roof on an H200. Each thread still
  // visits its elements in the same order. A two-pass policy (LAMB) keeps one vector: it has 75-80
  // registers, three blocks per SM, and measured 92% there; two vectors take it to 86-106 registers and
  // two blocks per SM.
  constexpr bool kTwoVectors = P::kNumSums == 0;
  constexpr int kStride = kThreads * kVec;
  if constexpr (!sr) {
    int i = static_cast<int>(threadIdx.x) * kVec;
    if constexpr (kTwoVectors) {
      for (; i + kStride < head; i += 2 * kStride) {
        VecIn d0, d1;
        load_vec(i, d0);
        load_vec(i + kStride, d1);
        finish_vec(i, d0, nullptr);
        finish_vec(i + kStride, d1, nullptr);
      }
    }
    for (; i < head; i += kStride) {
      VecIn d;
      load_vec(i, d);
      finish_vec(i, d, nullptr);
    }
    for (int i = head + static_cast<int>(threadIdx.x); i < len; i += kThreads) scalar(i, 0u);
  } else {
    // Stochastic rounding, the vector part: each warp its own run of windows (see sr_buffers), V vectors a
    // lane a window, loaded at the top of the iteration as in the loop above so that the Philox blocks are
    // computed while they are in flight.
    constexpr int V = kTwoVectors ? 2 : 1;
    constexpr int kWin = 32 * kVec * V;  // a warp's window: elements
    constexpr int kWinBlocks = kWin / kElementsPerBlock;
    constexpr uint32_t kRingMask = kSrRingWindows * kWinBlocks * 4 - 1;  // the ring's words, less one
    static_assert(kWinBlocks <= 32 && kWinBlocks <= kSrMaxBlocks, "a lane per block of a window");
    static_assert((kRingMask & (kRingMask + 1)) == 0, "the ring's slot is a mask");
    uint32_t* const bufs = sr_buffers();
    const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
    const int windows = (head + kWin - 1) / kWin;
    const int per_warp = (windows + kWarps - 1) / kWarps;
    const int run0 = (warp * per_warp < windows ? warp * per_warp : windows) * kWin;  // a multiple of 8
    const int run1 = (warp + 1) * per_warp * kWin < head ? (warp + 1) * per_warp * kWin : head;
    if (run0 < run1) {  // the same for the warp's lanes
      uint32_t* const ring = bufs + warp * kSrWarpWords;
      const uint64_t e0 = first + static_cast<uint64_t>(run0);  // the run's first element's Philox index
      const uint32_t lead = static_cast<uint32_t>(e0 & 7u);      // == first & 7
      const uint64_t block0 = e0 / kElementsPerBlock;
      const int last = (static_cast<int>(lead) + (run1 - run0) - 1) / kElementsPerBlock;  // the run's last block
      const auto fill = [&](int window) {  // window's blocks: 16V of them from block 16V * window
        const int k = window * kWinBlocks + lane;
        if (lane < kWinBlocks && k <= last) {
          const Philox4 p = philox_block(c.keys, block0 + static_cast<uint64_t>(k), b.sr_s0, kStreamOptim);
          *reinterpret_cast<uint4*>(ring + ((static_cast<uint32_t>(k) * 4u) & kRingMask)) =
              make_uint4(p.v[0], p.v[1], p.v[2], p.v[3]);
        }
      };
      fill(0);
      int w = 0;
      for (int base = run0; base < run1; base += kWin, ++w) {
        VecIn d[V];
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const int i = base + (v * 32 + lane) * kVec;
          if (i < run1) load_vec(i, d[v]);
        }
        fill(w + 1);
        __syncwarp();
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const int i = base + (v * 32 + lane) * kVec;
          if (i < run1) {
            uint32_t words[kVec];
            sr_vector_bits(ring, kRingMask, lead + static_cast<uint32_t>(i - run0), words);
            finish_vec(i, d[v], words);
          }
        }
      }
    }
    if (head > 0) __syncthreads();  // every warp's last reads, before sr_fill writes the shared words
    // Element by element, a window of kThreads at a time; its first element need not start a block.
    for (int base = head; base < len; base += kThreads) {
      sr_fill(bufs, c.keys, first + static_cast<uint64_t>(base), len - base < kThreads ? len - base : kThreads, b.sr_s0);
      __syncthreads();
      const int i = base + static_cast<int>(threadIdx.x);
      if (i < len) scalar(i, sr_bits(bufs, static_cast<int>((first + static_cast<uint64_t>(base)) & 7u), threadIdx.x));
      __syncthreads();
    }
  }
}

// The last block of the launch to get here increments the steps of the tensors that end in this launch
// (every block has read its step at its start), and zeroes the counter again.
__device__ __forceinline__ void finish_steps(const OptimLaunch& a, unsigned int* counter) {
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) is_last = arrive_last(counter);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int s = threadIdx.x; s < a.work.num_slots; s += kThreads)
    if (a.finishes[s] && a.step[s]) *a.step[s] += 1.f;
  if (threadIdx.x == 0) *counter = 0u;
}

template <class P, Pass kPass, bool kSr>
__global__ void __launch_bounds__(kThreads, 2) optim_kernel(const __grid_constant__ OptimLaunch a, const OptimConsts c) {
  if (c.found_inf && *c.found_inf != 0.f) return;  // skipped step: nothing is written, steps included
  constexpr int K = P::kNumSums > 0 ? P::kNumSums : 1;
  const WorkItem item = a.work.find(blockIdx.x);
  const int slot = item.slot;
  const int64_t begin = item.chunk * kChunk;
  const int64_t n = a.numel[slot] - begin < kChunk ? a.numel[slot] - begin : kChunk;
  BlockConsts<P> b = block_consts<P>(a, c, slot);
  if constexpr (kPass == Pass::kApply) {
    // The tensor's sums from pass 1's partials (all of its items are in this launch), in a fixed order.
    __shared__ float factor;
    double sums[K];
    const int first = a.work.first_item[slot], end = a.work.first_item[slot + 1];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      double v = 0.0;
      for (int i = first + threadIdx.x; i < end; i += kThreads) v += c.partial[int64_t{i} * K + k];
      sums[k] = block_sum<double, kThreads>(v);
      __syncthreads();  // block_sum's shared scratch is reused by the next sum
    }
    if (threadIdx.x == 0) factor = P::finish(b.sc, sums);
    __syncthreads();
    b.factor = factor;
  }
  float acc[K] = {};
  dispatch_dtype(static_cast<DType>(a.dtype[slot]), [&](auto d) {
    constexpr DType D = decltype(d)::value;
    const WeightSource ws = static_cast<WeightSource>(a.weight[slot]);
    if (ws == WeightSource::kMaster) {
      process_chunk<P, D, kPass, WeightSource::kMaster, kSr>(a, slot, begin, n, c, b, acc);
      return;
    }
    if constexpr (D == DType::kBFloat16) {
      if (ws == WeightSource::kRemainder) {
        process_chunk<P, D, kPass, WeightSource::kRemainder, kSr>(a, slot, begin, n, c, b, acc);
        return;
      }
    }
    process_chunk<P, D, kPass, WeightSource::kParam, kSr>(a, slot, begin, n, c, b, acc);
  });
  if constexpr (kPass == Pass::kReduce) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const double v = block_sum<double, kThreads>(static_cast<double>(acc[k]));
      if (threadIdx.x == 0) c.partial[int64_t{blockIdx.x} * K + k] = v;
      __syncthreads();
    }
  } else if (c.counter) {
    finish_steps(a, c.counter);
  }
}

__global__ void step_increment_kernel(const __grid_constant__ StepLaunch s, const float* found_inf) {
  if (found_inf && *found_inf != 0.f) return;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < s.n; i += gridDim.x * blockDim.x) *s.step[i] += 1.f;
}

template <class P>
void launch_policy(const OptimArgs& a, const ScratchAllocator& scratch, cudaStream_t stream) {
  static_assert(P::kNumSums <= kMaxSums, "raise kMaxSums");
  std::vector<int64_t> numel(static_cast<size_t>(a.num_tensors));
  for (int64_t t = 0; t < a.num_tensors; ++t) numel[t] = a.tensors[t].numel;
  const std::vector<PlanLaunch> plan = plan_multi_tensor(numel.data(), a.num_tensors, kCudaOptimLimits);
  require_large_kernel_params();  // the update and the step increment both take 32 KB argument packs
  OptimConsts consts{};
  for (int i = 0; i < kMaxHyper; ++i) {
    consts.hyper[i] = a.hyper[i];
    consts.hyper_ref[i] = a.hyper_ref[i];
  }
  consts.lr = a.lr;
  consts.lr_ref = a.lr_ref;
  consts.inv_scale = a.inv_scale;
  consts.grad_scale = a.grad_scale;
  consts.clip_sumsq = a.clip_sumsq;
  consts.max_norm = a.max_norm;
  consts.found_inf = a.found_inf;
  consts.write_grad = a.write_grad;
  consts.keys = philox_keys(a.seed);
  const bool stochastic = a.rounding == Rounding::kStochastic;
  bool any_step = false;
  for (int64_t t = 0; t < a.num_tensors; ++t) any_step = any_step || a.tensors[t].step != nullptr;
  consts.counter = any_step ? a.counter : nullptr;  // no steps to count (Lion, SGD without momentum)

  // Pass 2 adds a tensor's partials within one launch: a tensor must not continue into the next one (only
  // a tensor of more than max_items chunks, 2^46 elements, would). Checked before anything is launched.
  if (P::kNumSums > 0)
    for (const PlanLaunch& launch : plan)
      if (launch.items.front().chunk != 0)
        throw std::runtime_error("mpfused: a tensor is too large for a two-pass optimizer step");
  // The partial sums of a two-pass policy: one buffer for the largest launch, taken before anything is
  // launched (a failed allocation then modifies nothing); the launches reuse it in stream order.
  double* partial = nullptr;
  if (P::kNumSums > 0) {
    size_t most = 0;
    for (const PlanLaunch& launch : plan) most = launch.items.size() > most ? launch.items.size() : most;
    if (most > 0) partial = static_cast<double*>(scratch.alloc(scratch.ctx, static_cast<int64_t>(most) * P::kNumSums * 8));
  }

  OptimLaunch args;
  for (const PlanLaunch& launch : plan) {
    for (size_t s = 0; s < launch.tensors.size(); ++s) {
      const OptimTensor& t = a.tensors[launch.tensors[s]];
      args.param[s] = t.param;
      args.grad[s] = t.grad;
      args.master[s] = t.remainder ? static_cast<void*>(t.remainder) : static_cast<void*>(t.master);
      args.weight[s] = static_cast<uint8_t>(t.remainder ? WeightSource::kRemainder
                                            : t.master  ? WeightSource::kMaster
                                                        : WeightSource::kParam);
      args.sr_offset[s] = t.sr_offset;
      for (int k = 0; k < kMaxStates; ++k) args.state[k][s] = t.state[k];
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
    if constexpr (P::kNumSums == 0) {
      if (stochastic) optim_kernel<P, Pass::kUpdate, true><<<items, kThreads, 0, stream>>>(args, consts);
      else optim_kernel<P, Pass::kUpdate, false><<<items, kThreads, 0, stream>>>(args, consts);
      cuda_check(cudaGetLastError(), "launching the optimizer kernel");
    } else {
      OptimConsts pass = consts;
      pass.partial = partial;
      pass.counter = nullptr;
      optim_kernel<P, Pass::kReduce, false><<<items, kThreads, 0, stream>>>(args, pass);
      cuda_check(cudaGetLastError(), "launching the optimizer's reduction pass");
      pass.counter = consts.counter;
      if (stochastic) optim_kernel<P, Pass::kApply, true><<<items, kThreads, 0, stream>>>(args, pass);
      else optim_kernel<P, Pass::kApply, false><<<items, kThreads, 0, stream>>>(args, pass);
      cuda_check(cudaGetLastError(), "launching the optimizer's update pass");
    }
  }

  // After every update block has read its step: increment the counters (unless the step was skipped) that
  // no launch's last block did: all of them without a counter, else those of empty tensors (no launch
  // holds them), as torch counts the steps of empty params too.
  StepLaunch steps;
  steps.n = 0;
  auto flush = [&]() {
    if (steps.n == 0) return;
    step_increment_kernel<<<(steps.n + 255) / 256, 256, 0, stream>>>(steps, a.found_inf);
    cuda_check(cudaGetLastError(), "launching the step increment");
    steps.n = 0;
  };
  for (int64_t t = 0; t < a.num_tensors; ++t) {
    if (!a.tensors[t].step || (consts.counter && a.tensors[t].numel > 0)) continue;
    if (steps.n == kMaxSteps) flush();
    steps.step[steps.n++] = a.tensors[t].step;
  }
  flush();
}

}  // namespace

void optim_step_cuda(const OptimArgs& a, const ScratchAllocator& scratch, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch_optim(a.kind, [&](auto policy) { launch_policy<decltype(policy)>(a, scratch, stream); });
}

}  // namespace mpf
