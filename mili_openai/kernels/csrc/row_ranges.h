// How the matmul kernel's threads share the rows of a weight: each owns a contiguous range and claims it
// from the front, so its reads are one sequential stream that the prefetchers follow from block to block;
// a thread done with its own range takes blocks from the back of the others' (so one that lost its core
// for a while holds up no one, and both finish within a block of each other).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace mili {

class RowRanges {
 public:
  // rows [0, n) in `parts` contiguous ranges, each boundary a multiple of `granule` rows
  RowRanges(int64_t n, int64_t parts, int64_t granule) : ranges_(parts) {
    const int64_t granules = (n + granule - 1) / granule;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t begin = std::min(n, granules * p / parts * granule);
      const int64_t end = std::min(n, granules * (p + 1) / parts * granule);
      ranges_[p].store(pack(begin, end), std::memory_order_relaxed);
    }
  }

  int64_t parts() const { return static_cast<int64_t>(ranges_.size()); }

  // A thread's share, within at::parallel_for over the parts: work(begin, end) over claims of up to
  // `front_rows` from the front of its own parts [first, last), then of up to `back_rows` from the back of
  // every other part.
  template <typename Work>
  void work_through(int64_t first, int64_t last, int64_t front_rows, int64_t back_rows, Work&& work) {
    int64_t begin = 0, end = 0;
    for (int64_t part = first; part < last; ++part)  // one part each, or all where the loop runs inline
      while (claim_front(part, front_rows, begin, end)) work(begin, end);
    for (int64_t step = 1; step < parts(); ++step) {
      const int64_t part = (first + step) % parts();
      while (claim_back(part, back_rows, begin, end)) work(begin, end);
    }
  }

  // Up to `rows` rows from the front of range `part` into [begin, end); false once it is empty.
  bool claim_front(int64_t part, int64_t rows, int64_t& begin, int64_t& end) {
    uint64_t packed = ranges_[part].load(std::memory_order_relaxed);
    while (front(packed) < back(packed)) {
      const int64_t stop = std::min(back(packed), front(packed) + rows);
      if (ranges_[part].compare_exchange_weak(packed, pack(stop, back(packed)))) {
        begin = front(packed), end = stop;
        return true;
      }
    }
    return false;
  }

  // Up to `rows` rows from the back of range `part` into [begin, end); false once it is empty.
  bool claim_back(int64_t part, int64_t rows, int64_t& begin, int64_t& end) {
    uint64_t packed = ranges_[part].load(std::memory_order_relaxed);
    while (front(packed) < back(packed)) {
      const int64_t start = std::max(front(packed), back(packed) - rows);
      if (ranges_[part].compare_exchange_weak(packed, pack(front(packed), start))) {
        begin = start, end = back(packed);
        return true;
      }
    }
    return false;
  }

 private:
  // front in the low 32 bits, back in the high: one compare-and-swap moves either end
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }
  static int64_t front(uint64_t packed) { return static_cast<int64_t>(packed & 0xFFFFFFFFu); }
  static int64_t back(uint64_t packed) { return static_cast<int64_t>(packed >> 32); }

  std::vector<std::atomic<uint64_t>> ranges_;
};

}  // namespace mili
