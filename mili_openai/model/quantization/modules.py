"""The `Linear` variants of the quantization schemes: each owns its packed weights and scales and the
matmul it calls, and holds its tensors as frozen parameters (so they move, and go to huge pages, with the
model's)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mili_openai.kernels.quantized import PackedWeights, dequantize, reference_linear
from mili_openai.model.quantization.dynamic import FP8_MAX

# (x (..., K), packed weight) -> (..., N): the CPU kernels, Triton on CUDA, or the torch reference
QuantizedMatmulFn = Callable[[torch.Tensor, PackedWeights], torch.Tensor]
FP8_MIN_SCALE = 1e-12  # a row of zeros still divides by something


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class QuantizedLinear(nn.Module):
    """y = x @ W.T with W int8 or int4 (the layouts of mili_openai.kernels.quantized), dequantized by `matmul`
    on the fly; `Qwen3ForCausalLM.set_quantized_matmul` routes every one through a kernel."""

    def __init__(self, packed: PackedWeights) -> None:
        super().__init__()
        if packed.bits not in (8, 4):
            raise ValueError(f"a quantized linear holds 8- or 4-bit weights, got {packed.bits}")
        self.bits = packed.bits
        self.qweight = frozen(packed.weight)
        self.scales = frozen(packed.scales)
        self.zeros = None if packed.zeros is None else frozen(packed.zeros)
        self.matmul: QuantizedMatmulFn = reference_linear

    @property
    def packed(self) -> PackedWeights:
        return PackedWeights(self.bits, self.qweight, self.scales, self.zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.packed)

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


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: x (M, K) -> (e4m3 (M, K), float32 scales (M, 1))."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=FP8_MIN_SCALE) / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Fp8Linear(nn.Module):
    """W8A8 fp8 (`--quantization fp8`, CUDA): e4m3 weights with a scale per output row, activations
    quantized per token at each call, one torch._scaled_mm (Hopper and later). Elsewhere the same
    quantization is emulated in float32: that is the reference the CUDA path is tested against."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.weight = frozen(weight)  # (N, K) float8_e4m3fn
        self.weight_scale = frozen(scale)  # (N,) float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        q, x_scale = quantize_rows_fp8(flat)
        if x.is_cuda:  # row-wise scales: bf16 out (torch's kernel takes no other), then x's dtype
            out = torch._scaled_mm(q, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale.view(1, -1),
                                   out_dtype=torch.bfloat16).to(x.dtype)
        else:
            weight = self.weight.float() * self.weight_scale[:, None]
            out = F.linear(q.float() * x_scale, weight).to(x.dtype)
        return out.view(*x.shape[:-1], self.weight.shape[0])

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, fp8 e4m3 per row"


class Fp8BlockLinear(nn.Module):
    """A fine-grained FP8 checkpoint's projection on CUDA: e4m3 weights with one float32 scale per block,
    kept in fp8 (half the memory of bf16) and dequantized to the activations' dtype for each matmul, so
    results are transformers' on the dequantized weights. (On CPU the loader dequantizes once, at load.)"""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
        super().__init__()
        self.weight = frozen(weight)  # (N, K) float8_e4m3fn
        self.weight_scale_inv = frozen(scale_inv)  # (ceil(N / rows), ceil(K / columns)) float32
        self.block = block

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.block).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 (N, K) times its block scales -> float32 (N, K)."""
    rows, columns = weight.shape
    scales = scale_inv.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :columns]
    return weight.float() * scales
