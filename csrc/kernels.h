// The backend API that the CPU and the CUDA backends implement.
//
// Plain structs only: raw pointers, int64 sizes, a dtype enum. No torch and no CUDA types, so the
// backends build and test without Python (CMakeLists.txt) and bindings.cpp is the one file that
// translates between at::Tensor and these structs. Arguments arrive validated: the backends assume
// tensors of a supported dtype on one device whose elements fill one block of memory (contiguous, or,
// for the optimizer, any dense layout such as channels_last shared by a param, its grad and its state:
// element-wise work reads them as flat arrays), and never see an invalid argument.
#pragma once

#include <cstdint>
#include <string>

#include "core/fixed_point.h"
#include "core/follow.h"
#include "core/gemm.h"
#include "core/loss_scale.h"
#include "core/master_split.h"
#include "core/multi_tensor_plan.h"
#include "core/numeric.h"
#include "core/optim/registry.h"
#include "core/philox.h"
#include "core/stochastic.h"

namespace mpf {

struct TensorRef {
  void* data;
  int64_t numel;
  DType dtype;
};

// Device memory for a backend's scratch space. bindings.cpp hands out memory from torch's caching
// allocator on the current stream; it stays valid until the work queued on that stream has run.
struct ScratchAllocator {
  void* ctx;
  void* (*alloc)(void* ctx, int64_t bytes);
};

// ---- multi-tensor overflow reduction --------------------------------------------------------------
struct OverflowArgs {
  const TensorRef* tensors;  // every tensor on one device; numel == 0 allowed (skipped)
  int64_t num_tensors;
  float* found_inf;          // one float: set to 1.0f when any element is inf/NaN; never cleared
  const float* inv_scale;    // nullptr, or one float: values are multiplied by it (sum and unscale)
  bool unscale;              // write x * inv_scale back in place; needs inv_scale
  float* sumsq;              // nullptr, or one float: += sum of squares of the (unscaled) values
  // The sync-free scaler iteration, in one launch:
  bool overwrite;            // found_inf (and sumsq) hold this call's result alone: no zeroing needed
  float* norm;               // nullptr, or one float: set to sqrt(*sumsq) after the reduction; needs sumsq
  unsigned int* counter;     // CUDA: nullptr, or one zeroed uint32 the call may use and leaves zeroed
                             //   (spares the memset of a fresh counter); never shared by two launches
                             //   that may run at once (the kernel traps when it sees one shared)
};

// Work split: chunk sizes and per-launch capacities. The CUDA limits follow from the 32 KB kernel
// parameter space (CUDA >= 12.1): see cuda/overflow.cu, which static_asserts that they fit.
constexpr PlanLimits kCpuOverflowLimits{int64_t{1} << 16, INT32_MAX, INT32_MAX};
constexpr PlanLimits kCudaOverflowLimits{int64_t{1} << 16, 1024, int64_t{1} << 30};

void overflow_check_cpu(const OverflowArgs& args, int num_threads);

// ---- fused optimizer step: unscale + inf-skip + update of FP32 masters + low-precision copy -------
// The algorithm is a policy of core/optim/ (OptimKind names it); one generic driver per backend applies it.
struct OptimTensor {
  void* param;               // the model's weight, FP32/FP16/BF16: written (rounded from the FP32 result)
  void* grad;                // same dtype and numel as param; read, and written when OptimArgs::write_grad
  float* master;             // FP32 master weight, or nullptr: then param is read, updated in FP32, written back
  float* state[kMaxStates];  // the policy's FP32 states in its kStates order; nullptr where its state_mask
                             //   says the step does not use one, and never nullptr where it says it does
                             //   (the CUDA kernels access the states a policy always has untested)
  float* step;               // one float: steps taken so far, += 1 when this step is taken; nullptr where
                             //   the policy's needs_step is false
  int64_t numel;
  DType dtype;               // of param and grad
  int16_t* remainder;        // BF16 param only, never with a master: the low 16 bits of its FP32 master
                             //   (core/master_split.h), read and written with the param; or nullptr
  uint64_t sr_offset;        // OptimArgs::rounding stochastic: the Philox element index of element 0 (the
                             //   param's start in the optimizer's flat order of all its params)
};

struct OptimArgs {
  OptimKind kind;
  const OptimTensor* tensors;  // one device, one param group
  int64_t num_tensors;
  double lr;                   // used when lr_ref.ptr is null
  HyperRef lr_ref;             // nullptr, or a float32 or float64 tensor on the device: the learning rate
  double hyper[kMaxHyper];     // the policy's hyperparameters, in its kHyper order
  HyperRef hyper_ref[kMaxHyper];  // per hyperparameter: nullptr, or a tensor on the device that the
                               //   update reads instead of hyper[i] (core/optim/common.h)
  const float* inv_scale;      // nullptr, or one float: gradients are multiplied by it
  const float* grad_scale;     // nullptr, or one float (the loss scale S, as torch.amp.GradScaler hands
                               //   it over): gradients are multiplied by float(1 / S) computed in double
  const float* clip_sumsq;     // nullptr, or one float: the sum of squares of the unscaled gradients of
  float max_norm;              //   the whole step; they are then multiplied by clip_coefficient(*clip_sumsq,
                               //   max_norm) (infinite max_norm: 1), and the policy sees their norm
  const float* found_inf;      // nullptr, or one float: != 0 skips the whole step (nothing is written)
  bool write_grad;             // a taken step writes the gradient it used (times the unscale factor and
                               //   the clip coefficient) back into grad, as torch's fused optimizers do;
                               //   a skipped step writes nothing
  unsigned int* counter;       // CUDA: nullptr, or one zeroed uint32 the call may use and leaves zeroed:
                               //   then the step counters are incremented by the last launch's last
                               //   block instead of a separate launch; never shared by two launches
                               //   that may run at once (the kernel traps when it sees one shared)
  Rounding rounding;           // how an FP16/BF16 param is written from its FP32 result (the update without
                               //   a master, or the copy of the master): kStochastic rounds element e of a
                               //   tensor with the random bits of index sr_offset + e of stream (step,
                               //   kStreamOptim) under `seed`, step = the tensor's step count after this
                               //   step (its step tensor is then required). A remainder param always rounds
                               //   to nearest (core/master_split.h).
  uint64_t seed;
};

constexpr PlanLimits kCpuOptimLimits{int64_t{1} << 14, INT32_MAX, INT32_MAX};
constexpr PlanLimits kCudaOptimLimits{int64_t{1} << 16, 384, int64_t{1} << 30};

void optim_step_cpu(const OptimArgs& args, int num_threads);

// ---- following a write from outside the step (core/follow.h) -------------------------------------
// Where code outside the step wrote a 16-bit param kept with an FP32 master or a BF16 remainder, the
// masters take the written values (element by element, core/follow.h's rules) and the remainders that
// would make a NaN become 0. One pass over each param and its master (or remainder); nothing else is read.
struct FollowTensor {
  const void* param;   // FP16 or BF16, read
  float* master;       // the param's FP32 master (written where the rules say), or nullptr
  int16_t* remainder;  // nullptr, or a BF16 param's remainder (written where the rules say); never with a master
  int64_t numel;       // of param and of its master or remainder
  DType dtype;         // of param
};

struct FollowArgs {
  const FollowTensor* tensors;  // one device
  int64_t num_tensors;
  bool stochastic;              // the masters were written with stochastic rounding (else to nearest)
};

constexpr PlanLimits kCpuFollowLimits{int64_t{1} << 16, INT32_MAX, INT32_MAX};
constexpr PlanLimits kCudaFollowLimits{int64_t{1} << 16, 512, int64_t{1} << 30};

void follow_writes_cpu(const FollowArgs& args, int num_threads);

// ---- dynamic loss scaling: the scale update (core/loss_scale.h), on the device --------------------
struct LossScaleArgs {
  float* scale;              // one float
  float* inv_scale;          // nullptr, or one float: set to 1 / scale after the update
  int32_t* growth_tracker;   // one int32
  int32_t* hysteresis_left;  // one int32
  int64_t* skipped_steps;    // one int64: incremented when found_inf != 0
  const float* found_inf;    // one float: != 0 is an overflow
  LossScaleConfig config;
};

void loss_scale_update_cpu(const LossScaleArgs& args);

// ---- GEMM: FP16/BF16 inputs, FP32 accumulation, fused epilogue (core/gemm.h) ------------------
// out[b] = act(alpha * a[b] @ b[b] + beta * c[b] + bias), for b < batch; a (m, k), b (k, n).
struct GemmArgs {
  int64_t batch, m, n, k;   // batch >= 1; m, n >= 1; k >= 0 (k == 0: the product is zero)
  MatrixRef a;              // FP16 or BF16
  MatrixRef b;              // the dtype of a
  MatrixRef c;              // c.data == nullptr, or (m, n) of any storage dtype; read only when beta != 0
  const void* bias;         // nullptr, or n elements of bias_dtype
  DType bias_dtype;
  float alpha, beta;
  Activation activation;
  void* out;                // (batch, m, n), row-major, contiguous, out_dtype
  DType out_dtype;
  void* pre_activation;     // nullptr, or like out: the value before the activation (for backward)
};

MPF_HD EpilogueScalars epilogue_scalars(const GemmArgs& g) {
  return EpilogueScalars{g.alpha, g.beta, g.c.data != nullptr && g.beta != 0.0f, g.bias != nullptr, g.activation};
}

// CPU: the accumulator acc (batch, m, n), FP32 row-major, comes from an FP32 GEMM of the exactly widened
// inputs (bindings.cpp uses ATen's); this applies the epilogue and writes out (and pre_activation).
// With out_dtype FP32, out may be acc itself: the epilogue is then applied in place.
void gemm_epilogue_cpu(const float* acc, const GemmArgs& args, int num_threads);

// CPU: the exact FP32 copy of an FP16/BF16 operand of `batch` (rows, cols) matrices, for the FP32 GEMM.
// dst is dense and keeps src's orientation: batch x (rows, cols) row-major when src is row-major,
// batch x (cols, rows) row-major (the transposed view of column-major matrices) when src is col-major,
// so that both sides are read and written along their contiguous dimension.
void widen_operand_cpu(const MatrixRef& src, int64_t batch, int64_t rows, int64_t cols, float* dst, int num_threads);

// ---- random bits and stochastic rounding (core/philox.h, core/stochastic.h) ------------------------
// Element i of a call takes the random bits (core/philox.h: 16, the top half of a uint32) of index
// offset + i in stream (s0, s1) under seed, so a result depends only on (seed, stream, offset + i), never
// on threads, chunking or device.
struct RandomArgs {
  uint64_t seed;
  uint64_t offset;  // the index of element 0 (offset + numel <= 2^64)
  uint32_t s0, s1;  // the stream (philox.h's kStream*)
  int64_t numel;
};

// The generator itself: out[4 i .. 4 i + 3] = Philox4x32-10 of counter ctr[4 i .. 4 i + 3], key (k0, k1).
void philox_raw_cpu(const uint32_t* ctr, uint32_t* out, int64_t n, uint32_t k0, uint32_t k1);
// words[i] = the random bits of element i (16, in the top half of the uint32).
void philox_words_cpu(const RandomArgs& r, uint32_t* words, int num_threads);
// dst[i] = src[i] (FP32) rounded stochastically to dst_dtype (FP16 or BF16) with the bits of element i.
void round_stochastic_cpu(const RandomArgs& r, const float* src, void* dst, DType dst_dtype, int num_threads);

// ---- fixed point <IL, FL> (core/fixed_point.h): Convert and the MACC -------------------------------
// dst[i] = Convert(src[i], fmt): the code (dst_type int16/int32: it must hold WL bits) or the value on the
// grid (float32, exact when WL <= 24; float64). Stochastic rounding takes the random bits of element
// offset + i of stream (kStreamRound, 0) under seed, as round_stochastic does.
struct FixedQuantizeArgs {
  const void* src;
  FixedType src_type;  // kFloat32, kFloat64, kFloat16 or kBFloat16
  void* dst;
  FixedType dst_type;  // kInt16, kInt32, kFloat32 or kFloat64
  int64_t numel;
  FixedFormat fmt;
  Rounding rounding;
  uint64_t seed, offset;
};

// out (m, n) = the codes of fmt_out of a (m, k) @ b (k, n), a and b codes (row-major, contiguous): the
// products summed exactly in int64 (fixed_macc_fits holds), rounded once (fixed_round_shift), saturated.
// Stochastic rounding of output element (i, j) takes the random bits of element offset + i * n + j.
struct FixedMatmulArgs {
  const void* a;
  FixedType a_type;  // kInt16 or kInt32
  const void* b;
  FixedType b_type;  // kInt16 or kInt32
  void* out;
  FixedType out_type;  // kInt16 or kInt32
  int64_t m, n, k;     // m, n, k >= 0
  FixedShift shift;    // FLa + FLb - FLout and the output's code range
  Rounding rounding;
  uint64_t seed, offset;
};

void fixed_quantize_cpu(const FixedQuantizeArgs& args, int num_threads);
void fixed_matmul_cpu(const FixedMatmulArgs& args, int num_threads);

// ---- CUDA (defined only in a CUDA build) ----------------------------------------------------------
void overflow_check_cuda(const OverflowArgs& args, const ScratchAllocator& scratch, void* stream);
// Scratch (per-tensor partial sums of two-pass policies) comes from `scratch`, on the stream.
void optim_step_cuda(const OptimArgs& args, const ScratchAllocator& scratch, void* stream);
void loss_scale_update_cuda(const LossScaleArgs& args, void* stream);
void follow_writes_cuda(const FollowArgs& args, void* stream);
// Throws std::runtime_error with a message for the user: gemm_unsupported's, or another.
void gemm_cuda(const GemmArgs& args, void* stream);
// Empty when gemm_cuda runs inputs of `input_dtype` on CUDA device `device`, else why not (BF16 below
// sm_80, or a build without an sm_80+ image of the BF16 kernel). `device` must be the current device.
std::string gemm_unsupported(DType input_dtype, int device);
// The CUDA GEMM's kernel for 16-byte-aligned operands on a compute capability 9.0 GPU: MPFUSED_GEMM_KERNEL=wgmma
// takes the Hopper kernel (sm_90a warpgroup MMAs, gemm.cu; not yet run on a GPU, so not the default), "wgmma-cluster"
// the same in clusters of two CTAs that share B's tiles, unset or "wmma" the WMMA kernel that every GPU runs; any
// other value throws std::invalid_argument.
enum class GemmKernelChoice { kWmma, kWgmma, kWgmmaCluster };
GemmKernelChoice gemm_kernel_choice();
bool gemm_sm90_built();  // this build holds sm_90a code (its TORCH_CUDA_ARCH_LIST named 9.0)
// Whether gemm_cuda takes the Hopper kernel on `device` for operands that are (vector_path) or are not
// 16-byte aligned.
bool gemm_sm90_selected(bool vector_path, int device);
// What the calling thread's last gemm_cuda call launched (host state: no device work, no sync; per thread, so a
// backward that autograd runs on its own thread leaves the caller's record as it was, and a CUDA graph's replays
// do not touch it). Where the Hopper
// kernel was selected (gemm_sm90_selected) but did not run, passed_over says why (a static string; nullptr where it
// ran or was not selected) and the WMMA kernel ran, with the same results: the tests cannot tell the kernels apart
// by their outputs, and the torch layer warns once where the device or driver refused it (`unexpected`: a tensor
// map the driver refused, too few registers, no cluster that fits; not K = 0 or coordinates past int32).
struct GemmLaunch {
  bool launched = false;  // a kernel ran (false before any call and for an empty output)
  GemmKernelChoice kernel = GemmKernelChoice::kWmma;
  const char* passed_over = nullptr;
  bool unexpected = false;
};
GemmLaunch gemm_last_launch();
void gemm_clear_last_launch();  // for a CUDA GEMM that launches nothing before reaching gemm_cuda (an empty output)
void philox_raw_cuda(const uint32_t* ctr, uint32_t* out, int64_t n, uint32_t k0, uint32_t k1, void* stream);
void philox_words_cuda(const RandomArgs& r, uint32_t* words, void* stream);
void round_stochastic_cuda(const RandomArgs& r, const float* src, void* dst, DType dst_dtype, void* stream);
void fixed_quantize_cuda(const FixedQuantizeArgs& args, void* stream);
void fixed_matmul_cuda(const FixedMatmulArgs& args, void* stream);
// The CUDA MACC's kernel for int16 x int16 codes on CUDA device `device` (int32 codes always take the CUDA cores):
// the tensor cores where the GPU has integer ones (compute capability 7.2 and newer), else the CUDA cores;
// MPFUSED_FIXED_MATMUL_KERNEL = "tensor-cores" / "cuda-cores" chooses (any other value, or "tensor-cores" on a GPU
// without them, throws std::invalid_argument). Both give the same codes.
enum class FixedMatmulKernel { kTensorCores, kCudaCores };
FixedMatmulKernel fixed_matmul_kernel(int device);
int cuda_runtime_version_compiled();  // CUDART_VERSION the kernels were built with

}  // namespace mpf
