// What the AMX kernels (linear_amx.cpp, decode_shared_amx.cpp, prefill_amx.cpp) share: the operand of
// LDTILECFG, a configuration of whole tiles, and scratch that stays with a thread.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace mili {

// The LDTILECFG operand (palette 1): each tile register's rows and bytes per row.
struct TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int64_t kTileRows = 16;       // rows of a whole tile; fp32 columns of a C tile
constexpr int64_t kTileRowBytes = 64;   // 32 bf16 values, or 16 fp32 / VNNI pairs
constexpr int64_t kTileFloats = kTileRows * kTileRowBytes / 4;  // 1 KB

// Tile registers [0, count) as whole tiles (16 rows of 64 bytes); tile state is per thread.
__attribute__((target("amx-tile"))) inline void configure_whole_tiles(int count) {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int t = 0; t < count; ++t) config.rows[t] = kTileRows, config.colsb[t] = kTileRowBytes;
  _tile_loadconfig(&config);
}

// `floats` of 64-byte aligned scratch that stays with the calling thread, one buffer per Owner type: a
// kernel's buffers take hundreds of KB, which a fresh allocation would map and fault in again on every call.
template <typename Owner>
float* thread_scratch(int64_t floats) {
  constexpr int64_t kAlignFloats = 16;  // 64 bytes: tile loads and aligned vector stores
  thread_local std::vector<float> storage;
  if (static_cast<int64_t>(storage.size()) < floats + kAlignFloats) storage.resize(floats + kAlignFloats);
  return storage.data() + (-reinterpret_cast<uintptr_t>(storage.data()) / sizeof(float) % kAlignFloats);
}

}  // namespace mili
