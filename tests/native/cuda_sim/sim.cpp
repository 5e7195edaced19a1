// The CUDA simulator's engine (sim.h says what it models): the threads of a block are fibers on the calling
// OS thread, each on a stack of its own, switched by a scheduler at barriers; the blocks of a launch run one
// after another.
//
// Under ThreadSanitizer each fiber is a TSan fiber and a switch at a barrier carries no ordering: only the
// barrier's release (on arrival) and acquire (on leaving) order the threads, so accesses that no barrier
// separates are reported as races. The switches that start and end a block do order, so the host's writes
// before a launch and its reads after are not. Under AddressSanitizer the switches are announced, so that it
// knows which stack is current.
#include "sim.h"

#include <cuda.h>  // include/cuda.h: the tensor maps

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

// Under ThreadSanitizer this file is compiled without instrumentation (with MPF_SIM_TSAN=1): the scheduler's
// bookkeeping is shared by fibers that nothing orders, by design. Only what a CUDA thread does to memory is
// instrumented: the kernels, and sim_land.cpp, where a cp.async copy lands as a write of the issuing thread.
#if defined(__SANITIZE_THREAD__) && !defined(MPF_SIM_TSAN)
#define MPF_SIM_TSAN 1
#endif
#if MPF_SIM_TSAN
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#endif
#if defined(__SANITIZE_ADDRESS__)
#define MPF_SIM_ASAN 1
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, size_t* size_old);
void __asan_poison_memory_region(void const volatile* addr, size_t size);
void __asan_unpoison_memory_region(void const volatile* addr, size_t size);
}
#endif

namespace {
// Shared memory outside the launch's dynamic size and the static slots allocated so far is poisoned under
// AddressSanitizer, with a gap after each: an access out of a shared array is reported.
void smem_poison(const void* p, size_t n) {
#if MPF_SIM_ASAN
  __asan_poison_memory_region(p, n);
#else
  (void)p, (void)n;
#endif
}
void smem_unpoison(const void* p, size_t n) {
#if MPF_SIM_ASAN
  __asan_unpoison_memory_region(p, n);
#else
  (void)p, (void)n;
#endif
}
#if MPF_SIM_TSAN
// Every thread releases this when it ends and the scheduler acquires it after the block: the next block is
// ordered after this one, but the threads of one block are not ordered by their start and end.
char block_end;
#endif
}  // namespace

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

// The context switch: saves the callee-saved registers, MXCSR and the x87 control word on the current stack,
// stores the stack pointer in *save, and continues on the stack `load` (saved by an earlier switch, or
// prepared by Fiber::Fiber).
extern "C" void mpf_sim_switch(void** save, void* load);
asm(R"(
  .text
  .globl mpf_sim_switch
  .type mpf_sim_switch, @function
mpf_sim_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size mpf_sim_switch, .-mpf_sim_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace mpf_sim {

static_assert(kErrorInvalidValue == cudaErrorInvalidValue && kErrorInvalidConfiguration == cudaErrorInvalidConfiguration &&
                  kErrorLaunchFailure == cudaErrorLaunchFailure,
              "sim_config.h's error numbers are sim.h's");

thread_local ThreadCtx* tctx = nullptr;

Config& config() {
  static Config c;
  return c;
}
Stats& stats() {
  static Stats s;
  return s;
}

namespace {

cudaError_t last_error = cudaSuccess;
cudaError_t launch_status = cudaSuccess;  // of the last launch that ran

struct CpCopy {
  void* dst;
  const void* src;
  int bytes;
};

// A barrier among the threads that have not left it, with an OR of the values they bring.
struct Barrier {
  unsigned expected = 0, arrived = 0, acc = 0, done = 0;
  uint64_t phase = 0;
  // The waiting threads. A fixed array: under ThreadSanitizer the allocator's interceptors would see a vector
  // grown by one fiber and freed by another as a race of theirs.
  Fiber* waiting[1024];
  unsigned num_waiting = 0;
  char sync[2];  // TSan: arrivals release, and leavers acquire, the phase's own address
  uint64_t xchg[32];  // a warp's shuffles: each lane's value, between the shuffle's two barriers
};

}  // namespace

// What an accumulator register in flight holds (a quiet NaN with a payload of its own): read before the
// wgmma.wait_group that retires its MMA, it turns the results into NaNs.
const float kWgmmaPoison = [] {
  const uint32_t bits = 0x7FDEADBEu;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}();

struct Fiber {
  enum State { kReady, kWaiting, kDone };
  static constexpr size_t kStack = 1u << 20;  // kernel arguments (32 KB) are copied onto it, sanitizers pad frames
  unsigned char* stack = nullptr;             // mmap: a guard page, then kStack bytes
  void* sp = nullptr;
  State state = kDone;
  bool abort = false;  // resumed to unwind: the block is deadlocked
  ThreadCtx ctx{};
  uint3 tid{};
  std::vector<CpCopy> cp_pending;
  std::vector<std::vector<CpCopy>> cp_groups;
  struct WgmmaOp {
    float* d;
    int n;
    uint64_t desc_a, desc_b;
    int trans_a, trans_b;
    bool bf16;
    uint64_t hash;  // of the operands' bytes when issued
    uint64_t seq;   // issue order within the thread
  };
  std::vector<WgmmaOp> wg_pending;
  std::vector<std::vector<WgmmaOp>> wg_groups;
  bool wg_fenced = false;
  // The accumulators of MMAs in flight: what their registers will hold when the last MMA issued on them
  // retires. Until then the registers hold kWgmmaPoison, so a read before the wait_group gives NaNs.
  struct WgAcc {
    std::vector<float> values;
    uint64_t last_seq;
  };
  std::map<float*, WgAcc> wg_acc;
  uint64_t wg_seq = 0;
  bool proxy_dirty = false;  // cp.async copies landed with no fence.proxy.async after them
  bool cluster_arrived = false;  // barrier.cluster.arrive, not yet followed by its wait
#if MPF_SIM_TSAN
  void* tsan = nullptr;
#endif
#if MPF_SIM_ASAN
  void* asan_fake = nullptr;
#endif
  Fiber();
  ~Fiber() { munmap(stack - 4096, kStack + 4096); }
  const void* stack_bottom() const { return stack; }
};

// An mbarrier (sim.h). Fixed arrays, allocated by the scheduler: under ThreadSanitizer the allocator's
// interceptors would see containers grown by one fiber and freed by another as races of theirs.
struct TmaCopy {
  unsigned char* dst;
  TmaBox box;
};
struct MBar {
  uint32_t addr = 0;
  unsigned count = 0, pending = 0;  // count 0: not initialised
  uint64_t tx_expect = 0, tx_issued = 0;
  uint64_t phase = 0;
  TmaCopy copies[16];
  unsigned num_copies = 0;
  Fiber* waiting[1024];
  unsigned num_waiting = 0;
  char sync = 0;  // TSan: arrivals and copies release it, waits that return acquire it
};
struct MBarTable {
  MBar bars[32];
  unsigned used = 0;
};

struct ClusterState;
struct BlockState {
  unsigned nthreads = 0;
  uint3 idx{};               // blockIdx
  unsigned rank = 0;         // in its cluster
  ClusterState* cluster = nullptr;
  unsigned live = 0;         // threads not yet ended: at 0 the block has exited and its shared memory is gone
  std::unique_ptr<MBarTable> mbars;
  Barrier bar;
  std::vector<Barrier> warps;
  std::map<const void*, void*> slots;
  unsigned char* static_base = nullptr;
  size_t static_used = 0, static_limit = 0;
  unsigned char* dynamic_base = nullptr;
  size_t dynamic_bytes = 0;
  bool trapped = false;
  unsigned proxy_dirty = 0;  // threads whose landed cp.async copies no fence.proxy.async has followed
  std::string trap_message;
  // The k-th wgmma.mma_async of each warpgroup (warpgroup, k): a warpgroup-wide instruction, so all 128
  // threads must issue it, with the same shape and descriptors.
  struct WgIssue {
    int n;
    uint64_t desc_a, desc_b;
    int trans_a, trans_b;
    bool bf16;
    unsigned threads;
  };
  std::map<std::pair<unsigned, uint64_t>, WgIssue> wg_issued;
};

// The blocks of a cluster, run together, and their barrier.cluster.
struct ClusterState {
  std::vector<BlockState*> blocks;
  Barrier bar;  // barrier.cluster: every thread of every block (exited ones never arrive)
};

namespace {

// The scheduler: the calling thread's own stack, and the fibers it runs.
struct Scheduler {
  void* sp = nullptr;
  std::vector<std::unique_ptr<Fiber>> fibers;
  Fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  BlockState* block = nullptr;
#if MPF_SIM_TSAN
  void* tsan = nullptr;
#endif
#if MPF_SIM_ASAN
  void* asan_fake = nullptr;
  const void* asan_bottom = nullptr;
  size_t asan_size = 0;
#endif
};
Scheduler& sched() {
  static Scheduler s;
  return s;
}

constexpr unsigned kTsanNoSync = 1;

// From the current fiber back to the scheduler. `sync`: the scheduler is ordered after what the fiber did.
void to_scheduler(Fiber& f, bool sync) {
  Scheduler& s = sched();
#if MPF_SIM_TSAN
  __tsan_switch_to_fiber(s.tsan, sync ? 0 : kTsanNoSync);
#else
  (void)sync;
#endif
#if MPF_SIM_ASAN
  __sanitizer_start_switch_fiber(&f.asan_fake, s.asan_bottom, s.asan_size);
#endif
  mpf_sim_switch(&f.sp, s.sp);
#if MPF_SIM_ASAN
  __sanitizer_finish_switch_fiber(f.asan_fake, &s.asan_bottom, &s.asan_size);
#endif
}

// From the scheduler into fiber f. `sync`: the fiber is ordered after what the scheduler did (a block's start).
void to_fiber(Fiber& f, bool sync) {
  Scheduler& s = sched();
  s.current = &f;
  tctx = &f.ctx;
  threadIdx = f.tid;
  blockIdx = f.ctx.block->idx;
#if MPF_SIM_TSAN
  __tsan_switch_to_fiber(f.tsan, sync ? 0 : kTsanNoSync);
#else
  (void)sync;
#endif
#if MPF_SIM_ASAN
  __sanitizer_start_switch_fiber(&s.asan_fake, f.stack_bottom(), Fiber::kStack);
#endif
  mpf_sim_switch(&s.sp, f.sp);
#if MPF_SIM_ASAN
  __sanitizer_finish_switch_fiber(s.asan_fake, nullptr, nullptr);
#endif
  tctx = nullptr;
  s.current = nullptr;
}

// After a trap: threads not yet started never start; the others are unwound at their next barrier (every thread
// of the cluster's blocks, fibers [0, n)).
void stop_block(unsigned n, const std::vector<bool>& started) {
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = *sched().fibers[t];
    if (f.state == Fiber::kDone) continue;
    if (!started[t]) {
      f.state = Fiber::kDone;
    } else {
      f.abort = true;
      f.state = Fiber::kReady;
    }
  }
}

void perform(const std::vector<CpCopy>& group) {
  for (const CpCopy& c : group) land_copy16(c.dst, c.src, c.bytes);
}

void complete(Barrier& b) {
  b.done = b.acc;
  b.acc = 0;
  b.arrived = 0;
  ++b.phase;
  for (unsigned i = 0; i < b.num_waiting; ++i)
    if (b.waiting[i]->state == Fiber::kWaiting) b.waiting[i]->state = Fiber::kReady;
  b.num_waiting = 0;
}

// `orders_memory`: a barrier orders the threads' memory accesses (__syncthreads, __syncwarp); a shuffle's
// exchange does not.
unsigned arrive_and_wait(Barrier& b, unsigned v, bool orders_memory = true) {
  Fiber& f = *sched().current;
#if MPF_SIM_TSAN
  char* sync = &b.sync[b.phase & 1];
  if (orders_memory) __tsan_release(sync);
#else
  (void)orders_memory;
#endif
  b.acc |= v;
  if (++b.arrived == b.expected) {
    complete(b);
  } else {
    b.waiting[b.num_waiting++] = &f;
    f.state = Fiber::kWaiting;
    to_scheduler(f, false);
    if (f.abort) {  // the block is deadlocked or trapped: leave this barrier unwound, as if never arrived
      for (unsigned i = 0; i < b.num_waiting; ++i)
        if (b.waiting[i] == &f) {
          b.waiting[i] = b.waiting[--b.num_waiting];
          --b.arrived;
          break;
        }
      throw Trap{"deadlock: the block's threads wait at barriers that cannot complete"};
    }
  }
#if MPF_SIM_TSAN
  if (orders_memory) __tsan_acquire(sync);
#endif
  return b.done;
}

void leave(Barrier& b) {
  --b.expected;
  if (b.arrived > 0 && b.arrived == b.expected) complete(b);
}

// A fiber's life: run the block's body as thread f.ctx.linear, leave the barriers, wait for the next block.
[[noreturn]] void fiber_main() {
#if MPF_SIM_ASAN
  {
    Scheduler& s = sched();
    __sanitizer_finish_switch_fiber(nullptr, &s.asan_bottom, &s.asan_size);
  }
#endif
  for (;;) {
    Fiber& f = *sched().current;
    BlockState& b = *f.ctx.block;
    try {
      (*sched().body)();
    } catch (const Trap& t) {
      if (!b.trapped) {
        b.trapped = true;
        b.trap_message = t.what;
      }
    }
    if (!b.trapped && (!f.wg_pending.empty() || !f.wg_groups.empty())) {
      b.trapped = true;
      b.trap_message = "a thread ended with wgmma.mma_async it never waited for (wgmma.wait_group)";
    }
    // Copies still in flight land when the thread ends.
    cp_async_commit();
    cp_async_wait(0);
    leave(b.warps[f.ctx.linear / 32]);
    leave(b.bar);
    --b.live;
    f.state = Fiber::kDone;
#if MPF_SIM_TSAN
    __tsan_release(&block_end);
#endif
    to_scheduler(f, false);
  }
}

std::map<const void*, size_t>& func_attrs() {
  static std::map<const void*, size_t> m;
  return m;
}

}  // namespace

Fiber::Fiber() {
  void* m = mmap(nullptr, kStack + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw std::runtime_error("cuda-sim: no memory for a fiber stack");
  mprotect(m, 4096, PROT_NONE);  // the guard page: an overflowing stack faults
  stack = static_cast<unsigned char*>(m) + 4096;
  // The frame mpf_sim_switch pops the first time: MXCSR and control word, six registers, then fiber_main's
  // address for its `ret`, above a zero return address (stack aligned as after a call).
  uint64_t* top = reinterpret_cast<uint64_t*>(stack + kStack);
  *--top = 0;
  *--top = reinterpret_cast<uint64_t>(&fiber_main);
  for (int i = 0; i < 6; ++i) *--top = 0;
  uint32_t mxcsr = 0;
  uint16_t fpucw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  --top;
  std::memcpy(reinterpret_cast<unsigned char*>(top), &mxcsr, 4);
  std::memcpy(reinterpret_cast<unsigned char*>(top) + 4, &fpucw, 2);
  sp = top;
#if MPF_SIM_TSAN
  tsan = __tsan_create_fiber(0);
#endif
}

[[noreturn]] void trap(const std::string& why) { throw Trap{why}; }

size_t& func_max_dynamic_smem(const void* kernel) { return func_attrs()[kernel]; }

void sync_block() { arrive_and_wait(tctx->block->bar, 0); }
unsigned sync_block_or(unsigned v) { return arrive_and_wait(tctx->block->bar, v); }

void sync_warp(unsigned mask) {
  if (mask != 0xffffffffu) trap("__syncwarp: the simulator supports only the full mask");
  Barrier& w = tctx->block->warps[tctx->linear / 32];
  if (w.expected != 32) trap("__syncwarp(0xffffffff) in a warp whose lanes are not all present");
  arrive_and_wait(w, 0);
}

uint64_t shfl_exchange(uint64_t bits, unsigned offset, int width) {
  Barrier& w = tctx->block->warps[tctx->linear / 32];
  if (w.expected != 32) trap("a full-mask shuffle in a warp whose lanes are not all present");
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) trap("shuffle: width must be a power of 2 up to 32");
  const unsigned lane = lane_id();
  w.xchg[lane] = bits;
  arrive_and_wait(w, 0, false);
  const unsigned in_segment = lane % static_cast<unsigned>(width);
  const uint64_t r = in_segment + offset < static_cast<unsigned>(width) ? w.xchg[lane + offset] : bits;
  arrive_and_wait(w, 0, false);
  return r;
}

void* shared_slot(const void* site, size_t size, size_t align) {
  BlockState& b = *tctx->block;
  auto it = b.slots.find(site);
  if (it != b.slots.end()) return it->second;
  const size_t a = align < 8 ? 8 : align;
  const size_t at = (b.static_used + 32 + a - 1) / a * a;  // a poisoned gap of at least 32 bytes before each
  if (at + size > b.static_limit) trap("static __shared__ memory over its limit (48 KB, or the opt-in limit less the dynamic size)");
  b.static_used = at + size;
  void* p = b.static_base + at;
  smem_unpoison(p, size);
  // What no thread wrote reads as NaN, -1 or an invalid bool. Byte stores that are no thread's: not memset,
  // whose interceptor would make the poison a write of the allocating thread under ThreadSanitizer.
  volatile unsigned char* poison = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < size; ++i) poison[i] = 0xff;
  b.slots.emplace(site, p);
  return p;
}

void* dynamic_shared(size_t align) {
  BlockState& b = *tctx->block;
  if (reinterpret_cast<uintptr_t>(b.dynamic_base) % align != 0) trap("dynamic shared memory misaligned");
  return b.dynamic_base;
}

void cp_async_cg16(void* dst, const void* src, int src_bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0) trap("cp.async: shared destination not 16-byte aligned");
  if (src_bytes < 0 || src_bytes > 16) trap("cp.async: src-size outside [0, 16]");
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0) trap("cp.async: global source not 16-byte aligned");
  BlockState& b = *tctx->block;
  const unsigned char* d = static_cast<const unsigned char*>(dst);
  if (d < b.dynamic_base || d + 16 > b.dynamic_base + b.dynamic_bytes)
    trap("cp.async: destination outside the block's dynamic shared memory");
  // Until its wait_group the copy may land at any time: the destination reads as garbage (a write of this
  // thread's, which ThreadSanitizer sees), and the data arrives at the wait.
  land_poison16(dst);
  tctx->fiber->cp_pending.push_back(CpCopy{dst, src, src_bytes});
}

void cp_async_commit() {
  Fiber& f = *tctx->fiber;
  f.cp_groups.push_back(std::move(f.cp_pending));
  f.cp_pending.clear();
}

uint32_t shared_address(const void* p) {
  const BlockState& b = *tctx->block;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c < b.dynamic_base || c >= b.static_base + b.static_limit) trap("__cvta_generic_to_shared of an address outside shared memory");
  return kSharedWindowStart + static_cast<uint32_t>(c - b.dynamic_base);
}

const unsigned char* shared_at(uint32_t addr, size_t bytes) {
  const BlockState& b = *tctx->block;
  if (addr < kSharedWindowStart || addr - kSharedWindowStart + bytes > b.dynamic_bytes)
    trap("wgmma: an operand address outside the block's dynamic shared memory");
  return b.dynamic_base + (addr - kSharedWindowStart);
}

void wgmma_fence() { tctx->fiber->wg_fenced = true; }

void fence_proxy_async() {
  Fiber& f = *tctx->fiber;
  if (f.proxy_dirty) {
    f.proxy_dirty = false;
    --tctx->block->proxy_dirty;
  }
}

void wgmma_m64nNk16(float* d, int n, uint64_t desc_a, uint64_t desc_b, int trans_a, int trans_b, bool bf16) {
  Fiber& f = *tctx->fiber;
  if (tctx->block->nthreads % 128 != 0) trap("wgmma: the block is not made of whole warpgroups (128 threads)");
  if (!f.wg_fenced) trap("wgmma.mma_async without a wgmma.fence since the thread last waited for its MMAs");
  // Conservative: any thread's landed copies, not only those under this MMA's operands.
  if (tctx->block->proxy_dirty != 0)
    trap("wgmma.mma_async after cp.async copies that landed with no fence.proxy.async (the async proxy may not see them)");
  // The accumulators in flight stay with the MMAs: an MMA on registers that an earlier one still owns takes
  // that one's result as its input (the PTX ISA orders accumulator accesses between MMAs of one shape), and
  // the registers must still hold the poison: anything else means the thread wrote them meanwhile.
  const size_t regs = static_cast<size_t>(n / 2);
  auto held = f.wg_acc.find(d);
  if (held != f.wg_acc.end()) {
    if (held->second.values.size() != regs) trap("wgmma: accumulator registers in flight reused with another shape");
    uint32_t poison;
    std::memcpy(&poison, &kWgmmaPoison, 4);
    for (size_t i = 0; i < regs; ++i) {
      uint32_t bits;  // (a load, not memcmp: ThreadSanitizer's memcmp interceptor cost more than the MMA)
      std::memcpy(&bits, &d[i], 4);
      if (bits != poison) trap("accumulator registers written while a wgmma.mma_async that writes them is in flight");
    }
    std::memcpy(d, held->second.values.data(), regs * sizeof(float));
  }
  const uint64_t hash = wgmma_operands(d, n, desc_a, desc_b, trans_a, trans_b, bf16, tctx->linear % 128);
  const uint64_t seq = f.wg_seq++;
  auto [issue, first] = tctx->block->wg_issued.try_emplace({tctx->linear / 128, seq},
                                                           BlockState::WgIssue{n, desc_a, desc_b, trans_a, trans_b, bf16, 0});
  const BlockState::WgIssue& w = issue->second;
  if (!first && (w.n != n || w.desc_a != desc_a || w.desc_b != desc_b || w.trans_a != trans_a || w.trans_b != trans_b ||
                 w.bf16 != bf16))
    trap("wgmma: the threads of a warpgroup issued one wgmma.mma_async with different shapes or descriptors");
  ++issue->second.threads;
  f.wg_acc[d] = Fiber::WgAcc{std::vector<float>(d, d + regs), seq};
  for (size_t i = 0; i < regs; ++i) d[i] = kWgmmaPoison;
  f.wg_pending.push_back(Fiber::WgmmaOp{d, n, desc_a, desc_b, trans_a, trans_b, bf16, hash, seq});
}

void wgmma_commit() {
  Fiber& f = *tctx->fiber;
  f.wg_groups.push_back(std::move(f.wg_pending));
  f.wg_pending.clear();
}

void wgmma_wait(int pending) {
  Fiber& f = *tctx->fiber;
  if (!f.wg_pending.empty()) trap("wgmma.wait_group with wgmma.mma_async issued but not committed");
  const size_t keep = static_cast<size_t>(pending < 0 ? 0 : pending);
  if (f.wg_groups.size() > keep) {
    const size_t retire = f.wg_groups.size() - keep;
    for (size_t g = 0; g < retire; ++g)
      for (const Fiber::WgmmaOp& op : f.wg_groups[g])
        if (wgmma_operands(nullptr, op.n, op.desc_a, op.desc_b, op.trans_a, op.trans_b, op.bf16, tctx->linear % 128) != op.hash)
          trap("a wgmma's shared-memory operands changed before the wgmma.wait_group that retires it");
    // The registers of the retired MMAs that no MMA still in flight writes get their results.
    for (size_t g = 0; g < retire; ++g)
      for (const Fiber::WgmmaOp& op : f.wg_groups[g]) {
        auto held = f.wg_acc.find(op.d);
        if (held != f.wg_acc.end() && held->second.last_seq == op.seq) {
          std::memcpy(op.d, held->second.values.data(), held->second.values.size() * sizeof(float));
          f.wg_acc.erase(held);
        }
      }
    f.wg_groups.erase(f.wg_groups.begin(), f.wg_groups.begin() + static_cast<std::ptrdiff_t>(retire));
  }
  f.wg_fenced = false;  // the accumulators are the thread's again: the next MMA needs a fence
}

void cp_async_wait(int pending) {
  Fiber& f = *tctx->fiber;
  const size_t keep = static_cast<size_t>(pending < 0 ? 0 : pending);
  if (f.cp_groups.size() <= keep) return;
  const size_t land = f.cp_groups.size() - keep;
  bool landed = false;
  for (size_t g = 0; g < land; ++g) {
    perform(f.cp_groups[g]);
    landed = landed || !f.cp_groups[g].empty();
  }
  if (landed && !f.proxy_dirty) {  // generic-proxy writes that a wgmma may read only after a proxy fence
    f.proxy_dirty = true;
    ++tctx->block->proxy_dirty;
  }
  f.cp_groups.erase(f.cp_groups.begin(), f.cp_groups.begin() + static_cast<std::ptrdiff_t>(land));
}

// ---- mbarriers and TMA copies -----------------------------------------------------------------------------------
namespace {

// The mbarrier at shared address bar of block b (the caller's, or another block of its cluster).
MBar& mbar_at_in(BlockState& b, uint32_t bar, const char* what, bool init = false) {
  if (bar % 8 != 0) trap(std::string(what) + ": mbarrier address not 8-byte aligned");
  if (bar < kSharedWindowStart || bar - kSharedWindowStart + 8 > b.dynamic_bytes)
    trap(std::string(what) + ": mbarrier outside the block's dynamic shared memory");
  MBarTable& t = *b.mbars;
  for (unsigned i = 0; i < t.used; ++i)
    if (t.bars[i].addr == bar) return t.bars[i];
  if (!init) trap(std::string(what) + ": an mbarrier that was never initialised");
  if (t.used == 32) trap("mbarrier: more than 32 in a block (the simulator's limit)");
  MBar& m = t.bars[t.used++];
  m.addr = bar;
  return m;
}

MBar& mbar_at(uint32_t bar, const char* what, bool init = false) { return mbar_at_in(*tctx->block, bar, what, init); }

// Block `rank` of the caller's cluster, which must not have exited.
BlockState& cluster_block(uint32_t rank, const char* what) {
  ClusterState& cl = *tctx->block->cluster;
  if (rank >= cl.blocks.size()) trap(std::string(what) + ": a rank outside the cluster");
  BlockState& b = *cl.blocks[rank];
  if (b.live == 0) trap(std::string(what) + ": a block of the cluster that has exited (its shared memory is gone)");
  return b;
}

bool phase_ready(const MBar& m) { return m.count != 0 && m.pending == 0 && m.tx_issued == m.tx_expect; }

// Completes the current phase in the calling thread: its copies land, waiters go on.
void complete_phase(MBar& m) {
  for (unsigned i = 0; i < m.num_copies; ++i) land_tma_box(m.copies[i].dst, m.copies[i].box);
  m.num_copies = 0;
  m.pending = m.count;
  m.tx_expect = m.tx_issued = 0;
  ++m.phase;
  for (unsigned i = 0; i < m.num_waiting; ++i)
    if (m.waiting[i]->state == Fiber::kWaiting) m.waiting[i]->state = Fiber::kReady;
  m.num_waiting = 0;
#if MPF_SIM_TSAN
  __tsan_release(&m.sync);
#endif
}

// After an arrival or a copy: a phase whose copies cover its bytes wakes its waiters (the first lands them);
// one without copies completes at once.
void progress(MBar& m) {
  if (m.pending == 0 && m.tx_issued > m.tx_expect)
    trap("mbarrier: TMA copies of more bytes than its phase's expect_tx announced");
  if (!phase_ready(m)) return;
  if (m.num_copies == 0) {
    complete_phase(m);
    return;
  }
  for (unsigned i = 0; i < m.num_waiting; ++i)
    if (m.waiting[i]->state == Fiber::kWaiting) m.waiting[i]->state = Fiber::kReady;
  m.num_waiting = 0;
}

// The tensor map as cuTensorMapEncodeTiled stores it in the simulator.
struct SimTensorMap {
  uint64_t magic;
  const unsigned char* base;
  uint64_t dims[5], strides[5];
  uint32_t box[5];
  uint32_t rank, elem_bytes, swizzle;
};
constexpr uint64_t kTensorMapMagic = 0x6D70662D746D6170ull;
static_assert(sizeof(SimTensorMap) <= sizeof(CUtensorMap), "the simulator's tensor map fits the opaque one");

}  // namespace

void mbar_init(uint32_t bar, uint32_t count) {
  if (count == 0 || count >= (1u << 20)) trap("mbarrier.init: count outside [1, 2^20 - 1]");
  MBar& m = mbar_at(bar, "mbarrier.init", true);
  if (m.num_copies != 0 || m.num_waiting != 0) trap("mbarrier.init of an mbarrier in use");
  m.count = m.pending = count;
  m.tx_expect = m.tx_issued = 0;
  m.phase = 0;
}

void fence_mbarrier_init() {}

namespace {
void arrive_on(MBar& m, bool expect_tx, uint32_t bytes) {
  if (phase_ready(m)) complete_phase(m);  // a completed phase whose copies nobody waited for yet
  if (m.pending == 0) trap("mbarrier.arrive: more arrivals than its count in one phase");
  if (expect_tx) m.tx_expect += bytes;
  --m.pending;
#if MPF_SIM_TSAN
  __tsan_release(&m.sync);
#endif
  progress(m);
}
}  // namespace

void mbar_arrive(uint32_t bar, bool expect_tx, uint32_t bytes) { arrive_on(mbar_at(bar, "mbarrier.arrive"), expect_tx, bytes); }

void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  const char* what = "mbarrier.arrive.shared::cluster";
  arrive_on(mbar_at_in(cluster_block(rank, what), bar, what), false, 0);
}

bool mbar_try_wait_parity(uint32_t bar, uint32_t parity) {
  Fiber& f = *sched().current;
  for (;;) {
    MBar& m = mbar_at(bar, "mbarrier.try_wait");
#if MPF_SIM_TSAN
    __tsan_acquire(&m.sync);
#endif
    if ((m.phase & 1u) != (parity & 1u)) return true;  // the phase of that parity has completed
    if (phase_ready(m)) {
      complete_phase(m);
      continue;
    }
    m.waiting[m.num_waiting++] = &f;
    f.state = Fiber::kWaiting;
    to_scheduler(f, false);
    if (f.abort) {
      for (unsigned i = 0; i < m.num_waiting; ++i)
        if (m.waiting[i] == &f) {
          m.waiting[i] = m.waiting[--m.num_waiting];
          break;
        }
      throw Trap{"deadlock: the block's threads wait at barriers that cannot complete (an mbarrier's phase)"};
    }
  }
}

namespace {
// One TMA copy into block b's shared memory at dst, completing on b's mbarrier at bar.
void tma_copy_to(BlockState& b, uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar) {
  SimTensorMap t;
  std::memcpy(&t, map, sizeof t);
  if (t.magic != kTensorMapMagic) trap("cp.async.bulk.tensor: not a tensor map from cuTensorMapEncodeTiled");
  if (t.rank != 3) trap("cp.async.bulk.tensor.3d: the tensor map's rank is not 3");
  if (t.swizzle != CU_TENSOR_MAP_SWIZZLE_128B || t.box[0] * t.elem_bytes != 128)
    trap("cp.async.bulk.tensor: the simulator models the 128-byte swizzle over 128-byte box rows only");
  if (dst % 1024 != 0)
    trap("cp.async.bulk.tensor: a 128-byte-swizzled destination not 1024-byte aligned");
  const size_t bytes = size_t{t.box[0]} * t.box[1] * t.box[2] * t.elem_bytes;
  if (dst < kSharedWindowStart || dst - kSharedWindowStart + bytes > b.dynamic_bytes)
    trap("cp.async.bulk.tensor: destination outside the block's dynamic shared memory");
  unsigned char* d = b.dynamic_base + (dst - kSharedWindowStart);
  MBar& m = mbar_at_in(b, bar, "cp.async.bulk.tensor");
  if (phase_ready(m)) complete_phase(m);
  if (m.num_copies == 16) trap("cp.async.bulk.tensor: more than 16 copies on one mbarrier phase (the simulator's limit)");
  TmaBox box{t.base, {t.dims[0], t.dims[1], t.dims[2]}, {t.elem_bytes, t.strides[1], t.strides[2]},
             {t.box[0], t.box[1], t.box[2]}, {c0, c1, c2}};
  land_poison(d, bytes);
  m.copies[m.num_copies++] = TmaCopy{d, box};
  m.tx_issued += bytes;
#if MPF_SIM_TSAN
  __tsan_release(&m.sync);
#endif
  progress(m);
}
}  // namespace

void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar) {
  tma_copy_to(*tctx->block, dst, map, c0, c1, c2, bar);
}

void tma_load_3d_multicast(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar, uint16_t mask) {
  const char* what = "cp.async.bulk.tensor.multicast::cluster";
  if (mask == 0) trap(std::string(what) + ": an empty CTA mask");
  for (uint32_t r = 0; r < 16; ++r)
    if ((mask >> r) & 1u) tma_copy_to(cluster_block(r, what), dst, map, c0, c1, c2, bar);
}

unsigned cluster_rank() { return tctx->block->rank; }

void cluster_arrive() {
  Fiber& f = *tctx->fiber;
  if (f.cluster_arrived) trap("barrier.cluster.arrive twice without a wait between");
  f.cluster_arrived = true;
}

void cluster_wait() {
  Fiber& f = *tctx->fiber;
  if (!f.cluster_arrived) trap("barrier.cluster.wait without an arrive before it");
  f.cluster_arrived = false;
  arrive_and_wait(tctx->block->cluster->bar, 0);
}

void setmaxnreg(unsigned regs) {
  if (tctx->block->nthreads % 128 != 0) trap("setmaxnreg: the block is not made of whole warpgroups");
  if (regs < 24 || regs > 256 || regs % 8 != 0) trap("setmaxnreg: a count outside [24, 256] or not a multiple of 8");
}

void run(const LaunchShape& s, const std::function<void()>& body) {
  const Config& cfg = config();
  const uint64_t threads = uint64_t{s.block.x} * s.block.y * s.block.z;
  auto refuse = [](cudaError_t e, const std::string& why) {
    if (std::getenv("MPF_SIM_VERBOSE")) std::fprintf(stderr, "cuda-sim: launch refused: %s\n", why.c_str());
    last_error = e;
    launch_status = e;
  };
  if (sched().current) trap("a kernel launched from a kernel");
  if (s.grid.x == 0 || s.grid.y == 0 || s.grid.z == 0 || s.grid.x > 0x7fffffffu || s.grid.y > cfg.max_grid_y || s.grid.z > cfg.max_grid_y)
    return refuse(cudaErrorInvalidConfiguration, "grid outside (2^31 - 1, max_grid_y, max_grid_y)");
  if (threads == 0 || threads > 1024 || s.block.z > 64) return refuse(cudaErrorInvalidConfiguration, "block size");
  size_t dyn_limit = cfg.dynamic_smem_default;
  {
    auto it = func_attrs().find(s.kernel);
    if (it != func_attrs().end() && it->second > dyn_limit) dyn_limit = it->second;
  }
  if (s.dynamic_smem > dyn_limit) return refuse(cudaErrorInvalidValue, "dynamic shared memory over the function's limit");
  const size_t param_limit = cfg.driver_version >= 12010 ? 32764 : 4096;
  if (s.param_bytes > param_limit) return refuse(cudaErrorInvalidValue, "kernel arguments over the driver's limit");

  const unsigned csize = s.cluster.x * s.cluster.y * s.cluster.z;
  if (csize == 0 || csize > 8 || s.grid.x % s.cluster.x != 0 || s.grid.y % s.cluster.y != 0 || s.grid.z % s.cluster.z != 0)
    return refuse(cudaErrorInvalidConfiguration, "cluster dimensions that do not divide the grid, or more than 8 blocks");
  if (threads * csize > 1024) return refuse(cudaErrorInvalidConfiguration, "more than 1024 threads in a cluster (the simulator's limit)");

  Scheduler& sc = sched();
#if MPF_SIM_TSAN
  if (!sc.tsan) sc.tsan = __tsan_get_current_fiber();
#endif
  ++stats().launches;
  stats().last_dynamic_smem = s.dynamic_smem;
  launch_status = cudaSuccess;
  const uint64_t nblocks = uint64_t{s.grid.x} * s.grid.y * s.grid.z;
  const uint64_t nclusters = nblocks / csize;
  std::vector<uint64_t> order(nclusters);
  std::iota(order.begin(), order.end(), uint64_t{0});
  if (cfg.shuffle_blocks) std::shuffle(order.begin(), order.end(), std::mt19937_64(static_cast<uint64_t>(stats().launches)));

  // Each block of a cluster has shared memory of its own.
  const size_t smem_total = std::max(cfg.smem_optin_limit, size_t{64 * 1024});
  const size_t arena = smem_total + 256;
  std::unique_ptr<unsigned char[]> smem(new unsigned char[arena * csize]);
  auto base_of = [&](unsigned r) {
    unsigned char* a = smem.get() + arena * r;
    return a + (256 - reinterpret_cast<uintptr_t>(a) % 256) % 256;
  };
  const unsigned nthreads = static_cast<unsigned>(threads);
  const unsigned nfibers = nthreads * csize;
  while (sc.fibers.size() < nfibers) sc.fibers.emplace_back(new Fiber());
  blockDim = s.block;
  gridDim = s.grid;
  const uint64_t gcx = s.grid.x / s.cluster.x, gcy = s.grid.y / s.cluster.y;

  for (uint64_t linear_cluster : order) {
    ClusterState cl;
    cl.bar.expected = nfibers;
    std::vector<BlockState> blocks(csize);
    const uint3 corner{static_cast<unsigned>(linear_cluster % gcx * s.cluster.x),
                       static_cast<unsigned>(linear_cluster / gcx % gcy * s.cluster.y),
                       static_cast<unsigned>(linear_cluster / (gcx * gcy) * s.cluster.z)};
    for (unsigned r = 0; r < csize; ++r) {
      BlockState& b = blocks[r];
      unsigned char* base = base_of(r);
      b.nthreads = nthreads;
      b.idx = uint3{corner.x + r % s.cluster.x, corner.y + r / s.cluster.x % s.cluster.y,
                    corner.z + r / (s.cluster.x * s.cluster.y)};
      b.rank = r;
      b.cluster = &cl;
      b.live = nthreads;
      b.mbars.reset(new MBarTable());
      b.bar.expected = nthreads;
      const unsigned nwarps = (nthreads + 31) / 32;
      b.warps.resize(nwarps);
      for (unsigned w = 0; w < nwarps; ++w) b.warps[w].expected = std::min(32u, nthreads - 32 * w);
      smem_poison(base, smem_total);
      smem_unpoison(base, s.dynamic_smem);
      std::memset(base, 0xff, s.dynamic_smem);  // as static slots are when allocated: NaN, -1 or an invalid bool
      b.dynamic_base = base;
      b.dynamic_bytes = s.dynamic_smem;
      const size_t static_at = (s.dynamic_smem + 64 + 127) / 128 * 128;  // a poisoned gap after the dynamic part
      b.static_base = base + static_at;
      b.static_limit = std::min(cfg.static_smem_limit, cfg.smem_optin_limit - std::min(cfg.smem_optin_limit, static_at));
      cl.blocks.push_back(&b);
      ++stats().blocks;
    }
    sc.body = &body;
    for (unsigned i = 0; i < nfibers; ++i) {
      Fiber& f = *sc.fibers[i];
      const unsigned t = i % nthreads;
      f.state = Fiber::kReady;
      f.abort = false;
      f.ctx = ThreadCtx{&blocks[i / nthreads], &f, t};
      f.tid = uint3{t % s.block.x, t / s.block.x % s.block.y, t / (s.block.x * s.block.y)};
      f.cp_pending.clear();
      f.cp_groups.clear();
      f.wg_pending.clear();
      f.wg_groups.clear();
      f.wg_acc.clear();
      f.wg_seq = 0;
      f.wg_fenced = false;
      f.proxy_dirty = false;
      f.cluster_arrived = false;
    }
    auto any_trapped = [&] {
      for (const BlockState& b : blocks)
        if (b.trapped) return true;
      return false;
    };
    // Each thread runs until it waits at a barrier or ends, in thread order, then in reverse in the next cluster
    // (counted over all launches, so that one-block launches take both orders too). In every other launch with
    // clusters, a block's threads run until none of them can before the next block's do: one block of a cluster
    // gets as far ahead of the others as its synchronisation allows (and may exit while they still run).
    const bool reverse = (stats().blocks & 1) == 0;
    const bool by_block = csize > 1 && (stats().launches & 1) != 0;
    std::vector<bool> started(nfibers, false);
    auto run_ready = [&](unsigned first, unsigned count) {  // one sweep over fibers [first, first + count)
      bool ran = false;
      for (unsigned i = 0; i < count; ++i) {
        Fiber& f = *sc.fibers[first + (reverse ? count - 1 - i : i)];
        if (f.state != Fiber::kReady) continue;
        const unsigned at = static_cast<unsigned>(f.ctx.block - blocks.data()) * nthreads + f.ctx.linear;
        to_fiber(f, !started[at]);
        started[at] = true;
        ran = true;
        if (any_trapped()) stop_block(nfibers, started);  // a trap ends the whole grid: no thread goes on
      }
      return ran;
    };
    for (;;) {
      bool ran = false, waiting = false;
      if (by_block) {
        for (unsigned rb = 0; rb < csize; ++rb) {
          const unsigned r = reverse ? csize - 1 - rb : rb;
          while (run_ready(r * nthreads, nthreads)) ran = true;
        }
      } else {
        ran = run_ready(0, nfibers);
      }
      for (unsigned i = 0; i < nfibers; ++i) waiting = waiting || sc.fibers[i]->state == Fiber::kWaiting;
      if (ran) continue;
      if (!waiting) break;
      // Nothing can run and some threads wait: unwind them with a trap.
      for (unsigned i = 0; i < nfibers; ++i) {
        Fiber& f = *sc.fibers[i];
        if (f.state == Fiber::kWaiting) {
          f.abort = true;
          f.state = Fiber::kReady;
        }
      }
    }
    sc.body = nullptr;
#if MPF_SIM_TSAN
    __tsan_acquire(&block_end);
#endif
    for (BlockState& b : blocks) {
      for (const auto& [key, issue] : b.wg_issued)
        if (!b.trapped && issue.threads != 128) {
          b.trapped = true;
          b.trap_message = "wgmma: " + std::to_string(issue.threads) + " of warpgroup " + std::to_string(key.first) +
                           "'s 128 threads issued its wgmma.mma_async number " + std::to_string(key.second) +
                           " (a warpgroup-wide instruction)";
        }
      if (b.trapped) {
        std::fprintf(stderr, "cuda-sim: block (%u, %u, %u) trapped: %s\n", b.idx.x, b.idx.y, b.idx.z, b.trap_message.c_str());
        last_error = cudaErrorLaunchFailure;
        launch_status = cudaErrorLaunchFailure;
        for (unsigned r = 0; r < csize; ++r) smem_unpoison(base_of(r), smem_total);
        return;
      }
    }
  }
  for (unsigned r = 0; r < csize; ++r) smem_unpoison(base_of(r), smem_total);
}

int last_launch_status() { return launch_status; }

}  // namespace mpf_sim

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = mpf_sim::last_error;
  mpf_sim::last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return mpf_sim::last_error; }

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidValue;
  const mpf_sim::Config& c = mpf_sim::config();
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = c.sms; return cudaSuccess;
    case cudaDevAttrMaxGridDimY: *value = static_cast<int>(c.max_grid_y); return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = c.cc_major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = c.cc_minor; return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

cudaError_t cudaDriverGetVersion(int* version) {
  *version = mpf_sim::config().driver_version;
  return cudaSuccess;
}

CUresult cuTensorMapEncodeTiled(CUtensorMap* tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank,
                                void* globalAddress, const cuuint64_t* globalDim, const cuuint64_t* globalStrides,
                                const cuuint32_t* boxDim, const cuuint32_t* elementStrides, CUtensorMapInterleave interleave,
                                CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill) {
  using mpf_sim::SimTensorMap;
  // The driver's documented requirements (cuda.h), for the modes the simulator models.
  if (mpf_sim::config().refuse_tensor_maps) return CUDA_ERROR_INVALID_VALUE;
  if (reinterpret_cast<uintptr_t>(tensorMap) % 64 != 0 || tensorRank == 0 || tensorRank > 5) return CUDA_ERROR_INVALID_VALUE;
  if (tensorDataType != CU_TENSOR_MAP_DATA_TYPE_UINT16 && tensorDataType != CU_TENSOR_MAP_DATA_TYPE_FLOAT16 &&
      tensorDataType != CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
    return CUDA_ERROR_INVALID_VALUE;
  const uint32_t elem = 2;
  if (reinterpret_cast<uintptr_t>(globalAddress) % 16 != 0 || interleave != CU_TENSOR_MAP_INTERLEAVE_NONE)
    return CUDA_ERROR_INVALID_VALUE;
  if (l2Promotion > CU_TENSOR_MAP_L2_PROMOTION_L2_256B || oobFill > CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)
    return CUDA_ERROR_INVALID_VALUE;
  SimTensorMap t{};
  for (cuuint32_t i = 0; i < tensorRank; ++i) {
    if (globalDim[i] == 0 || globalDim[i] > (uint64_t{1} << 32)) return CUDA_ERROR_INVALID_VALUE;
    if (boxDim[i] == 0 || boxDim[i] > 256) return CUDA_ERROR_INVALID_VALUE;
    if (elementStrides[i] != 1) return CUDA_ERROR_INVALID_VALUE;  // the simulator models unit traversal strides only
    if (i > 0 && (globalStrides[i - 1] % 16 != 0 || globalStrides[i - 1] >= (uint64_t{1} << 40))) return CUDA_ERROR_INVALID_VALUE;
    t.dims[i] = globalDim[i];
    t.strides[i] = i == 0 ? elem : globalStrides[i - 1];
    t.box[i] = boxDim[i];
  }
  const uint32_t inner = boxDim[0] * elem;
  if (inner % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
  const uint32_t span[] = {0, 32, 64, 128};
  if (swizzle > CU_TENSOR_MAP_SWIZZLE_128B || (swizzle != CU_TENSOR_MAP_SWIZZLE_NONE && inner > span[swizzle]))
    return CUDA_ERROR_INVALID_VALUE;
  t.magic = mpf_sim::kTensorMapMagic;
  t.base = static_cast<const unsigned char*>(globalAddress);
  t.rank = tensorRank;
  t.elem_bytes = elem;
  t.swizzle = swizzle;
  std::memset(tensorMap, 0, sizeof *tensorMap);
  std::memcpy(tensorMap, &t, sizeof t);
  return CUDA_SUCCESS;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int version, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  *fn = nullptr;
  if (std::strcmp(symbol, "cuTensorMapEncodeTiled") != 0) {
    if (status) *status = cudaDriverEntryPointSymbolNotFound;
    return cudaSuccess;
  }
  if (version < 12000 || static_cast<int>(version) > mpf_sim::config().driver_version) {
    if (status) *status = cudaDriverEntryPointVersionNotSufficent;
    return cudaSuccess;
  }
  *fn = reinterpret_cast<void*>(&cuTensorMapEncodeTiled);
  if (status) *status = cudaDriverEntryPointSuccess;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
