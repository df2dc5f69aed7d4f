"""The `Linear` variants of the quantization schemes: each owns its packed weights and scales and the
matmul it calls, and holds its tensors as frozen parameters (so they move, and go to huge pages, with the
model's)."""

from __future__ import annotations

import torch
from torch import nn

from mili_openai.kernels.fp8 import Fp8Weights
from mili_openai.kernels.quantized import PackedWeights, dequantize
from mili_openai.model.kernel_backend import KernelBackend, require_backend
from mili_openai.model.quantization.activations import Int8Activations


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class QuantizedLinear(nn.Module):
    """y = x @ W.T with W int8 or int4 (the layouts of mili_openai.kernels.quantized), dequantized by `matmul`
    on the fly by the backend's `quantized_matmul` (a kernel, or the torch reference). With `activations`
    (W8A8) the packed weights say so (`int8_inputs`) and the matmul quantizes x to int8 first."""

    def __init__(self, packed: PackedWeights, backend: KernelBackend,
                 activations: Int8Activations | None = None) -> None:
        super().__init__()
        if packed.bits not in (8, 4):
            raise ValueError(f"a quantized linear holds 8- or 4-bit weights, got {packed.bits}")
        self.bits = packed.bits
        self.qweight = frozen(packed.weight)
        self.scales = frozen(packed.scales)
        self.zeros = None if packed.zeros is None else frozen(packed.zeros)
        if activations is not None and packed.bits != 8:
            raise ValueError(f"int8 activations multiply 8-bit weights, got {packed.bits}-bit")
        self.activations = activations
        self.backend = require_backend(backend)

    @property
    def packed(self) -> PackedWeights:
        inputs = None if self.activations is None else self.activations.inputs
        return PackedWeights(self.bits, self.qweight, self.scales, self.zeros, inputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.quantized_matmul(x, self.packed)

    def extra_repr(self) -> str:
        packed = self.packed
        groups = packed.scales.shape[1]
        return (f"in_features={packed.in_features}, out_features={packed.out_features}, bits={self.bits}, "
                f"group_size={packed.in_features // groups}")


class QuantizedEmbedding(nn.Module):
    """Token embeddings read from the quantized LM head they are tied to (int8 with one scale per row, or
    int4 groups): each looked-up row dequantized as `dequantize` does, computed in float32 and rounded once to
    the model's dtype, so the embedding and the logits use the same dequantized matrix, as transformers does
    with a tied checkpoint of those weights."""

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if head.bits == 8 and head.scales.shape[1] != 1:
            raise ValueError("embeddings tied to an int8 LM head need its rows with one scale each")
        self.bits = head.bits
        self.qweight, self.scales, self.zeros = head.qweight, head.scales, head.zeros  # the head's, shared
        self.dtype = dtype

    @property
    def packed(self) -> PackedWeights:
        return PackedWeights(self.bits, self.qweight, self.scales, self.zeros)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = PackedWeights(self.bits, self.qweight[ids], self.scales[ids],
                             None if self.zeros is None else self.zeros[ids])
        return dequantize(rows, self.dtype).view(*input_ids.shape, -1)


class Fp8Linear(nn.Module):
    """fp8 e4m3 weights (the layout of mili_openai.kernels.fp8): `--quantization fp8` (a scale per output row)
    or a fine-grained FP8 checkpoint's projection on CUDA (128x128 blocks), kept in fp8, half the bytes of bf16.
    `matmul` runs them: weight-only for decode batches, W8A8 through torch._scaled_mm for prefill chunks
    (`uses_weight_only`): the backend's `fp8_matmul`, the Triton kernels on CUDA where they build, else the
    torch form of each path (the whole weight dequantized for the weight-only one)."""

    def __init__(self, weights: Fp8Weights, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = frozen(weights.weight)  # (N, K) float8_e4m3fn
        self.weight_scales = frozen(weights.scales)  # (ceil(N / rows), ceil(K / columns)) float32
        self.block = weights.block
        self.backend = require_backend(backend)

    @property
    def fp8(self) -> Fp8Weights:
        return Fp8Weights(self.weight, self.weight_scales, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.fp8_matmul(x, self.fp8)

    def extra_repr(self) -> str:
        scales = "a scale per row" if self.fp8.per_row else f"{self.block[0]}x{self.block[1]} blocks"
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, fp8 e4m3, {scales}"
