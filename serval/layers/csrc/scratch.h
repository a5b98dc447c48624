// Per-thread scratch memory for the CPU kernels.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace serval {

// A float buffer of at least n elements, one per (thread, slot), kept for the thread's life and grown when needed;
// its contents are whatever the last user left. Kernels run every step: allocating each time cost more than
// their arithmetic (fresh pages of a large buffer fault in one by one, and std::vector zeroes them).
inline float* scratch(int slot, size_t n) {
  thread_local std::vector<float> buffers[5];
  std::vector<float>& buffer = buffers[slot];
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// The same for int64 indices (one buffer per thread).
inline int64_t* scratch_index(size_t n) {
  thread_local std::vector<int64_t> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

}  // namespace serval
