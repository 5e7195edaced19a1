// Mapping a block index to its (tensor slot, chunk) work item, for kernels over lists of tensors.
//
// A launch's items come from core/multi_tensor_plan.h in list order: each slot's items are contiguous
// and its chunks consecutive. So instead of listing every item (which would cap a launch at a few
// thousand chunks in the 32 KB parameter space), a launch stores per slot the index of its first item
// and its first chunk; a block finds its slot by binary search. A launch then holds any number of
// chunks, and its capacity is counted in tensors alone.
#pragma once

#include <cstdint>
#include <stdexcept>

#include "../core/multi_tensor_plan.h"

namespace mpf {

struct WorkItem {
  int slot;
  int64_t chunk;
};

template <int kMaxSlots>
struct WorkIndex {
  int32_t first_item[kMaxSlots + 1];  // first_item[s] <= block < first_item[s + 1]; [n] = item count
  int32_t first_chunk[kMaxSlots];
  int32_t num_slots;

  // Host: encodes one launch of the plan; returns its number of items (the grid size).
  int fill(const PlanLaunch& launch) {
    const int n = static_cast<int>(launch.tensors.size());
    if (n > kMaxSlots || launch.items.size() > static_cast<size_t>(INT32_MAX))
      throw std::logic_error("mpfused: a launch exceeds the kernel's capacity");
    int slot = -1;
    for (size_t i = 0; i < launch.items.size(); ++i) {
      const PlanItem& it = launch.items[i];
      if (it.slot != slot) {  // items are grouped by slot, in slot order
        if (it.slot != slot + 1) throw std::logic_error("mpfused: plan items out of slot order");
        slot = it.slot;
        first_item[slot] = static_cast<int32_t>(i);
        first_chunk[slot] = it.chunk;
      }
    }
    num_slots = n;
    first_item[n] = static_cast<int32_t>(launch.items.size());
    return first_item[n];
  }

#if defined(__CUDACC__)
  // Device: the last slot whose first item is <= block.
  __device__ __forceinline__ WorkItem find(int32_t block) const {
    int lo = 0, hi = num_slots - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (first_item[mid] <= block) lo = mid;
      else hi = mid - 1;
    }
    return WorkItem{lo, int64_t{first_chunk[lo]} + (block - first_item[lo])};
  }
#endif
};

}  // namespace mpf
