// Gated DeltaNet's five ops on AVX2's 8 lanes: the AVX-512 build's templates (../csrc/gated_delta_rule_ops.h,
// ../csrc/gated_deltanet_layer.h, which use no intrinsics of their own) over vectors_avx2.h's Avx2. On a CPU
// without AVX-512 the torch reference ops re-read each row's fp32 state several times a token (~150-250 ms of an
// 8-row Qwen3.5 decode step); these read and write it once.
#include <torch/extension.h>

#include "../csrc/gated_deltanet_layer.h"
#include "vectors_avx2.h"

void bind_linear_attention(pybind11::module& m) { mili::bind_linear_attention<mili_avx2::Avx2>(m); }
