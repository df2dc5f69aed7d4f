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

// Weighing, as both attention kernels (decode_shared_amx.cpp, prefill_amx.cpp) do it: accumulators in
// tiles 0-3, the A operand in tile 4, each B operand in turn in tile 5.
#define MILI_TILE_OPS __attribute__((target("amx-tile,amx-bf16")))

MILI_TILE_OPS inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Tiles 0-3 from c, c + step, c + 2 step, c + 3 step (floats), their rows `stride` bytes apart.
MILI_TILE_OPS inline void load_accumulators(const float* c, int64_t step, int64_t stride) {
  _tile_loadd(0, c, stride);
  _tile_loadd(1, c + step, stride);
  _tile_loadd(2, c + 2 * step, stride);
  _tile_loadd(3, c + 3 * step, stride);
}

MILI_TILE_OPS inline void store_accumulators(float* c, int64_t step, int64_t stride) {
  _tile_stored(0, c, stride);
  _tile_stored(1, c + step, stride);
  _tile_stored(2, c + 2 * step, stride);
  _tile_stored(3, c + 3 * step, stride);
}

// Tiles 0-3 += A . B_i: A from `a` (rows a_stride bytes apart) against four B tiles at b + i * b_step
// (dwords), rows b_stride bytes apart.
MILI_TILE_OPS inline void accumulate_four(const void* a, int64_t a_stride, const uint32_t* b, int64_t b_step,
                                          int64_t b_stride) {
  _tile_loadd(4, a, a_stride);
  _tile_loadd(5, b, b_stride);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(5, b + b_step, b_stride);
  _tile_dpbf16ps(1, 4, 5);
  _tile_loadd(5, b + 2 * b_step, b_stride);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(5, b + 3 * b_step, b_stride);
  _tile_dpbf16ps(3, 4, 5);
}

#undef MILI_TILE_OPS

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
