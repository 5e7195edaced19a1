// The host-side multi-tensor launch plan: every element of every tensor is covered exactly once, no
// launch exceeds its limits, items come in list order (deterministic reductions), for adversarial
// size lists including a simulated 3e9-element tensor.
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "core/multi_tensor_plan.h"
#include "kernels.h"

using mpf::PlanLimits;

namespace {

void verify(const std::vector<int64_t>& numel, const PlanLimits& lim, const char* what) {
  const auto plan = mpf::plan_multi_tensor(numel.data(), static_cast<int64_t>(numel.size()), lim);
  std::vector<std::vector<uint8_t>> seen(numel.size());
  for (size_t t = 0; t < numel.size(); ++t) seen[t].assign(static_cast<size_t>(mpf::ceil_div(numel[t], lim.chunk_size)), 0);
  int64_t prev_tensor = -1, prev_chunk = -1;
  int64_t covered_total = 0, expected_total = 0;
  for (int64_t n : numel) expected_total += n;
  for (const auto& launch : plan) {
    CHECK(!launch.items.empty(), "%s: empty launch", what);
    CHECK(static_cast<int64_t>(launch.tensors.size()) <= lim.max_tensors, "%s: %zu tensors", what, launch.tensors.size());
    CHECK(static_cast<int64_t>(launch.items.size()) <= lim.max_items, "%s: %zu items", what, launch.items.size());
    std::vector<int> slot_used(launch.tensors.size(), 0);
    for (const auto& it : launch.items) {
      CHECK(it.slot >= 0 && it.slot < static_cast<int32_t>(launch.tensors.size()), "%s: slot %d", what, it.slot);
      if (it.slot < 0 || it.slot >= static_cast<int32_t>(launch.tensors.size())) continue;
      slot_used[it.slot] = 1;
      const int64_t t = launch.tensors[it.slot];
      CHECK(t >= 0 && t < static_cast<int64_t>(numel.size()), "%s: tensor %lld", what, (long long)t);
      CHECK(numel[t] > 0, "%s: empty tensor %lld got an item", what, (long long)t);
      CHECK(it.chunk >= 0 && it.chunk < static_cast<int64_t>(seen[t].size()), "%s: chunk %d of tensor %lld", what, it.chunk, (long long)t);
      if (it.chunk < 0 || it.chunk >= static_cast<int64_t>(seen[t].size())) continue;
      CHECK(seen[t][it.chunk] == 0, "%s: tensor %lld chunk %d covered twice", what, (long long)t, it.chunk);
      seen[t][it.chunk] = 1;
      const int64_t begin = int64_t{it.chunk} * lim.chunk_size;
      const int64_t end = begin + lim.chunk_size < numel[t] ? begin + lim.chunk_size : numel[t];
      CHECK(begin < end, "%s: empty range", what);
      covered_total += end - begin;
      // List order: (tensor, chunk) strictly increasing over the whole plan.
      CHECK(t > prev_tensor || (t == prev_tensor && it.chunk > prev_chunk), "%s: items out of order", what);
      prev_tensor = t;
      prev_chunk = it.chunk;
    }
    for (size_t s = 0; s < slot_used.size(); ++s) CHECK(slot_used[s], "%s: slot %zu has no item", what, s);
  }
  for (size_t t = 0; t < numel.size(); ++t)
    for (size_t c = 0; c < seen[t].size(); ++c) CHECK(seen[t][c] == 1, "%s: tensor %zu chunk %zu missed", what, t, c);
  CHECK(covered_total == expected_total, "%s: covered %lld of %lld elements", what, (long long)covered_total,
        (long long)expected_total);
}

}  // namespace

int main() {
  const PlanLimits cuda = mpf::kCudaOverflowLimits;  // 1024 tensors, 2^30 chunks per launch
  const PlanLimits cpu = mpf::kCpuOverflowLimits;
  const PlanLimits tiny{7, 3, 5};
  const int64_t C = cuda.chunk_size;

  for (const PlanLimits& lim : {cuda, cpu, tiny}) {
    verify({}, lim, "empty list");
    verify({0, 0, 0}, lim, "only empty tensors");
    verify({1}, lim, "one element");
    verify({lim.chunk_size - 1, lim.chunk_size, lim.chunk_size + 1}, lim, "around one chunk");
    verify({0, 5, 0, 0, 9, 0}, lim, "empty tensors between others");
  }
  // Exactly filling a launch's item capacity, and one chunk past it (small limits: the CUDA launches'
  // item capacity, 2^30 chunks, is far beyond what a test can materialise).
  const PlanLimits items16{C, 64, 16};
  verify({items16.max_items * C}, items16, "one launch of items, exactly");
  verify({items16.max_items * C + 1}, items16, "one chunk past a launch");
  verify({5, items16.max_items * C * 3 + 7, 9}, items16, "a tensor over four launches");
  verify(std::vector<int64_t>(cuda.max_tensors, 1), cuda, "tensor capacity, exactly");
  verify(std::vector<int64_t>(cuda.max_tensors * 3 + 1, 3), cuda, "tensor capacity x3 + 1");
  // A simulated 3e9-element tensor (int64 sizes and offsets) between small tensors.
  verify({17, 3'000'000'000LL, 5, C * 2}, cuda, "3e9-element tensor");
  verify({3'000'000'000LL}, cpu, "3e9-element tensor, cpu limits");
  verify({(1LL << 31) - 1, 1LL << 31, (1LL << 31) + 1, (1LL << 32) + 3}, cuda, "int32 boundaries");

  // Random lists against small and real limits.
  std::mt19937_64 rng(12345);
  for (int round = 0; round < 300; ++round) {
    const PlanLimits lim{1 + static_cast<int64_t>(rng() % 64), 1 + static_cast<int64_t>(rng() % 9),
                         1 + static_cast<int64_t>(rng() % 17)};
    std::vector<int64_t> sizes(rng() % 40);
    for (auto& s : sizes) s = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 500);
    verify(sizes, lim, "random");
  }
  {
    std::vector<int64_t> sizes(2000);
    for (auto& s : sizes) s = static_cast<int64_t>(rng() % (3 * C));
    verify(sizes, cuda, "2000 model-like tensors");
  }

  // The limits in kernels.h hold by construction; bad arguments are refused.
  const auto plan = mpf::plan_multi_tensor(std::vector<int64_t>{C * items16.max_items * 2}.data(), 1, items16);
  CHECK(plan.size() == 2, "a tensor of two launches' items takes %zu launches", plan.size());
  for (const PlanLimits& lim : {mpf::kCudaOverflowLimits, mpf::kCudaOptimLimits}) {
    std::vector<int64_t> sizes(static_cast<size_t>(lim.max_tensors) + 1, 3);
    CHECK(mpf::plan_multi_tensor(sizes.data(), static_cast<int64_t>(sizes.size()), lim).size() == 2,
          "max_tensors + 1 tensors must take two launches");
    CHECK(mpf::plan_multi_tensor(sizes.data(), lim.max_tensors, lim).size() == 1, "max_tensors tensors: one launch");
  }
  bool threw = false;
  try {
    const int64_t bad[] = {5, -1};
    mpf::plan_multi_tensor(bad, 2, cuda);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "negative numel accepted");
  threw = false;
  try {
    const int64_t huge[] = {int64_t{1} << 40};
    mpf::plan_multi_tensor(huge, 1, PlanLimits{1, 4, 4});
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "more than 2^31 chunks accepted");
  threw = false;
  try {
    const int64_t one[] = {1};
    mpf::plan_multi_tensor(one, 1, PlanLimits{0, 4, 4});
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "chunk_size 0 accepted");

  // The driver check before the first 32 KB launch: CUDA 12.1 and newer pass; older drivers and no driver
  // get an error that names what was found and what is needed.
  for (int ok : {12010, 12020, 12080, 13000, 13010})
    CHECK(mpf::large_kernel_params_driver_error(ok).empty(), "driver %d refused", ok);
  const std::string old_driver = mpf::large_kernel_params_driver_error(12000);
  CHECK(old_driver.find("a driver for CUDA 12.0") != std::string::npos, "no driver version in: %s", old_driver.c_str());
  CHECK(old_driver.find("CUDA 12.1 or newer") != std::string::npos, "no requirement in: %s", old_driver.c_str());
  CHECK(mpf::large_kernel_params_driver_error(11080).find("CUDA 11.8") != std::string::npos, "11.8 not named");
  const std::string none = mpf::large_kernel_params_driver_error(0);
  CHECK(none.find("no CUDA driver") != std::string::npos, "no driver not named: %s", none.c_str());
  return native_test::finish("test_plan");
}
