// Contexts addressed through page tables, as the attention kernels take them: position p of a context
// whose pages are `row` is at slot row[p / page_size] * page_size + p % page_size. The kernels walk a
// context in blocks of 16 slots; with pages of 16 (the CPU default) each block is one page, 16 slots side
// by side in the pool. A row's slots are listed once per call (a few KB beside the MB of K/V they read).
#pragma once

#include <torch/extension.h>

#include <algorithm>

namespace mili {

// Checks page_table (rows, W) int32 or int64, contiguous, each row's first ceil(length / page_size) pages
// inside a pool of num_slots slots, each length in [1, W * page_size].
inline void check_page_table(const torch::Tensor& page_table, int64_t page_size, const int64_t* lengths,
                             int64_t rows, int64_t num_slots, const char* who) {
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == rows && page_table.is_contiguous() &&
              (page_table.scalar_type() == at::kLong || page_table.scalar_type() == at::kInt),
              who, ": page_table (rows, W) int64 or int32, contiguous, a row per context");
  TORCH_CHECK(page_size >= 1 && num_slots % page_size == 0, who, ": page_size divides the pool's slots");
  const int64_t width = page_table.size(1), num_pages = num_slots / page_size;
  AT_DISPATCH_INDEX_TYPES(page_table.scalar_type(), "check_page_table", [&] {
    const index_t* table = page_table.data_ptr<index_t>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(lengths[r] >= 1 && lengths[r] <= width * page_size, who, ": context ", r, " holds ", lengths[r],
                  " tokens; its page table row holds 1 to ", width * page_size);
      const index_t* row = table + r * width;
      const int64_t used = (lengths[r] + page_size - 1) / page_size;
      TORCH_CHECK(std::all_of(row, row + used, [&](index_t page) { return page >= 0 && page < num_pages; }),
                  who, ": a page of context ", r, " lies outside the pool's ", num_pages, " pages");
    }
  });
}

// Slots of positions [0, length) of row r of a checked page table, into slots[0, length).
inline void list_context_slots(const torch::Tensor& page_table, int64_t page_size, int64_t r, int64_t length,
                               int64_t* slots) {
  AT_DISPATCH_INDEX_TYPES(page_table.scalar_type(), "list_context_slots", [&] {
    const index_t* row = page_table.data_ptr<index_t>() + r * page_table.size(1);
    for (int64_t p0 = 0, page = 0; p0 < length; p0 += page_size, ++page) {
      const int64_t first = static_cast<int64_t>(row[page]) * page_size, n = std::min(page_size, length - p0);
      for (int64_t i = 0; i < n; ++i) slots[p0 + i] = first + i;
    }
  });
}

// The checked table's contexts as slot rows (rows, max length) int64; a row's entries past its length are
// left unset (the kernels read a row only up to its length).
inline torch::Tensor context_slot_rows(const torch::Tensor& page_table, int64_t page_size, const int64_t* lengths,
                                       int64_t rows) {
  const int64_t width = rows ? *std::max_element(lengths, lengths + rows) : 0;
  auto slots = torch::empty({rows, width}, torch::dtype(at::kLong));
  int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) list_context_slots(page_table, page_size, r, lengths[r], sp + r * width);
  return slots;
}

}  // namespace mili
