// Gated DeltaNet's five ops (gated_delta_rule_ops.h, gated_deltanet_layer.h) on AVX-512's 16 lanes; the AVX2
// build instantiates the same templates on 8 (csrc_avx2/gated_deltanet_avx2.cpp).
#include <torch/extension.h>

#include "gated_deltanet_layer.h"
#include "vectors_avx512.h"

// Gated DeltaNet's delta rule and causal conv over state pools (kernels/cpu_linear_attention.py wraps them).
void bind_linear_attention(pybind11::module& m) { mili::bind_linear_attention<mili::Avx512>(m); }
