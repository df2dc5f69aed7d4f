// What the AMX kernels (linear_amx.cpp, decode_shared_amx.cpp) share: the operand of LDTILECFG.
#pragma once

#include <cstdint>

namespace mili {

// The LDTILECFG operand (palette 1): each tile register's rows and bytes per row.
struct TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace mili
