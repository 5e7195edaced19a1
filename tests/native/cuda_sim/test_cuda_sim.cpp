// csrc/cuda's kernels, run by the CUDA simulator (sim.h), against the CPU backend.
//
// Every kernel the CUDA backend has runs here on the cases a first GPU run would meet: tensors of 0, 1 and
// chunk +- 1 elements, storage offsets of 1 to 7 elements (misaligned vector access), lists long enough to be
// split over several launches, every mode of each entry point; grid-stride loops loop (the simulated device
// has 2 SMs). The results must equal the CPU backend's bit for bit where the backends promise it (element-wise
// work, the random bits, fixed point, exact sums), and within a stated bound where they sum in another order.
// Built three ways (CMakeLists.txt): plain, with AddressSanitizer + UBSan (out-of-bounds and misaligned
// accesses), and with ThreadSanitizer (shared-memory races, missing barriers). Without a GPU this proves the
// kernels' logic, not their speed or the hardware's own behaviour (sim.h lists what it does not model).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../check.h"
#include "kernels.h"
#include "sim_config.h"

using namespace mpf;

namespace {

// SIM_SCALE=small (the ThreadSanitizer build): fewer and smaller cases, the same kinds.
bool small_scale() {
  const char* s = std::getenv("MPF_SIM_SCALE");
  return s && std::strcmp(s, "small") == 0;
}

// An exactly sized heap block whose data starts `offset` bytes in: AddressSanitizer sees any access past it.
struct Buf {
  std::unique_ptr<unsigned char[]> mem;
  unsigned char* data = nullptr;
  size_t bytes = 0;
  Buf() = default;
  Buf(size_t bytes_, size_t offset) : mem(new unsigned char[std::max<size_t>(1, offset + bytes_)]), bytes(bytes_) {
    data = mem.get() + offset;
  }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(data);
  }
  Buf clone(size_t offset) const {
    Buf b(bytes, offset);
    if (bytes) std::memcpy(b.data, data, bytes);
    return b;
  }
  bool same(const Buf& o) const { return bytes == o.bytes && (bytes == 0 || std::memcmp(data, o.data, bytes) == 0); }
};

// Scratch memory handed to the CUDA entry points: exactly sized blocks, freed with the case.
struct Scratch {
  std::vector<std::unique_ptr<unsigned char[]>> blocks;
  ScratchAllocator allocator() {
    return ScratchAllocator{this, [](void* ctx, int64_t bytes) -> void* {
                              auto* s = static_cast<Scratch*>(ctx);
                              // 0xFF: a NaN or -1 wherever a kernel reads what it did not write
                              s->blocks.emplace_back(new unsigned char[std::max<size_t>(1, static_cast<size_t>(bytes))]);
                              std::memset(s->blocks.back().get(), 0xff, static_cast<size_t>(bytes));
                              return s->blocks.back().get();
                            }};
  }
};

// Runs f; true when it threw (a refused or trapped launch surfaces as cuda_check's runtime_error).
bool throws(const std::function<void()>& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const std::exception& e) {
    if (message) *message = e.what();
    return true;
  }
  return false;
}

uint16_t store16(DType d, float x) { return d == DType::kFloat16 ? float_to_f16_bits(x) : float_to_bf16_bits(x); }

// Element i of a tensor, as FP32.
float load(const Buf& b, DType d, int64_t i) {
  if (d == DType::kFloat32) return b.as<float>()[i];
  const uint16_t h = b.as<uint16_t>()[i];
  return d == DType::kFloat16 ? f16_bits_to_float(h) : bf16_bits_to_float(h);
}
void store(Buf& b, DType d, int64_t i, float x) {
  if (d == DType::kFloat32) b.as<float>()[i] = x;
  else b.as<uint16_t>()[i] = store16(d, x);
}

const DType kDtypes[3] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Equal bits, or NaN on both sides: a NaN's payload is not kept (the GPU's FP16 NaN is 0x7FFF, the CPU's 0x7E00).
bool same_values(const Buf& a, const Buf& b, DType d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = load(a, d, i), y = load(b, d, i);
    if (std::isnan(x) && std::isnan(y)) continue;
    if (d == DType::kFloat32 ? std::memcmp(&a.as<float>()[i], &b.as<float>()[i], 4) != 0
                             : a.as<uint16_t>()[i] != b.as<uint16_t>()[i])
      return false;
  }
  return true;
}

// ---- multi-tensor overflow reduction --------------------------------------------------------------------------
struct OverflowCase {
  std::vector<int64_t> numel;
  bool integers;    // small integers: every sum of squares is exact in any order
  int nonfinite;    // 0: none, 1: an inf, 2: a NaN, in a random tensor at a random place
};

void overflow_case(const OverflowCase& oc, std::mt19937& rng, bool use_inv, bool unscale, bool sumsq, bool overwrite,
                   bool norm, bool counter) {
  const size_t n = oc.numel.size();
  std::vector<Buf> host, dev;
  std::vector<TensorRef> th(n), td(n);
  std::uniform_int_distribution<int> small(-3, 3);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (size_t t = 0; t < n; ++t) {
    const DType d = kDtypes[rng() % 3];
    const size_t offset = (rng() % 8) * static_cast<size_t>(dtype_size(d));  // 0 to 7 elements
    Buf b(static_cast<size_t>(oc.numel[t] * dtype_size(d)), offset);
    for (int64_t i = 0; i < oc.numel[t]; ++i) store(b, d, i, oc.integers ? static_cast<float>(small(rng)) : normal(rng));
    dev.push_back(b.clone(offset));
    host.push_back(std::move(b));
    th[t] = TensorRef{host[t].data, oc.numel[t], d};
    td[t] = TensorRef{dev[t].data, oc.numel[t], d};
  }
  if (oc.nonfinite) {
    std::vector<size_t> nonempty;
    for (size_t t = 0; t < n; ++t)
      if (oc.numel[t] > 0) nonempty.push_back(t);
    if (!nonempty.empty()) {
      const size_t t = nonempty[rng() % nonempty.size()];
      const int64_t i = static_cast<int64_t>(rng() % static_cast<uint64_t>(oc.numel[t]));
      const float v = oc.nonfinite == 1 ? INFINITY : NAN;
      store(host[t], th[t].dtype, i, v);
      store(dev[t], td[t].dtype, i, v);
    }
  }
  const float inv = oc.integers ? 0.25f : 1.f / 3.f;
  const float start = overwrite ? 5.f : 0.f, start_sum = overwrite ? -7.f : 2.f;
  float fh = start, fd = start, sh = start_sum, sd = start_sum, nh = -1.f, nd = -1.f;
  unsigned int ctr = 0;
  OverflowArgs a{};
  a.num_tensors = static_cast<int64_t>(n);
  a.inv_scale = use_inv ? &inv : nullptr;
  a.unscale = unscale;
  a.overwrite = overwrite;
  OverflowArgs ah = a, ad = a;
  ah.tensors = th.data();
  ah.found_inf = &fh;
  ah.sumsq = sumsq ? &sh : nullptr;
  ah.norm = norm ? &nh : nullptr;
  ad.tensors = td.data();
  ad.found_inf = &fd;
  ad.sumsq = sumsq ? &sd : nullptr;
  ad.norm = norm ? &nd : nullptr;
  ad.counter = counter ? &ctr : nullptr;
  overflow_check_cpu(ah, 1);
  Scratch scratch;
  std::string err;
  const bool threw = throws([&] { overflow_check_cuda(ad, scratch.allocator(), nullptr); }, &err);
  const std::string what = "overflow: " + std::to_string(n) + " tensors, first numel " +
                           std::to_string(n ? oc.numel[0] : 0) + ", mode inv " + std::to_string(use_inv) +
                           " unscale " + std::to_string(unscale) + " sumsq " + std::to_string(sumsq) + " overwrite " +
                           std::to_string(overwrite) + " norm " + std::to_string(norm) + " counter " +
                           std::to_string(counter) + " integers " + std::to_string(oc.integers) + " nonfinite " +
                           std::to_string(oc.nonfinite);
  CHECK(!threw, "%s: %s", what.c_str(), err.c_str());
  if (threw) return;
  CHECK(fh == fd, "%s: found_inf cpu %g cuda %g", what.c_str(), fh, fd);
  CHECK(ctr == 0, "%s: the lent counter is left at %u", what.c_str(), ctr);
  bool data_same = true;
  for (size_t t = 0; t < n; ++t) data_same = data_same && same_values(host[t], dev[t], th[t].dtype, oc.numel[t]);
  CHECK(data_same, "%s: the tensors differ after the call", what.c_str());
  if (sumsq) {
    if (oc.integers || fh != 0.f) {
      // Exact (squares of small integers times 1/16), or NaN/inf on both: equal bits.
      CHECK(std::memcmp(&sh, &sd, 4) == 0 || (std::isnan(sh) && std::isnan(sd)), "%s: sumsq cpu %.9g cuda %.9g",
            what.c_str(), sh, sd);
    } else {
      // FP32 partial sums in another order: both within n * 2^-24 of each other, relative (n <= 2^17 terms a
      // partial at most, and the partials are summed in FP64 on the GPU).
      CHECK(std::fabs(sh - sd) <= 2e-3f * std::fabs(sh), "%s: sumsq cpu %.9g cuda %.9g", what.c_str(), sh, sd);
    }
    if (norm) {
      CHECK(nd == std::sqrt(sd) || (std::isnan(nd) && std::isnan(sd)), "%s: norm %.9g of sumsq %.9g", what.c_str(), nd, sd);
      CHECK(std::memcmp(&nh, &nd, 4) == 0 || oc.integers == false, "%s: norm cpu %.9g cuda %.9g", what.c_str(), nh, nd);
    }
  }
}

void test_overflow(std::mt19937& rng) {
  const int64_t C = kCudaOverflowLimits.chunk_size;
  std::vector<OverflowCase> cases = {
      {{0}, true, 0},
      {{1}, true, 0},
      {{7, 0, 8, 9}, true, 0},
      {{C - 1, 1, C, C + 1}, true, 0},
      {{3 * C + 5}, true, 1},
      {{C + 3, 17}, true, 2},
      {{C / 2, 3 * C + 1, 5}, false, 0},
  };
  if (!small_scale()) {
    // More tensors than one launch holds (1024): the list is split, and the last-block reductions chain.
    std::vector<int64_t> many(1100);
    for (int64_t& m : many) m = 1 + static_cast<int64_t>(rng() % 9);
    many[700] = C + 2;
    cases.push_back({many, true, 0});
    cases.push_back({many, true, 1});
  }
  for (const OverflowCase& oc : cases)
    for (int mode = 0; mode < 64; ++mode) {
      const bool use_inv = mode & 1, unscale = mode & 2, sumsq = mode & 4, overwrite = mode & 8, norm = mode & 16,
                 counter = mode & 32;
      if (unscale && !use_inv) continue;
      if (norm && !sumsq) continue;
      // The long lists (1100 tensors, ~1100 blocks a launch; the split and the chained reductions): without a
      // non-finite value, the check alone, the sum with overwrite, norm and a lent counter, and every bit at
      // once; with one, every bit at once.
      if (oc.numel.size() > 1000 && mode != 63 && (oc.nonfinite || (mode != 0 && mode != (4 | 8 | 16 | 32)))) continue;
      if (small_scale() && oc.numel.size() > 1 && (mode % 3) != 0) continue;
      overflow_case(oc, rng, use_inv, unscale, sumsq, overwrite, norm, counter);
    }

  // A lent counter that is not zero (shared with another launch, or never zeroed): the kernel traps, and the
  // call fails instead of returning a wrong result.
  {
    Buf b(64 * 4, 0);
    for (int i = 0; i < 64; ++i) b.as<float>()[i] = 1.f;
    TensorRef t{b.data, 64, DType::kFloat32};
    float found = 0.f, sum = 0.f, norm = 0.f;
    unsigned int ctr = 3;  // more than the grid's one block
    OverflowArgs a{};
    a.tensors = &t;
    a.num_tensors = 1;
    a.found_inf = &found;
    a.sumsq = &sum;
    a.overwrite = true;
    a.norm = &norm;
    a.counter = &ctr;
    Scratch scratch;
    std::string err;
    // (The simulator reports the trap at the launch; a GPU reports it at the next synchronising call.)
    CHECK(throws([&] { overflow_check_cuda(a, scratch.allocator(), nullptr); }, &err), "a stale counter must trap");
  }

}

// A driver older than CUDA 12.1 cannot take the 32 KB argument packs: a clear error naming the driver, before
// any launch. The driver is queried once per process (as the real one cannot change), so this part runs in a
// process of its own (`test_cuda_sim old_driver`).
void test_old_driver(std::mt19937&) {
  mpf_sim::config().driver_version = 12000;
  Buf b(4, 0);
  b.as<float>()[0] = 1.f;
  TensorRef t{b.data, 1, DType::kFloat32};
  float found = 0.f;
  OverflowArgs a{};
  a.tensors = &t;
  a.num_tensors = 1;
  a.found_inf = &found;
  Scratch scratch;
  std::string err;
  CHECK(throws([&] { overflow_check_cuda(a, scratch.allocator(), nullptr); }, &err), "an old driver must be refused");
  CHECK(err.find("CUDA 12.0") != std::string::npos, "the error names the driver found: %s", err.c_str());
  OptimTensor ot{};
  ot.param = b.data;
  ot.grad = b.data;
  ot.numel = 1;
  ot.dtype = DType::kFloat32;
  OptimArgs o{};
  o.kind = OptimKind::kSgd;
  o.tensors = &ot;
  o.num_tensors = 1;
  err.clear();
  CHECK(throws([&] { optim_step_cuda(o, scratch.allocator(), nullptr); }, &err), "an old driver must be refused");
  CHECK(err.find("CUDA 12.0") != std::string::npos, "the optimizer's error names the driver found: %s", err.c_str());
  CHECK(mpf_sim::stats().launches == 0, "nothing launched with an old driver");
}

// ---- the fused optimizer step ------------------------------------------------------------------------------------
struct Tensors {  // one param's buffers
  DType dtype;
  int64_t numel;
  Buf param, grad, master, remainder, step;
  Buf state[kMaxStates];
};

// aligned: every buffer 16-byte aligned (the GPU's vector path, as torch's allocations give), else each with
// its own offset of 0 to 7 elements.
Tensors clone(const Tensors& t, std::mt19937& rng, bool aligned) {
  Tensors c;
  c.dtype = t.dtype;
  c.numel = t.numel;
  auto off = [&](size_t elem) { return aligned ? 0 : (rng() % 8) * elem; };  // another misalignment here
  c.param = t.param.clone(off(static_cast<size_t>(dtype_size(t.dtype))));
  c.grad = t.grad.clone(off(static_cast<size_t>(dtype_size(t.dtype))));
  if (t.master.mem) c.master = t.master.clone(off(4));
  if (t.remainder.mem) c.remainder = t.remainder.clone(off(2));
  if (t.step.mem) c.step = t.step.clone(0);
  for (int k = 0; k < kMaxStates; ++k)
    if (t.state[k].mem) c.state[k] = t.state[k].clone(off(4));
  return c;
}

// Empty when every buffer is equal, else the first that is not.
std::string differs(const Tensors& a, const Tensors& b) {
  auto first = [](const Buf& x, const Buf& y, size_t elem) {
    for (size_t i = 0; i < x.bytes; ++i)
      if (x.data[i] != y.data[i]) return " at element " + std::to_string(i / elem);
    return std::string();
  };
  const size_t es = static_cast<size_t>(dtype_size(a.dtype));
  if (!a.param.same(b.param)) return "param" + first(a.param, b.param, es);
  if (!a.grad.same(b.grad)) return "grad" + first(a.grad, b.grad, es);
  if (!a.master.same(b.master)) return "master" + first(a.master, b.master, 4);
  if (!a.remainder.same(b.remainder)) return "remainder" + first(a.remainder, b.remainder, 2);
  if (!a.step.same(b.step)) return "step";
  for (int k = 0; k < kMaxStates; ++k)
    if (!a.state[k].same(b.state[k])) return "state " + std::to_string(k) + first(a.state[k], b.state[k], 4);
  return {};
}

// The spacing of dtype d's values at |x|: one unit in the last place.
double ulp(DType d, float x) {
  const int mant = d == DType::kFloat32 ? 23 : d == DType::kFloat16 ? 10 : 7;
  const int min_exp = d == DType::kFloat16 ? -14 : -126;
  int e = 0;
  std::frexp(std::fabs(x), &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(1.0, std::max(e - 1, min_exp) - mant);
}

// Two-pass policies (LAMB): the CPU adds a tensor's sums in FP64 lanes, the GPU in FP32 per thread (at most
// kChunk / 256 = 256 terms, relative error <= 256 * 2^-24 ~ 1.5e-5) and then FP64 across threads, so the trust
// ratio, and with it the step, may differ relatively by ~1e-5. Allowed: 1e-4 of the CPU's step on the weight
// (margin for the square root and the division), plus one unit in the last place of the stored weight (the
// rounding may go the other way). The states do not depend on the ratio: equal bits.
bool two_pass_close(const Tensors& before, const Tensors& h, const Tensors& d, std::string* where) {
  auto close = [&](float old, float x, float y, DType dt) {
    if (std::isnan(x) && std::isnan(y)) return true;
    return std::fabs(static_cast<double>(x) - y) <= 1e-4 * std::fabs(static_cast<double>(x) - old) + ulp(dt, x);
  };
  for (int64_t i = 0; i < h.numel; ++i) {
    // The FP32 weight: the master, a BF16 param joined with its remainder, or the param.
    auto weight = [&](const Tensors& t) {
      if (t.master.mem) return t.master.as<float>()[i];
      if (t.remainder.mem) return join_master(t.param.as<uint16_t>()[i], t.remainder.as<int16_t>()[i]);
      return load(t.param, t.dtype, i);
    };
    const float old = weight(before), hw = weight(h), dw = weight(d);
    const DType wt = h.master.mem || h.remainder.mem ? DType::kFloat32 : h.dtype;
    if (!close(old, hw, dw, wt) || !close(old, load(h.param, h.dtype, i), load(d.param, d.dtype, i), h.dtype)) {
      *where = "element " + std::to_string(i) + ": weight " + std::to_string(old) + " -> cpu " + std::to_string(hw) +
               " cuda " + std::to_string(dw);
      return false;
    }
  }
  for (int k = 0; k < kMaxStates; ++k)
    if (!h.state[k].same(d.state[k])) {
      *where = "state " + std::to_string(k);
      return false;
    }
  return h.step.same(d.step) && h.grad.same(d.grad);
}

OptimTensor ref(Tensors& t, uint64_t sr_offset) {
  OptimTensor o{};
  o.param = t.param.data;
  o.grad = t.grad.data;
  o.master = t.master.mem ? t.master.as<float>() : nullptr;
  for (int k = 0; k < kMaxStates; ++k) o.state[k] = t.state[k].mem ? t.state[k].as<float>() : nullptr;
  o.step = t.step.mem ? t.step.as<float>() : nullptr;
  o.numel = t.numel;
  o.dtype = t.dtype;
  o.remainder = t.remainder.mem ? t.remainder.as<int16_t>() : nullptr;
  o.sr_offset = sr_offset;
  return o;
}

struct OptimSetup {
  bool stochastic, inv_scale, grad_scale, clip, skip, write_grad, counter, lr_tensor, lr_double, hyper_ref, aligned;
  int weights;  // 0: masters, 1: the params themselves, 2: BF16 remainders where the param is BF16
};

template <class P>
void optim_case(const char* name, const std::vector<double>& hyper, const std::vector<int64_t>& sizes,
                const OptimSetup& s, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const typename P::Hyper h = P::make(hyper.data());
  const uint32_t mask = P::state_mask(P::flags(h));
  const bool with_step = s.stochastic || P::needs_step(P::flags(h));
  std::vector<Tensors> host;
  auto off = [&](size_t elem) { return s.aligned ? 0 : (rng() % 8) * elem; };
  for (int64_t numel : sizes) {
    Tensors t;
    t.dtype = kDtypes[rng() % 3];
    t.numel = numel;
    const size_t es = static_cast<size_t>(dtype_size(t.dtype));
    t.param = Buf(numel * es, off(es));
    t.grad = Buf(numel * es, off(es));
    const bool master = t.dtype != DType::kFloat32 && s.weights == 0;
    const bool remainder = t.dtype == DType::kBFloat16 && s.weights == 2;
    if (master) t.master = Buf(numel * 4, off(4));
    if (remainder) t.remainder = Buf(numel * 2, off(2));
    // Some elements keep a tiny weight or zero through the step (no gradient, zero states): the FP16
    // stochastic write-back then takes its general formula for their vectors (cuda/optim.cu's f16_sr_vec)
    // beside the normal-range form elsewhere.
    auto still = [](int64_t i) { return i % 53 == 5 || i % 53 == 11; };
    for (int64_t i = 0; i < numel; ++i) {
      const float w = i % 53 == 5 ? normal(rng) * 1e-6f : i % 53 == 11 ? 0.f : normal(rng);
      store(t.param, t.dtype, i, w);
      if (master) t.master.as<float>()[i] = w;
      if (remainder) {  // an FP32 master split into its BF16 param and remainder (core/master_split.h)
        const uint32_t bits = float_as_bits(w * (1.f + std::ldexp(static_cast<float>(rng() % 256), -16)));
        t.param.as<uint16_t>()[i] = split_master_hi(bits);
        t.remainder.as<int16_t>()[i] = split_master_lo(bits, split_master_hi(bits));
      }
      store(t.grad, t.dtype, i, still(i) ? 0.f : normal(rng) * (s.inv_scale || s.grad_scale ? 64.f : 1.f));
    }
    for (int k = 0; k < P::kNumStates; ++k)
      if ((mask >> k) & 1u) {
        t.state[k] = Buf(numel * 4, off(4));
        for (int64_t i = 0; i < numel; ++i) t.state[k].as<float>()[i] = still(i) ? 0.f : std::fabs(normal(rng)) * 0.01f;
      }
    if (with_step) {
      t.step = Buf(4, 0);
      t.step.as<float>()[0] = static_cast<float>(rng() % 5);
    }
    host.push_back(std::move(t));
  }
  std::vector<Tensors> dev;
  for (const Tensors& t : host) dev.push_back(clone(t, rng, s.aligned));

  const float inv = 1.f / 64.f, gscale = 64.f, lr_dev = 1e-2f;
  const double lr_dev64 = 1.25e-2;  // a float64 lr tensor (what a compiled step passes)
  float found = s.skip ? 1.f : 0.f;
  double hyper_dev = hyper[0];
  float clip_sumsq = 0.f;
  if (s.clip) {
    double sum = 0.0;
    for (const Tensors& t : host)
      for (int64_t i = 0; i < t.numel; ++i) {
        const double g = load(t.grad, t.dtype, i) * (s.inv_scale || s.grad_scale ? inv : 1.f);
        sum += g * g;
      }
    clip_sumsq = static_cast<float>(sum);
  }
  unsigned int ctr = 0;
  auto args = [&](std::vector<Tensors>& ts, std::vector<OptimTensor>& refs) {
    uint64_t offset = 0;
    for (Tensors& t : ts) {
      refs.push_back(ref(t, offset));
      offset += static_cast<uint64_t>(t.numel);
    }
    OptimArgs a{};
    dispatch_optim_all([&](auto p) {
      if constexpr (std::is_same_v<decltype(p), P>) {
        OptimKind k{};
        optim_kind(P::kName, &k);
        a.kind = k;
      }
    });
    a.tensors = refs.data();
    a.num_tensors = static_cast<int64_t>(refs.size());
    a.lr = 1e-2;
    a.lr_ref = !s.lr_tensor ? HyperRef{nullptr, false} : s.lr_double ? HyperRef{&lr_dev64, true} : HyperRef{&lr_dev, false};
    for (size_t i = 0; i < hyper.size(); ++i) a.hyper[i] = hyper[i];
    if (s.hyper_ref) a.hyper_ref[0] = HyperRef{&hyper_dev, true};
    a.inv_scale = s.inv_scale ? &inv : nullptr;
    a.grad_scale = !s.inv_scale && s.grad_scale ? &gscale : nullptr;
    a.clip_sumsq = s.clip ? &clip_sumsq : nullptr;
    a.max_norm = s.clip ? 0.5f : INFINITY;
    a.found_inf = &found;
    a.write_grad = s.write_grad;
    a.counter = s.counter ? &ctr : nullptr;
    a.rounding = s.stochastic ? Rounding::kStochastic : Rounding::kNearest;
    a.seed = 0x1234abcd5678ull;
    return a;
  };
  const int steps = small_scale() ? 1 : 2;
  std::string what = std::string(name) + ": " + std::to_string(sizes.size()) + " tensors, stochastic " +
                     std::to_string(s.stochastic) + " inv " + std::to_string(s.inv_scale) + " gscale " +
                     std::to_string(s.grad_scale) + " clip " + std::to_string(s.clip) + " skip " +
                     std::to_string(s.skip) + " write_grad " + std::to_string(s.write_grad) + " counter " +
                     std::to_string(s.counter) + " weights " + std::to_string(s.weights) + " aligned " +
                     std::to_string(s.aligned);
  for (int step = 0; step < steps; ++step) {
    std::vector<Tensors> before;
    if (P::kNumSums > 0)
      for (const Tensors& t : host) before.push_back(clone(t, rng, true));
    std::vector<OptimTensor> rh, rd;
    const OptimArgs ah = args(host, rh), ad = args(dev, rd);
    optim_step_cpu(ah, 1);
    Scratch scratch;
    std::string err;
    const bool threw = throws([&] { optim_step_cuda(ad, scratch.allocator(), nullptr); }, &err);
    CHECK(!threw, "%s: %s", what.c_str(), err.c_str());
    if (threw) return;
    CHECK(ctr == 0, "%s: the lent counter is left at %u", what.c_str(), ctr);
    for (size_t t = 0; t < host.size(); ++t) {
      if (P::kNumSums == 0) {
        const std::string d = differs(host[t], dev[t]);
        CHECK(d.empty(), "%s: tensor %zu (numel %lld, %s): %s differs after step %d", what.c_str(), t,
              static_cast<long long>(host[t].numel), dtype_name(host[t].dtype), d.c_str(), step);
      } else {
        std::string where;
        CHECK(two_pass_close(before[t], host[t], dev[t], &where), "%s: tensor %zu (numel %lld, %s) after step %d: %s",
              what.c_str(), t, static_cast<long long>(host[t].numel), dtype_name(host[t].dtype), step, where.c_str());
        // The next step starts from the same values on both sides.
        dev[t] = clone(host[t], rng, s.aligned);
      }
    }
  }
}

template <class P>
void optim_policy(const char* name, const std::vector<std::vector<double>>& hypers, std::mt19937& rng) {
  const int64_t C = kCudaOptimLimits.chunk_size;
  // {3000, 5128, 1029}: chunks of 3, 6 and 2 windows of 1,024 elements (the loops take two at a time).
  // {3000, 5129, 1029, 2051, 9}: the stochastic write-back's runs of warp windows (256 elements, 128 for
  // LAMB) end mid-window and some warps get none; elements start at places 0, 0, 1, 6 and 1 of their Philox
  // blocks (odd places shift the bits by a half-word), so windows end in the next window's first block.
  std::vector<std::vector<int64_t>> lists = {{1}, {0, 5, 8, 3}, {C - 1, 7, C + 1}, {3000, 5128, 1029},
                                             {3000, 5129, 1029, 2051, 9}};
  if (!small_scale()) {
    lists.push_back({2 * C + 3, 0, 1});
    std::vector<int64_t> many(400);  // more than a launch's 384 tensors
    for (int64_t& m : many) m = static_cast<int64_t>(rng() % 12);
    many[390] = C + 9;
    lists.push_back(many);
  }
  for (size_t hi = 0; hi < hypers.size(); ++hi)
    for (size_t l = 0; l < lists.size(); ++l)
      for (int v = 0; v < 12; ++v) {
        const std::vector<double>& hyper = hypers[hi];
        // Under TSan (small scale): a quarter of the variants, and v = 3 (stochastic rounding, misaligned buffers)
        // and v = 9 (stochastic, aligned): the write-back's shared Philox blocks and its barriers.
        if (small_scale() && v % 4 != 0 && v != 3 && v != 9) continue;
        // The long list (400 tensors, a launch split; ~400 blocks a launch), with the first hyperparameters, in
        // two variants: a lent counter, aligned buffers, stochastic rounding; no counter, misaligned buffers.
        if (lists[l].size() > 384 && (hi > 0 || (v != 1 && v != 3))) continue;
        // The other hyperparameters (the policy's other branches) in a third of the variants each.
        if (hi > 0 && v % 3 != static_cast<int>(hi % 3)) continue;
        OptimSetup s{};
        s.stochastic = v % 2 == 1;
        s.inv_scale = v % 3 == 0;
        s.grad_scale = v % 3 == 1;
        s.clip = v % 4 == 2;
        s.skip = v == 5;
        s.write_grad = v % 5 == 1;
        s.counter = v % 4 < 2;
        s.lr_tensor = v % 2 == 0;
        s.lr_double = v % 4 == 2;
        s.hyper_ref = v == 4;
        s.weights = v % 3;
        s.aligned = v % 4 != 3;
        optim_case<P>(name, hyper, lists[l], s, rng);
      }
}

void test_optim(std::mt19937& rng) {
  optim_policy<AdamPolicy>("adam", {{0.9, 0.999, 1e-8, 0.01, 1, 0, 1}, {0.8, 0.99, 1e-6, 0.1, 0, 1, 0}}, rng);
  optim_policy<SgdPolicy>("sgd", {{0.9, 0.0, 1e-4, 1, 0}, {0.0, 0.0, 0.0, 0, 0}, {0.9, 0.1, 0.0, 0, 1}}, rng);
  optim_policy<LambPolicy>("lamb", {{0.9, 0.999, 1e-6, 0.01, 1, 1, 1, 1.0, 0}, {0.9, 0.99, 1e-6, 0.0, 0, 0, 0, 0.0, 1}}, rng);
  optim_policy<LionPolicy>("lion", {{0.9, 0.99, 0.01, 0}, {0.95, 0.98, 0.0, 1}}, rng);
}

// ---- random bits, stochastic rounding ------------------------------------------------------------------------------
void test_random(std::mt19937& rng) {
  {  // the generator itself
    const int64_t n = small_scale() ? 300 : 1000;
    std::vector<uint32_t> ctr(4 * n), oh(4 * n), od(4 * n);
    for (uint32_t& c : ctr) c = static_cast<uint32_t>(rng());
    philox_raw_cpu(ctr.data(), oh.data(), n, 0x12345678u, 0x9abcdef0u);
    CHECK(!throws([&] { philox_raw_cuda(ctr.data(), od.data(), n, 0x12345678u, 0x9abcdef0u, nullptr); }), "philox_raw");
    CHECK(oh == od, "philox_raw: the words differ");
  }
  const std::vector<int64_t> sizes = small_scale() ? std::vector<int64_t>{0, 1, 9, 3000}
                                                   : std::vector<int64_t>{0, 1, 7, 8, 9, 2048 * 8 + 3, 70001};
  const uint64_t offsets[] = {0, 3, 8, 0xfffffffdull, (uint64_t{1} << 35) + 5};
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t n : sizes)
    for (uint64_t offset : offsets) {
      RandomArgs r{0xfeedbeefull, offset, 0, 0, n};
      {
        std::vector<uint32_t> wh(n + 1), wd(n + 1);
        philox_words_cpu(r, wh.data(), 1);
        CHECK(!throws([&] { philox_words_cuda(r, wd.data(), nullptr); }), "philox_words");
        CHECK(wh == wd, "philox_words: numel %lld offset %llu", static_cast<long long>(n), static_cast<unsigned long long>(offset));
      }
      for (DType d : {DType::kFloat16, DType::kBFloat16}) {
        const size_t so = (rng() % 8) * 4, doff = (rng() % 8) * 2;
        Buf src(n * 4, so), dh(n * 2, doff), dd(n * 2, (doff + 2) % 16);
        for (int64_t i = 0; i < n; ++i) src.as<float>()[i] = normal(rng) * (i % 7 == 0 ? 1e-6f : 1.f);
        round_stochastic_cpu(r, src.as<float>(), dh.data, d, 1);
        CHECK(!throws([&] { round_stochastic_cuda(r, src.as<float>(), dd.data, d, nullptr); }), "round_stochastic");
        CHECK(dh.same(dd), "round_stochastic %s: numel %lld offset %llu", dtype_name(d), static_cast<long long>(n),
              static_cast<unsigned long long>(offset));
      }
      // An aligned source and destination with a block-aligned offset: the kernel's 16-byte path.
      if (offset % 8 == 0) {
        Buf src(n * 4, 0), dh(n * 2, 0), dd(n * 2, 0);
        for (int64_t i = 0; i < n; ++i) src.as<float>()[i] = normal(rng);
        round_stochastic_cpu(r, src.as<float>(), dh.data, DType::kFloat16, 1);
        CHECK(!throws([&] { round_stochastic_cuda(r, src.as<float>(), dd.data, DType::kFloat16, nullptr); }), "round_stochastic");
        CHECK(dh.same(dd), "round_stochastic aligned: numel %lld offset %llu", static_cast<long long>(n),
              static_cast<unsigned long long>(offset));
      }
    }
}

// ---- following a write from outside the step (follow.cu) -------------------------------------------------------------
// Params of both 16-bit dtypes with FP32 masters and BF16 params with remainders in one call (split over several
// launches when the list is long), at offsets that misalign the 16-byte path, against the CPU backend: values of
// every kind (on and between the grid, zeros, subnormals, past the largest finite value, inf, NaN), params that
// are their master's rounding or not.
void test_follow(std::mt19937& rng) {
  const std::vector<int64_t> sizes = small_scale() ? std::vector<int64_t>{0, 1, 9, 700}
                                                   : std::vector<int64_t>{0, 1, 7, 8, 9, 4099, (int64_t{1} << 16) + 3};
  std::normal_distribution<float> normal(0.f, 1.f);
  const float specials[] = {0.f, -0.f, INFINITY, -INFINITY, NAN, 65504.f, 70000.f, 3e38f, 1e-7f, 1e-40f};
  for (const bool stochastic : {false, true})
    for (const int count : {3, small_scale() ? 5 : 530}) {  // 530 > kCudaFollowLimits.max_tensors: two launches
      std::vector<Buf> params, host, device;
      std::vector<FollowTensor> th, td;
      for (int t = 0; t < count; ++t) {
        const int64_t n = count > 3 ? 1 + static_cast<int64_t>(rng() % 40)
                          : t == 0 ? sizes.back() : sizes[rng() % sizes.size()];
        const DType d = rng() % 2 ? DType::kFloat16 : DType::kBFloat16;
        const bool remainder = d == DType::kBFloat16 && rng() % 3 == 0;
        const size_t off = count == 3 && t == 0 ? 0 : (rng() % 8) * 2;
        Buf q(n * 2, off), target(n * (remainder ? 2 : 4), remainder ? off : (rng() % 4) * 4);
        for (int64_t i = 0; i < n; ++i) {
          float m = rng() % 4 == 0 ? specials[rng() % 10] : normal(rng);
          const uint16_t near = d == DType::kFloat16 ? float_to_f16_bits(m) : float_to_bf16_bits(m);
          uint16_t h = near;
          switch (rng() % 4) {
            case 0: break;
            case 1: h = static_cast<uint16_t>(near + 1); break;
            case 2: h = static_cast<uint16_t>(near - 1); break;
            default: h = static_cast<uint16_t>(rng()); break;
          }
          q.as<uint16_t>()[i] = h;
          if (remainder) target.as<int16_t>()[i] = static_cast<int16_t>(rng());
          else target.as<float>()[i] = m;
        }
        // The device's copy at an alignment of its own; the first tensor of the short list has everything
        // 16-byte aligned (the vector path over several chunks; random offsets reach it 1 time in 32).
        const size_t esize = remainder ? 2 : 4;
        const bool aligned = count == 3 && t == 0;
        Buf hb = target.clone(static_cast<size_t>(target.data - target.mem.get())),
            db = target.clone(aligned ? 0 : (rng() % 8) * esize % 16);
        th.push_back({q.data, remainder ? nullptr : hb.as<float>(), remainder ? hb.as<int16_t>() : nullptr, n, d});
        td.push_back({q.data, remainder ? nullptr : db.as<float>(), remainder ? db.as<int16_t>() : nullptr, n, d});
        params.push_back(std::move(q));
        host.push_back(std::move(hb));
        device.push_back(std::move(db));
      }
      follow_writes_cpu(FollowArgs{th.data(), static_cast<int64_t>(th.size()), stochastic}, 1);
      CHECK(!throws([&] { follow_writes_cuda(FollowArgs{td.data(), static_cast<int64_t>(td.size()), stochastic}, nullptr); }),
            "follow_writes");
      for (int t = 0; t < count; ++t) {
        // NaNs compared as NaNs (their payloads are not part of the rules; the backends widen alike anyway)
        bool same = host[t].same(device[t]);
        if (!same && th[t].master) {
          same = true;
          for (int64_t i = 0; i < th[t].numel; ++i) {
            const float a = th[t].master[i], b = td[t].master[i];
            same = same && (std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b)));
          }
        }
        CHECK(same, "follow_writes %s: tensor %d (%s, numel %lld, %s)", stochastic ? "stochastic" : "nearest", t,
              dtype_name(th[t].dtype), static_cast<long long>(th[t].numel), th[t].remainder ? "remainder" : "master");
      }
    }
}

// ---- fixed point -------------------------------------------------------------------------------------------------------
size_t fixed_size(FixedType t) {
  switch (t) {
    case FixedType::kInt16: case FixedType::kFloat16: case FixedType::kBFloat16: return 2;
    case FixedType::kInt32: case FixedType::kFloat32: return 4;
    case FixedType::kFloat64: return 8;
  }
  return 0;
}

// The int16 MACC on the integer tensor cores (fixed_point.cu's matmul_tc_kernel) against the CPU's codes, and against
// the CUDA-core kernel (MPFUSED_FIXED_MATMUL_KERNEL=cuda-cores): shapes with tails in every dimension and several
// tiles, operands that start off their vectors' alignment (the element-wise loads), the extreme codes (digits 0
// and 255) and depths past kFixedDigitSpan: with every code 32767, 16,584 steps pass the middle sum's int32 range
// (2 * 255^2 a step), so the sums must have moved to 64 bits before (the simulator's integer MMA traps on an int32
// overflow).
void test_fixed_matmul_tensor_cores(std::mt19937& rng) {
  struct Env {
    explicit Env(const char* v) { v ? setenv("MPFUSED_FIXED_MATMUL_KERNEL", v, 1) : unsetenv("MPFUSED_FIXED_MATMUL_KERNEL"); }
    ~Env() { unsetenv("MPFUSED_FIXED_MATMUL_KERNEL"); }
  };
  {
    const mpf_sim::Config saved = mpf_sim::config();
    Env e(nullptr);
    CHECK(fixed_matmul_kernel(0) == FixedMatmulKernel::kTensorCores, "tensor cores by default on this device");
    mpf_sim::config().cc_major = 7;
    mpf_sim::config().cc_minor = 0;
    CHECK(fixed_matmul_kernel(0) == FixedMatmulKernel::kCudaCores, "no integer tensor cores on sm_70");
    Env t("tensor-cores");
    CHECK(throws([] { (void)fixed_matmul_kernel(0); }), "tensor-cores asked of sm_70");
    mpf_sim::config().cc_minor = 2;
    CHECK(fixed_matmul_kernel(0) == FixedMatmulKernel::kTensorCores, "tensor-cores asked of sm_72");
    Env u("fastest");
    CHECK(throws([] { (void)fixed_matmul_kernel(0); }), "an unknown MPFUSED_FIXED_MATMUL_KERNEL");
    mpf_sim::config() = saved;
  }
  struct Case {
    int64_t m, n, k;
    int pattern;  // 0: random codes, 1: +-2^15 extremes (digits 0 and 255), 2: every code 32767
    size_t offset;  // bytes a and b start past a 16-byte boundary
  };
  std::vector<Case> cases = {{70, 130, 40, 0, 0},  {64, 64, 32, 1, 0},   {33, 61, 45, 0, 2},  {5, 9, 3, 1, 6},
                             {129, 3, 100, 0, 0},   {2, 68, 8, 2, 8},     {64, 64, 0, 0, 0},
                             {3, 5, kFixedDigitSpan + 200, 2, 0}, {17, 6, kFixedDigitSpan + 9, 1, 4}};
  if (small_scale()) cases = {cases[0], cases[2], cases[3], cases[7]};
  for (const Case& c : cases) {
    Buf a(static_cast<size_t>(c.m * c.k) * 2, c.offset), b(static_cast<size_t>(c.k * c.n) * 2, c.offset);
    auto fill = [&](Buf& x, int64_t count) {
      for (int64_t i = 0; i < count; ++i)
        x.as<int16_t>()[i] = c.pattern == 0   ? static_cast<int16_t>(rng())
                             : c.pattern == 1 ? static_cast<int16_t>(rng() % 2 ? 32767 : -32768)
                                              : static_cast<int16_t>(32767);
    };
    fill(a, c.m * c.k);
    fill(b, c.k * c.n);
    for (FixedType ot : {FixedType::kInt16, FixedType::kInt32})
      for (Rounding mode : {Rounding::kNearest, Rounding::kStochastic}) {
        // The exact sums reach 2^44 here: shift 40 keeps their top bits, 12 saturates the int16 outputs.
        for (int shift : {0, 12, 40}) {
          const int owl = ot == FixedType::kInt16 ? 16 : 32;
          const FixedShift sh{shift, -(int64_t{1} << (owl - 1)), (int64_t{1} << (owl - 1)) - 1};
          const size_t bytes = static_cast<size_t>(c.m * c.n) * fixed_size(ot);
          Buf oh(bytes, 0), tc(bytes, 0), cc(bytes, 0);  // (outputs are torch's new tensors: aligned)
          FixedMatmulArgs g{a.data, FixedType::kInt16, b.data, FixedType::kInt16, oh.data, ot, c.m, c.n, c.k, sh, mode, 9, 3};
          fixed_matmul_cpu(g, 1);
          {
            Env e(nullptr);
            g.out = tc.data;
            CHECK(!throws([&] { fixed_matmul_cuda(g, nullptr); }), "fixed matmul, tensor cores");
          }
          {
            Env e("cuda-cores");
            g.out = cc.data;
            CHECK(!throws([&] { fixed_matmul_cuda(g, nullptr); }), "fixed matmul, CUDA cores");
          }
          CHECK(oh.same(tc) && oh.same(cc), "fixed matmul %lldx%lldx%lld pattern %d offset %zu out %d mode %d shift %d: "
                "tensor cores %s, CUDA cores %s", static_cast<long long>(c.m), static_cast<long long>(c.n),
                static_cast<long long>(c.k), c.pattern, c.offset, static_cast<int>(ot), static_cast<int>(mode), shift,
                oh.same(tc) ? "equal" : "DIFFER", oh.same(cc) ? "equal" : "DIFFER");
          if (c.k > kFixedDigitSpan) break;  // (the deep cases once per output type and mode: their time is the MMAs')
        }
      }
  }
}

void test_fixed_point(std::mt19937& rng) {
  std::normal_distribution<double> normal(0.0, 4.0);
  const int64_t n = small_scale() ? 1500 : 20011;
  const FixedType srcs[] = {FixedType::kFloat32, FixedType::kFloat64, FixedType::kFloat16, FixedType::kBFloat16};
  const FixedType dsts[] = {FixedType::kInt16, FixedType::kInt32, FixedType::kFloat32, FixedType::kFloat64};
  const FixedFormat fmts[] = {{4, 12}, {2, 6}, {8, 16}, {16, 16}, {1, 31}};
  for (FixedType st : srcs)
    for (FixedType dt : dsts)
      for (FixedFormat f : fmts)
        for (Rounding mode : {Rounding::kNearest, Rounding::kStochastic}) {
          if (dt == FixedType::kInt16 && f.il + f.fl > 16) continue;
          if (dt == FixedType::kFloat32 && f.il + f.fl > 24) continue;
          // Half the cases on the kernel's vector path: element 0 starting a Philox block (offset % 8 == 0)
          // and 16-byte aligned buffers (new[]'s own alignment).
          const bool vector_path = rng() % 2 == 0;
          const uint64_t offset = vector_path ? 8 * (rng() % 13) : rng() % 100;
          Buf src(n * fixed_size(st), vector_path ? 0 : (rng() % 4) * fixed_size(st));
          for (int64_t i = 0; i < n; ++i) {
            const double x = normal(rng) * (i % 5 == 0 ? 1e3 : 1.0);
            switch (st) {
              case FixedType::kFloat32: src.as<float>()[i] = static_cast<float>(x); break;
              case FixedType::kFloat64: src.as<double>()[i] = x; break;
              case FixedType::kFloat16: src.as<uint16_t>()[i] = float_to_f16_bits(static_cast<float>(x)); break;
              default: src.as<uint16_t>()[i] = float_to_bf16_bits(static_cast<float>(x)); break;
            }
          }
          Buf dh(n * fixed_size(dt), 0), dd(n * fixed_size(dt), vector_path ? 0 : (rng() % 4) * fixed_size(dt));
          FixedQuantizeArgs a{src.data, st, dh.data, dt, n, f, mode, 77, offset};
          fixed_quantize_cpu(a, 1);
          a.dst = dd.data;
          CHECK(!throws([&] { fixed_quantize_cuda(a, nullptr); }), "fixed quantize");
          CHECK(dh.same(dd), "fixed quantize: src %d dst %d <%d, %d> mode %d", static_cast<int>(st), static_cast<int>(dt),
                f.il, f.fl, static_cast<int>(mode));
        }
  // Past one pass of the grid (16 blocks of 8 warps on the simulator's 2 SMs: 128 groups of 256 elements),
  // so that warps 0 and 1 take a second group: its Philox words go to the warp's other buffer (with one
  // buffer the codes differ, and ThreadSanitizer reports the race); then the last 37 elements, a thread a
  // Philox block.
  for (FixedType dt : {FixedType::kFloat32, FixedType::kInt16})
    for (Rounding mode : {Rounding::kNearest, Rounding::kStochastic}) {
      const int64_t m = 130 * 256 + 37;
      Buf src(m * 4, 0), dh(m * fixed_size(dt), 0), dd(m * fixed_size(dt), 0);
      for (int64_t i = 0; i < m; ++i) src.as<float>()[i] = static_cast<float>(normal(rng));
      FixedQuantizeArgs a{src.data, FixedType::kFloat32, dh.data, dt, m, {4, 12}, mode, 78, 8 * 1001};
      fixed_quantize_cpu(a, 1);
      a.dst = dd.data;
      CHECK(!throws([&] { fixed_quantize_cuda(a, nullptr); }), "fixed quantize");
      CHECK(dh.same(dd), "fixed quantize, two groups a warp: dst %d mode %d", static_cast<int>(dt), static_cast<int>(mode));
    }

  struct Mm {
    int64_t m, n, k;
  };
  std::vector<Mm> shapes = {{1, 1, 1}, {3, 5, 0}, {63, 65, 17}, {64, 64, 16}, {130, 70, 33}};
  if (small_scale()) shapes.resize(3);
  for (const Mm& s : shapes)
    for (FixedType at : {FixedType::kInt16, FixedType::kInt32})
      for (FixedType ot : {FixedType::kInt16, FixedType::kInt32})
        for (Rounding mode : {Rounding::kNearest, Rounding::kStochastic})
          for (int shift : {-3, 0, 7, 20, 40}) {
            const int wl = at == FixedType::kInt16 ? 16 : 24;
            Buf a(s.m * s.k * fixed_size(at), 0), b(s.k * s.n * fixed_size(at), 0);
            auto fill = [&](Buf& x, int64_t count) {
              for (int64_t i = 0; i < count; ++i) {
                const int32_t v = static_cast<int32_t>(rng() % (1u << (wl - 1))) * (rng() % 2 ? 1 : -1);
                if (at == FixedType::kInt16) x.as<int16_t>()[i] = static_cast<int16_t>(v);
                else x.as<int32_t>()[i] = v;
              }
            };
            fill(a, s.m * s.k);
            fill(b, s.k * s.n);
            const int owl = ot == FixedType::kInt16 ? 16 : 32;
            const FixedShift sh{shift, -(int64_t{1} << (owl - 1)), (int64_t{1} << (owl - 1)) - 1};
            Buf oh(s.m * s.n * fixed_size(ot), 0), od(s.m * s.n * fixed_size(ot), 0);
            FixedMatmulArgs g{a.data, at, b.data, at, oh.data, ot, s.m, s.n, s.k, sh, mode, 5, 11};
            fixed_matmul_cpu(g, 1);
            g.out = od.data;
            CHECK(!throws([&] { fixed_matmul_cuda(g, nullptr); }), "fixed matmul");
            CHECK(oh.same(od), "fixed matmul %lldx%lldx%lld codes %d out %d mode %d shift %d", static_cast<long long>(s.m),
                  static_cast<long long>(s.n), static_cast<long long>(s.k), static_cast<int>(at), static_cast<int>(ot),
                  static_cast<int>(mode), shift);
          }
  test_fixed_matmul_tensor_cores(rng);
}

// ---- the loss-scale update --------------------------------------------------------------------------------------------
void test_loss_scale(std::mt19937& rng) {
  for (int i = 0; i < 200; ++i) {
    LossScaleConfig c{2.0, 0.5, static_cast<int32_t>(1 + rng() % 4), static_cast<int32_t>(1 + rng() % 3), 1.0, 65536.0 * 4,
                      rng() % 5 != 0};
    float scale = static_cast<float>(1 << (rng() % 18)), inv = 0.f, found = rng() % 3 == 0 ? 1.f : 0.f;
    int32_t tracker = static_cast<int32_t>(rng() % 4), hyst = static_cast<int32_t>(rng() % 3);
    int64_t skipped = static_cast<int64_t>(rng() % 10);
    float scale_d = scale, inv_d = inv;
    int32_t tracker_d = tracker, hyst_d = hyst;
    int64_t skipped_d = skipped;
    LossScaleArgs h{&scale, &inv, &tracker, &hyst, &skipped, &found, c};
    LossScaleArgs d{&scale_d, &inv_d, &tracker_d, &hyst_d, &skipped_d, &found, c};
    loss_scale_update_cpu(h);
    CHECK(!throws([&] { loss_scale_update_cuda(d, nullptr); }), "loss scale update");
    CHECK(scale == scale_d && inv == inv_d && tracker == tracker_d && hyst == hyst_d && skipped == skipped_d,
          "loss scale update %d: scale %g/%g inv %g/%g", i, scale, scale_d, inv, inv_d);
  }
}

// ---- GEMM ----------------------------------------------------------------------------------------------------------------
struct GemmCase {
  int64_t batch, m, n, k;
  bool a_col, b_col;
  int64_t pad;  // added to the leading dimensions: 0 keeps the vector path where sizes allow, 3 forces elements;
                // -1 rounds them up to a multiple of 8 (the vector path with partial 16-byte copies at the edges)
  DType in, out;
  bool c, bias, pre;
  Activation act;
  bool b_shared;             // one B for every batch (batch_stride 0)
  int64_t base_offset = 0;   // elements before a, b and out: a misaligned base takes the element path
  DType c_dtype = DType::kFloat32;
  bool c_col = false, c_batched = false;
};

// The build of gemm.cu for sm_75 (no cp.async, no BF16 fragments) on a simulated sm_75 device.
bool sm75 = false;

// Small integers: every product and sum is exact in FP32, in any order, so the result is the CPU's bit for bit.
void gemm_case(const GemmCase& gc, std::mt19937& rng) {
  const size_t es = 2, base = static_cast<size_t>(gc.base_offset);
  auto ld_of = [&](int64_t inner) { return gc.pad >= 0 ? inner + gc.pad : (inner + 7) / 8 * 8; };
  const int64_t lda = ld_of(gc.a_col ? gc.m : gc.k), ldb = ld_of(gc.b_col ? gc.k : gc.n);
  const int64_t a_outer = gc.a_col ? gc.k : gc.m, b_outer = gc.b_col ? gc.n : gc.k;
  const int64_t a_stride = a_outer * lda, b_stride = gc.b_shared ? 0 : b_outer * ldb;
  // Each buffer ends at its operand's last element, with no padding after the last row (a tight torch view,
  // e.g. x[:, :k] of a wider x): a copy of a row's tail that reads past it reads past the allocation.
  auto span = [](int64_t batches, int64_t stride, int64_t outer, int64_t ld, int64_t inner) {
    return batches == 0 || outer == 0 || inner == 0 ? int64_t{0} : (batches - 1) * stride + (outer - 1) * ld + inner;
  };
  const int64_t a_elems = span(gc.batch, a_stride, a_outer, lda, gc.a_col ? gc.m : gc.k);
  const int64_t b_elems = span(gc.b_shared ? 1 : gc.batch, b_stride, b_outer, ldb, gc.b_col ? gc.k : gc.n);
  Buf a(static_cast<size_t>(a_elems) * es, base * es), b(static_cast<size_t>(b_elems) * es, base * es);
  std::uniform_int_distribution<int> small(-2, 2);
  for (int64_t i = 0; i < a_elems; ++i) a.as<uint16_t>()[i] = store16(gc.in, static_cast<float>(small(rng)));
  for (int64_t i = 0; i < b_elems; ++i) b.as<uint16_t>()[i] = store16(gc.in, static_cast<float>(small(rng)));
  const int64_t c_elems = gc.c ? (gc.c_batched ? gc.batch : 1) * gc.m * gc.n : 0;
  Buf c(static_cast<size_t>(c_elems * dtype_size(gc.c_dtype)), 0), bias(gc.bias ? static_cast<size_t>(gc.n) * 2 : 0, 0);
  for (int64_t i = 0; i < c_elems; ++i) store(c, gc.c_dtype, i, static_cast<float>(small(rng)) * 0.5f);
  for (int64_t i = 0; gc.bias && i < gc.n; ++i) bias.as<uint16_t>()[i] = store16(gc.in, static_cast<float>(small(rng)) * 0.25f);
  const size_t out_bytes = static_cast<size_t>(gc.batch * gc.m * gc.n * dtype_size(gc.out));
  const size_t ob = base * static_cast<size_t>(dtype_size(gc.out));
  Buf oh(out_bytes, ob), od(out_bytes, ob), ph(gc.pre ? out_bytes : 0, ob), pd(gc.pre ? out_bytes : 0, ob);

  GemmArgs g{};
  g.batch = gc.batch;
  g.m = gc.m;
  g.n = gc.n;
  g.k = gc.k;
  g.a = MatrixRef{a.data, lda, a_stride, gc.a_col, gc.in};
  g.b = MatrixRef{b.data, ldb, b_stride, gc.b_col, gc.in};
  g.c = MatrixRef{gc.c ? c.data : nullptr, gc.c_col ? gc.m : gc.n, gc.c_batched ? gc.m * gc.n : 0, gc.c_col, gc.c_dtype};
  g.bias = gc.bias ? bias.data : nullptr;
  g.bias_dtype = gc.in;
  g.alpha = 0.5f;
  g.beta = gc.c ? 2.f : 0.f;
  g.activation = gc.act;
  g.out_dtype = gc.out;

  // The CPU reference: the exact FP32 products (small integers), then the CPU epilogue.
  std::vector<float> acc(static_cast<size_t>(gc.batch * gc.m * gc.n));
  for (int64_t bi = 0; bi < gc.batch; ++bi)
    for (int64_t i = 0; i < gc.m; ++i)
      for (int64_t j = 0; j < gc.n; ++j) {
        double s = 0.0;
        for (int64_t p = 0; p < gc.k; ++p) {
          const uint16_t x = a.as<uint16_t>()[matrix_offset(g.a, bi, i, p)], y = b.as<uint16_t>()[matrix_offset(g.b, bi, p, j)];
          const float fx = gc.in == DType::kFloat16 ? f16_bits_to_float(x) : bf16_bits_to_float(x);
          const float fy = gc.in == DType::kFloat16 ? f16_bits_to_float(y) : bf16_bits_to_float(y);
          s += static_cast<double>(fx) * fy;
        }
        acc[static_cast<size_t>((bi * gc.m + i) * gc.n + j)] = static_cast<float>(s);
      }
  GemmArgs gh = g;
  gh.out = oh.data;
  gh.pre_activation = gc.pre ? ph.data : nullptr;
  gemm_epilogue_cpu(acc.data(), gh, 1);
  GemmArgs gd = g;
  gd.out = od.data;
  gd.pre_activation = gc.pre ? pd.data : nullptr;
  std::string err;
  const long launches = mpf_sim::stats().launches;
  const bool threw = throws([&] { gemm_cuda(gd, nullptr); }, &err);
  if (sm75 && gc.in == DType::kBFloat16) {  // refused before any launch, with a message naming the GPU
    CHECK(threw && err.find("sm_75") != std::string::npos, "BF16 GEMM on sm_75 must be refused: %s", err.c_str());
    CHECK(mpf_sim::stats().launches == launches, "nothing launched for a refused BF16 GEMM");
    return;
  }
  char what[256];
  std::snprintf(what, sizeof what, "gemm batch %lld %lldx%lldx%lld a_col %d b_col %d pad %lld in %s out %s c %d bias %d act %d",
                static_cast<long long>(gc.batch), static_cast<long long>(gc.m), static_cast<long long>(gc.n),
                static_cast<long long>(gc.k), gc.a_col, gc.b_col, static_cast<long long>(gc.pad), dtype_name(gc.in),
                dtype_name(gc.out), gc.c, gc.bias, static_cast<int>(gc.act));
  CHECK(!threw, "%s: %s", what, err.c_str());
  if (threw) return;
  CHECK(oh.same(od), "%s: out differs", what);
  CHECK(ph.same(pd), "%s: pre_activation differs", what);
}

void test_gemm(std::mt19937& rng) {
  const bool small = small_scale();
  std::vector<GemmCase> cases;
  const Activation acts[] = {Activation::kNone, Activation::kRelu, Activation::kGelu, Activation::kGeluErf};
  int i = 0;
  for (bool ac : {false, true})
    for (bool bc : {false, true})
      for (int64_t pad : {0, 3})
        for (DType in : {DType::kFloat16, DType::kBFloat16}) {
          const DType out = kDtypes[i % 3];
          // K % 32 != 0, tails in M and N, a second K tile and more stages than tiles.
          cases.push_back({1, 130, 136, 40, ac, bc, pad, in, out, i % 2 == 0, i % 3 == 0, i % 4 == 1, acts[i % 4], false});
          if (!small) cases.push_back({3, 17, 9, 100, ac, bc, pad, in, kDtypes[(i + 1) % 3], true, true, true, acts[(i + 1) % 4], i % 2 == 0});
          ++i;
        }
  cases.push_back({1, 5, 7, 0, false, false, 0, DType::kFloat16, DType::kFloat32, true, true, false, Activation::kNone, false});
  // The vector path with A or B column-major, and K tiles beyond the ring of stages.
  cases.push_back({1, 128, 64, 64, true, false, 0, DType::kFloat16, DType::kFloat16, true, false, false, Activation::kNone, false});
  cases.push_back({2, 64, 48, 96, true, true, 0, DType::kBFloat16, DType::kFloat32, true, true, true, Activation::kGelu, false});
  cases.push_back({1, 64, 64, 256, false, false, 0, DType::kFloat16, DType::kFloat16, false, true, true, Activation::kRelu, false});
  // Leading dimensions of whole vectors over sizes that are not: partial 16-byte copies at every edge.
  cases.push_back({1, 70, 50, 44, false, false, -1, DType::kFloat16, DType::kFloat32, true, false, false, Activation::kNone, false});
  cases.push_back({1, 37, 29, 61, true, true, -1, DType::kBFloat16, DType::kBFloat16, false, true, true, Activation::kGeluErf, false});
  cases.push_back({2, 45, 21, 200, true, false, -1, DType::kFloat16, DType::kFloat16, true, true, false, Activation::kRelu, true});
  // Misaligned operands and output (the element path, element stores); C in 16 bits, column-major, batched.
  cases.push_back({1, 33, 40, 24, false, false, 0, DType::kFloat16, DType::kFloat16, true, false, true, Activation::kNone,
                   false, 1, DType::kFloat16, true, false});
  cases.push_back({3, 20, 24, 16, false, true, 0, DType::kBFloat16, DType::kFloat32, true, true, true, Activation::kRelu,
                   false, 0, DType::kBFloat16, false, true});
  cases.push_back({2, 17, 16, 32, true, false, 0, DType::kFloat16, DType::kBFloat16, true, false, false, Activation::kGelu,
                   false, 3, DType::kFloat16, true, true});
  cases.push_back({2, 1, 1, 1, false, true, 0, DType::kFloat16, DType::kFloat16, false, false, false, Activation::kRelu, false});
  cases.push_back({1, 64, 8, 256, false, false, 0, DType::kBFloat16, DType::kFloat32, false, true, true, Activation::kGelu, false});
  if (!small) {
    // The block swizzle: more than kGemmGroupM tile rows.
    cases.push_back({1, 1100, 24, 16, false, false, 0, DType::kFloat16, DType::kFloat16, false, false, false, Activation::kNone, false});
    cases.push_back({1, 1100, 260, 8, true, false, 0, DType::kFloat16, DType::kFloat32, false, false, false, Activation::kNone, false});
  }
  if (sm75) {
    mpf_sim::config().cc_major = 7;
    mpf_sim::config().cc_minor = 5;
    mpf_sim::config().smem_optin_limit = 64 * 1024;
  }
  for (const GemmCase& gc : cases) gemm_case(gc, rng);
  // Blocks that loop over batches (a device whose grid.y limit is below the batch count).
  mpf_sim::config().max_grid_y = 2;
  gemm_case({5, 40, 36, 72, false, true, 0, DType::kFloat16, DType::kFloat32, true, true, true, Activation::kRelu, true}, rng);
  mpf_sim::config().max_grid_y = 65535;

  if (sm75) return;
  // BF16 on a GPU below sm_80: refused with a message naming the GPU, before any launch.
  mpf_sim::Config& cfg = mpf_sim::config();
  const int major = cfg.cc_major, minor = cfg.cc_minor;
  cfg.cc_major = 7;
  cfg.cc_minor = 5;
  const std::string why = gemm_unsupported(DType::kBFloat16, 0);
  CHECK(why.find("sm_75") != std::string::npos, "BF16 on sm_75: %s", why.c_str());
  CHECK(gemm_unsupported(DType::kFloat16, 0).empty(), "FP16 runs on sm_75");
  cfg.cc_major = major;
  cfg.cc_minor = minor;
  CHECK(gemm_unsupported(DType::kBFloat16, 0).empty(), "BF16 runs on sm_90: %s", gemm_unsupported(DType::kBFloat16, 0).c_str());
}

// Every layout and dtype of the Hopper kernel: tails in M (136 of 2 x 128), N (264 of 2 x 256) and K (72: a partial
// second tile of 64), every leading dimension a whole number of 16-byte vectors; then more K tiles than stages (300:
// 5), batches, with leading dimensions of whole vectors over sizes that are not (fewer of those at the small scale).
std::vector<GemmCase> hopper_layout_cases(bool small) {
  const Activation acts[] = {Activation::kNone, Activation::kRelu, Activation::kGelu, Activation::kGeluErf};
  std::vector<GemmCase> cases;
  int i = 0;
  for (bool ac : {false, true})
    for (bool bc : {false, true})
      for (DType in : {DType::kFloat16, DType::kBFloat16}) {
        cases.push_back({1, 136, 264, 72, ac, bc, 0, in, kDtypes[i % 3], i % 2 == 0, i % 3 == 0, i % 4 == 1, acts[i % 4], false});
        if (!small || i % 3 == 0)
          cases.push_back({2, 37, 29, 300, ac, bc, -1, in, kDtypes[(i + 1) % 3], true, true, true, acts[(i + 1) % 4], i % 2 == 0});
        ++i;
      }
  return cases;
}

// The Hopper kernel (MPFUSED_GEMM_KERNEL=wgmma on a compute capability 9.0 device, 16-byte aligned operands): its
// tiles, swizzled copies and descriptors through the simulator's wgmma, against the CPU bit for bit.
void test_gemm_wgmma(std::mt19937& rng) {
  struct Env {  // MPFUSED_GEMM_KERNEL for the scope
    explicit Env(const char* v) { v ? setenv("MPFUSED_GEMM_KERNEL", v, 1) : unsetenv("MPFUSED_GEMM_KERNEL"); }
    ~Env() { unsetenv("MPFUSED_GEMM_KERNEL"); }
  };
  CHECK(gemm_sm90_built(), "the sm_90 build of gemm.cu holds the Hopper kernel");
  {
    Env e(nullptr);
    CHECK(!gemm_sm90_selected(true, 0), "without MPFUSED_GEMM_KERNEL the WMMA kernel runs");
  }
  {
    Env e("tensor-cores");
    std::string err;
    const long launches = mpf_sim::stats().launches;
    GemmArgs g{};
    g.batch = g.m = g.n = g.k = 1;
    CHECK(throws([&] { gemm_cuda(g, nullptr); }, &err) && err.find("MPFUSED_GEMM_KERNEL") != std::string::npos,
          "an unknown MPFUSED_GEMM_KERNEL is an error naming it: %s", err.c_str());
    CHECK(mpf_sim::stats().launches == launches, "nothing launched for it");
  }
  Env e("wgmma");
  CHECK(gemm_sm90_selected(true, 0) && !gemm_sm90_selected(false, 0), "wgmma: aligned operands only");
  mpf_sim::Config& cfg = mpf_sim::config();
  cfg.cc_major = 8;
  CHECK(!gemm_sm90_selected(true, 0), "wgmma: compute capability 9.0 only");
  cfg.cc_major = 9;

  const bool small = small_scale();
  std::vector<GemmCase> cases = hopper_layout_cases(small);
  cases.push_back({1, 5, 8, 0, false, false, 0, DType::kFloat16, DType::kFloat32, true, true, false, Activation::kNone, false});
  if (!small)  // the block swizzle: more than kGemmGroupM tile rows
    cases.push_back({1, 1104, 264, 16, true, false, 0, DType::kFloat16, DType::kFloat32, false, false, false, Activation::kNone, false});
  for (const GemmCase& gc : cases) {
    gemm_case(gc, rng);
    CHECK(gc.k == 0 || mpf_sim::stats().last_dynamic_smem > 64 * 1024,
          "%lldx%lldx%lld a_col %d b_col %d: the Hopper kernel ran (%zu bytes of shared memory)", static_cast<long long>(gc.m),
          static_cast<long long>(gc.n), static_cast<long long>(gc.k), gc.a_col, gc.b_col, mpf_sim::stats().last_dynamic_smem);
    // gemm_last_launch says so too (what the GPU tests check, where the kernels cannot be told apart by their results)
    const GemmLaunch l = gemm_last_launch();
    CHECK(l.launched && (gc.k == 0 ? l.kernel == GemmKernelChoice::kWmma && l.passed_over && !l.unexpected
                                   : l.kernel == GemmKernelChoice::kWgmma && !l.passed_over),
          "%lldx%lldx%lld: gemm_last_launch names the kernel that ran (%d, %s)", static_cast<long long>(gc.m),
          static_cast<long long>(gc.n), static_cast<long long>(gc.k), static_cast<int>(l.kernel),
          l.passed_over ? l.passed_over : "-");
  }
  // The persistent grid: one block per SM, each looping over work items (batch, tile). The simulated device has 2
  // SMs, so every case above looped; here 3 SMs over 5 batches of 2 x 2 tiles (20 items: 7, 7 and 6 a block), the
  // mbarrier phases running on from one tile to the next (5 K steps a tile, over 4 stages) while the epilogue
  // of one tile overlaps the next tile's copies; then more SMs than work items (a block each).
  const int sms = cfg.sms;
  for (const int n_sms : {3, 64}) {
    cfg.sms = n_sms;
    for (const GemmCase& gc : {GemmCase{5, 136, 264, 300, false, false, -1, DType::kFloat16, DType::kFloat16, true, true, false,
                                        Activation::kRelu, false},
                               GemmCase{5, 37, 29, 72, true, true, -1, DType::kBFloat16, DType::kFloat32, false, true, true,
                                        Activation::kGelu, true}}) {
      const long blocks = mpf_sim::stats().blocks;
      gemm_case(gc, rng);
      CHECK(mpf_sim::stats().last_dynamic_smem > 64 * 1024, "a persistent grid: the Hopper kernel ran");
      const long work = gc.batch * ((gc.m + 127) / 128) * ((gc.n + 255) / 256);
      CHECK(mpf_sim::stats().blocks - blocks == std::min<long>(work, n_sms), "%ld work items on %d SMs: %ld blocks", work, n_sms,
            mpf_sim::stats().blocks - blocks);
    }
  }
  cfg.sms = sms;
  // A tensor map the driver refuses: the WMMA kernel runs instead, with the same results.
  cfg.refuse_tensor_maps = true;
  gemm_case({2, 136, 264, 72, false, true, 0, DType::kBFloat16, DType::kFloat32, true, true, false, Activation::kGelu, false}, rng);
  CHECK(mpf_sim::stats().last_dynamic_smem <= 64 * 1024, "a refused tensor map: the WMMA kernel");
  CHECK(gemm_last_launch().kernel == GemmKernelChoice::kWmma && gemm_last_launch().unexpected &&
            std::string(gemm_last_launch().passed_over).find("tensor map") != std::string::npos,
        "a refused tensor map: gemm_last_launch says why the Hopper kernel did not run");
  cfg.refuse_tensor_maps = false;
  // Fewer registers than setmaxnreg's counts need (384 x 160 < 128 x 40 + 256 x 232): the WMMA kernel runs instead of a
  // launch whose consumers would wait forever for registers.
  cfg.func_regs = 160;
  gemm_case({2, 136, 264, 72, true, false, 0, DType::kBFloat16, DType::kFloat16, false, true, false, Activation::kRelu, false}, rng);
  CHECK(mpf_sim::stats().last_dynamic_smem <= 64 * 1024, "registers short of setmaxnreg's counts: the WMMA kernel");
  CHECK(gemm_last_launch().unexpected && std::string(gemm_last_launch().passed_over).find("registers") != std::string::npos,
        "registers short: gemm_last_launch says why");
  cfg.func_regs = 168;
  // Misaligned operands take the WMMA kernel's element path.
  gemm_case({1, 33, 40, 24, false, false, 3, DType::kFloat16, DType::kFloat16, true, false, true, Activation::kNone, false}, rng);
  CHECK(mpf_sim::stats().last_dynamic_smem <= 64 * 1024, "misaligned operands: the WMMA kernel");
  CHECK(gemm_last_launch().launched && gemm_last_launch().kernel == GemmKernelChoice::kWmma && !gemm_last_launch().passed_over,
        "misaligned operands: the Hopper kernel not selected, nothing passed over");
}
// The Hopper kernel in clusters of two CTAs along M (MPFUSED_GEMM_KERNEL=wgmma-cluster): each copies half of B's tile
// into both CTAs' shared memory (multicast), releases each stage on both CTAs' mbarriers, and meets its peer at
// cluster barriers; the two blocks of a cluster run together in the simulator, each with its own shared memory.
void test_gemm_wgmma_cluster(std::mt19937& rng) {
  struct Env {
    explicit Env(const char* v) { setenv("MPFUSED_GEMM_KERNEL", v, 1); }
    ~Env() { unsetenv("MPFUSED_GEMM_KERNEL"); }
  };
  Env e("wgmma-cluster");
  CHECK(gemm_sm90_selected(true, 0) && !gemm_sm90_selected(false, 0), "wgmma-cluster: aligned operands only");
  mpf_sim::Config& cfg = mpf_sim::config();
  const bool small = small_scale();
  // hopper_layout_cases: in clusters, 2 tile rows (one pair); then one tile row, which takes the kernel without
  // clusters (a second CTA would only repeat the first's MMAs).
  std::vector<GemmCase> cases = hopper_layout_cases(small);
  // 3 tile rows: a pair, then a CTA with work and one without (it copies the first's A tile and stores nothing).
  cases.push_back({1, 304, 264, 136, true, false, 0, DType::kFloat16, DType::kFloat32, false, true, false, Activation::kNone, false});
  for (const GemmCase& gc : cases) {
    const long blocks = mpf_sim::stats().blocks;
    gemm_case(gc, rng);
    const bool pairs = gc.m > 128;
    const long work = gc.batch * ((gc.m + (pairs ? 255 : 127)) / (pairs ? 256 : 128)) * ((gc.n + 255) / 256);
    const long expected = pairs ? 2 * std::min<long>(work, cfg.sms / 2) : std::min<long>(work, cfg.sms);
    CHECK(mpf_sim::stats().last_dynamic_smem > 64 * 1024 && mpf_sim::stats().blocks - blocks == expected,
          "%lldx%lldx%lld: the Hopper kernel ran, %s (%ld blocks for %ld work items on %d SMs)", static_cast<long long>(gc.m),
          static_cast<long long>(gc.n), static_cast<long long>(gc.k), pairs ? "2 blocks a cluster" : "without clusters",
          mpf_sim::stats().blocks - blocks, work, cfg.sms);
    CHECK(gemm_last_launch().kernel == (pairs ? GemmKernelChoice::kWgmmaCluster : GemmKernelChoice::kWgmma) &&
              !gemm_last_launch().passed_over,
          "%lldx%lldx%lld: gemm_last_launch names the kernel that ran", static_cast<long long>(gc.m),
          static_cast<long long>(gc.n), static_cast<long long>(gc.k));
  }
  // Persistent clusters: 3 of them (6 SMs) over 5 batches of 2 x 2 pairs of tiles and K tails (the phases run on from
  // one work item to the next on both CTAs), then more SMs than work.
  // (At the small scale, under ThreadSanitizer: 3 batches of 264 x 264, 3 K steps: a pair and a CTA without work.)
  const int sms = cfg.sms;
  const std::vector<GemmCase> persistent =
      small ? std::vector<GemmCase>{GemmCase{3, 264, 264, 136, false, true, -1, DType::kFloat16, DType::kFloat16, true, true,
                                             false, Activation::kRelu, false}}
            : std::vector<GemmCase>{GemmCase{5, 520, 264, 300, false, false, -1, DType::kFloat16, DType::kFloat16, true, true,
                                             false, Activation::kRelu, false},
                                    GemmCase{3, 136, 520, 72, true, true, 0, DType::kBFloat16, DType::kFloat32, false, true, true,
                                             Activation::kGelu, true}};
  for (const int n_sms : {6, 64}) {
    if (small && n_sms != 6) continue;
    cfg.sms = n_sms;
    for (const GemmCase& gc : persistent) {
      const long blocks = mpf_sim::stats().blocks;
      gemm_case(gc, rng);
      const long work = gc.batch * ((gc.m + 255) / 256) * ((gc.n + 255) / 256);
      CHECK(mpf_sim::stats().last_dynamic_smem > 64 * 1024 && mpf_sim::stats().blocks - blocks == 2 * std::min<long>(work, n_sms / 2),
            "persistent clusters: %ld work items on %d SMs: %ld blocks", work, n_sms, mpf_sim::stats().blocks - blocks);
    }
  }
  // A device with one SM holds no cluster of two: the Hopper kernel runs without clusters (one block).
  cfg.sms = 1;
  const long before = mpf_sim::stats().blocks;
  gemm_case({1, 136, 264, 72, false, true, 0, DType::kFloat16, DType::kFloat32, true, false, false, Activation::kNone, false}, rng);
  CHECK(mpf_sim::stats().last_dynamic_smem > 64 * 1024 && mpf_sim::stats().blocks - before == 1,
        "no cluster fits: the Hopper kernel without clusters (%ld blocks)", mpf_sim::stats().blocks - before);
  CHECK(gemm_last_launch().launched && gemm_last_launch().kernel == GemmKernelChoice::kWgmma && gemm_last_launch().unexpected &&
            std::string(gemm_last_launch().passed_over).find("cluster") != std::string::npos,
        "no cluster fits: gemm_last_launch says the clusters were passed over, and why");
  cfg.sms = sms;
}

// ---- the simulator's own checks ------------------------------------------------------------------------------------
}  // namespace

namespace mpf_sim_selftest {
int run_missing_barrier(float* out, bool barrier);
int run_split_barriers(int* out);
int run_big_dynamic(int* out, bool set_attribute);
int run_traps(int* out);
int run_grid_y(int* out, unsigned blocks_y);
int run_shared_overrun(int* out, int index);
int run_narrow(const float* in, uint16_t* bf16, uint16_t* f16, int n);
int run_tma_encode(const uint16_t* data, int rows, int cols, int ld, int box0);
int run_tma_box(const uint16_t* data, int rows, int cols, int ld, uint16_t* out, bool wait);
int run_mbar_never(int* out);
int run_wgmma_race(float* out, bool racy);
}  // namespace mpf_sim_selftest

namespace {

// What the kernels' tests rely on: defects that the simulator must catch (selftest.cu).
void test_self(std::mt19937&) {
  namespace st = mpf_sim_selftest;
  std::vector<float> out(64, 0.f);
  CHECK(st::run_missing_barrier(out.data(), true) == 0, "a correct kernel runs");
  bool right = true;
  for (unsigned t = 0; t < 64; ++t) right = right && out[t] == static_cast<float>((t + 1) % 64);
  CHECK(right, "with the barrier, every thread reads its neighbour's value");
#if !defined(__SANITIZE_THREAD__)  // there the race itself is reported: part "race", a test of its own
  CHECK(st::run_missing_barrier(out.data(), false) == 0, "a racy kernel still runs");
  int poisoned = 0;
  for (float v : out) poisoned += std::isnan(v) ? 1 : 0;
  CHECK(poisoned > 0, "a read before the neighbour's write (no barrier) sees the 0xFF poison: %d reads did", poisoned);
#endif

  std::vector<int> ints(64, 0);
  CHECK(st::run_split_barriers(ints.data()) == mpf_sim::kErrorLaunchFailure,
        "threads waiting at barriers that cannot complete: a deadlock, reported as a failed launch");
  CHECK(st::run_traps(ints.data()) == mpf_sim::kErrorLaunchFailure, "__trap fails the launch");
  CHECK(st::run_big_dynamic(ints.data(), false) == mpf_sim::kErrorInvalidValue,
        "64 KB of dynamic shared memory without the attribute is refused");
  CHECK(st::run_big_dynamic(ints.data(), true) == 0 && ints[0] == 7, "with the attribute it runs");
  std::vector<int> ys(70000, 0);
  CHECK(st::run_grid_y(ys.data(), 65536) == mpf_sim::kErrorInvalidConfiguration, "grid.y > 65535 is refused");
  CHECK(st::run_grid_y(ys.data(), 3) == 0 && ys[2] == 1, "a grid of 3 in y runs");
  CHECK(st::run_shared_overrun(ints.data(), 31) == 0 && ints[0] == 1, "a read inside a shared array runs");

  // TMA and mbarriers (the Hopper GEMM's pipeline). A 5 x 40 matrix (48 elements a row) and a 64 x 8 box at
  // (8, 1): row r, column c of the box is element (1 + r, 8 + c), zero outside the matrix, at byte offset
  // o = 2 (64 r + c) swizzled to o ^ ((o / 128 % 8) * 16).
  const int rows = 5, cols = 40, ld = 48;
  std::vector<uint16_t> data(static_cast<size_t>(rows * ld));
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ld; ++c) data[static_cast<size_t>(r * ld + c)] = static_cast<uint16_t>(c < cols ? 1 + 100 * r + c : 0xBEEF);
  CHECK(st::run_tma_encode(data.data(), rows, cols, 44, 64) != 0, "a tensor map whose row stride is not a multiple of 16 bytes is refused");
  CHECK(st::run_tma_encode(data.data(), rows, cols, ld, 72) != 0, "a 128-byte swizzle over box rows of 144 bytes is refused");
  CHECK(st::run_tma_encode(data.data() + 1, rows, cols, ld, 64) != 0, "a tensor map of a base not 16-byte aligned is refused");
  std::vector<uint16_t> box(512, 0);
  CHECK(st::run_tma_box(data.data(), rows, cols, ld, box.data(), true) == 0, "a TMA copy waited for runs");
  int wrong = 0;
  for (int i = 0; i < 512; ++i) {
    const int o = 2 * i, u = o ^ ((o >> 7) & 7) << 4, e = u / 2, r = 1 + e / 64, c = 8 + e % 64;
    const uint16_t want = r < rows && c < cols ? static_cast<uint16_t>(1 + 100 * r + c) : 0;
    wrong += box[static_cast<size_t>(i)] != want ? 1 : 0;
  }
  CHECK(wrong == 0, "the TMA box lands swizzled, zero outside the matrix: %d of 512 values differ", wrong);
#if !defined(__SANITIZE_THREAD__)  // there the read before the copy lands is a reported race
  CHECK(st::run_tma_box(data.data(), rows, cols, ld, box.data(), false) == 0, "a TMA copy not waited for runs");
  int garbage = 0;
  for (uint16_t v : box) garbage += v == 0xffff ? 1 : 0;
  CHECK(garbage == 512, "reads that no mbarrier wait orders after the copy see garbage: %d of 512 did", garbage);
#endif
  CHECK(st::run_mbar_never(ints.data()) == mpf_sim::kErrorLaunchFailure,
        "threads waiting on an mbarrier phase that cannot complete: a deadlock, reported as a failed launch");
  std::vector<float> acc(128, -1.f);
  CHECK(st::run_wgmma_race(acc.data(), false) == 0, "a wgmma of zero operands runs");
  right = true;
  for (float v : acc) right = right && v == 128.0f;
  CHECK(right, "its 128 accumulators a thread, 1 each, stay 1: %g", static_cast<double>(acc[0]));
}

// core/numeric.h's narrowings on the device (the hardware conversions on sm_80+: cvt.rn.bf16.f32 and
// cvt.rn.f16.f32, modelled in sim.h from their definitions) against the host's integer and float formulas: the
// same bits for every non-NaN input; a NaN stays a NaN, 0x7FC0 in BF16 as on the host (FP16 keeps the
// hardware's 0x7FFF). Specials, ties at several binades, subnormal results, the overflow boundary, and
// random bit patterns.
void test_numeric(std::mt19937& rng) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
                                0x7f800001u, 0x7fbfffffu, 0x7f7fffffu, 0xff7fffffu, 0x7f7f7fffu, 0x7f7f8000u,
                                0x7f7f8001u, 0x7f7fc000u, 0x00000001u, 0x80000001u, 0x00007fffu, 0x00008000u,
                                0x00018000u, 0x00008001u, 0x007fffffu, 0x00800000u, 0x3f808000u, 0x3f818000u,
                                0x3f80ffffu, 0x477ff000u, 0x477fefffu, 0x477fe000u, 0x38800000u, 0x387fe000u,
                                0x33000000u, 0x33000001u, 0x32ffffffu, 0xb3800000u};
  for (uint32_t e = 0; e < 256; ++e)  // ties and their neighbours in every binade, both signs
    for (uint32_t low : {0x8000u, 0x7fffu, 0x8001u, 0x18000u, 0x1000u, 0x0fffu, 0x1001u, 0x3000u})
      for (uint32_t sign : {0u, 0x80000000u}) bits.push_back(sign | (e << 23) | low);
  std::uniform_int_distribution<uint32_t> any;
  while (bits.size() < 100000) bits.push_back(any(rng));
  const int n = static_cast<int>(bits.size());
  std::vector<float> in(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) in[i] = mpf::bits_as_float(bits[i]);
  std::vector<uint16_t> bf16(bits.size()), f16(bits.size());
  CHECK(mpf_sim_selftest::run_narrow(in.data(), bf16.data(), f16.data(), n) == 0, "the narrowing kernel runs");
  int bad_bf16 = 0, bad_f16 = 0;
  for (int i = 0; i < n; ++i) {
    const uint16_t hb = mpf::float_to_bf16_bits(in[i]), hf = mpf::float_to_f16_bits(in[i]);
    if (bf16[i] != hb && bad_bf16++ < 5)
      std::fprintf(stderr, "  bf16 of 0x%08x: device 0x%04x, host 0x%04x\n", bits[i], bf16[i], hb);
    const bool nan = std::isnan(in[i]);
    const bool f16_ok = nan ? (f16[i] & 0x7c00u) == 0x7c00u && (f16[i] & 0x3ffu) != 0 : f16[i] == hf;
    if (!f16_ok && bad_f16++ < 5) std::fprintf(stderr, "  f16 of 0x%08x: device 0x%04x, host 0x%04x\n", bits[i], f16[i], hf);
  }
  CHECK(bad_bf16 == 0, "BF16 narrowing: %d of %d values differ between device and host", bad_bf16, n);
  CHECK(bad_f16 == 0, "FP16 narrowing: %d of %d values differ between device and host", bad_f16, n);
}

// Defects that only a sanitizer reports, each run by a test of its own that expects the report (CMakeLists.txt):
// "race" under ThreadSanitizer (a read of another thread's shared write with no barrier between), "wgmma_race"
// (the same between a wgmma's operand reads and a write of its operand),
// "smem_oob" under AddressSanitizer (a read past a shared array).
void test_race(std::mt19937&) {
  std::vector<float> out(64, 0.f);
  mpf_sim_selftest::run_missing_barrier(out.data(), false);
}
void test_wgmma_race(std::mt19937&) {
  std::vector<float> out(128, 0.f);
  mpf_sim_selftest::run_wgmma_race(out.data(), true);
}
void test_smem_oob(std::mt19937&) {
  std::vector<int> out(1, 0);
  mpf_sim_selftest::run_shared_overrun(out.data(), 40);
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(2026);
  std::string only = argc > 1 ? argv[1] : "";
  if (only == "gemm_sm75") {  // the executable whose gemm.cu was built with __CUDA_ARCH__ 750
    sm75 = true;
    only = "gemm";
  }
  auto part = [&](const char* name, void (*f)(std::mt19937&)) {
    if (!only.empty() && only != name) return;
    const int before = native_test::failures();
    const long launches = mpf_sim::stats().launches, blocks = mpf_sim::stats().blocks;
    f(rng);
    std::printf("cuda-sim %s: %ld launches, %ld blocks, %d failures\n", name, mpf_sim::stats().launches - launches,
                mpf_sim::stats().blocks - blocks, native_test::failures() - before);
    std::fflush(stdout);
  };
  part("self", test_self);
  part("numeric", test_numeric);
  part("loss_scale", test_loss_scale);
  part("random", test_random);
  part("fixed_point", test_fixed_point);
  part("overflow", test_overflow);
  part("optim", test_optim);
  part("follow", test_follow);
  part("gemm", test_gemm);
  if (!sm75) part("gemm_wgmma", test_gemm_wgmma);
  if (!sm75) part("gemm_wgmma_cluster", test_gemm_wgmma_cluster);
  if (only == "old_driver") part("old_driver", test_old_driver);
  if (only == "race") part("race", test_race);
  if (only == "wgmma_race") part("wgmma_race", test_wgmma_race);
  if (only == "smem_oob") part("smem_oob", test_smem_oob);
  return native_test::finish("test_cuda_sim");
}
