"""Linears over many rows on oneDNN (torch's mkldnn ops), the bias and a GELU fused, on weights packed once.

The vision tower multiplies every patch of an image (784 of a 448 x 448 one) through each projection. There
oneDNN's matmul on a weight packed ahead into its blocked layout beats `F.linear`, which packs the weight again
at every call (5-10% at the tower's shapes), and the bias and the GELU applied to the matmul's output tile save
a pass over the output each; the tanh GELU most: torch's tanh on CPU costs a quarter of the matmul before it.
Rounding: the bias and the activation apply in fp32 before the one rounding to the output's dtype (bf16 `F.linear`
then `+ bias` then GELU rounds three times), so bf16 outputs may differ from that by an ulp; fp32 ones by fp32
rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the activation names the checkpoints use -> oneDNN's GELU algorithm (`F.gelu`'s `approximate`)
GELU_ALGORITHMS = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}
PACK_ROWS_HINT = 1024  # the rows oneDNN packs the weight for: a few hundred patches per image and up


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """A weight in oneDNN's layout with its bias, and which tensor it was packed from."""

    weight: torch.Tensor  # an mkldnn (opaque) tensor
    bias: torch.Tensor | None
    source: tuple[int, torch.dtype, tuple[int, ...]]  # the plain weight's (data_ptr, dtype, shape)


def weight_key(weight: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...]]:
    return weight.data_ptr(), weight.dtype, tuple(weight.shape)


class OneDnnLinear:
    """`BiasedLinearKernel` (model/kernel_backend.py) on oneDNN, in the dtypes oneDNN runs natively here."""

    def __init__(self) -> None:
        self.dtypes = frozenset({torch.float32} | ({torch.bfloat16} if bf16_supported() else set()))

    def supports(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
                and x.dtype in self.dtypes and x.dim() == 2 and weight.dim() == 2)

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        return PackedLinear(packed, None if bias is None else bias.detach(), weight_key(weight))

    @staticmethod
    def linear(x: torch.Tensor, packed: PackedLinear, activation: str | None = None) -> torch.Tensor:
        """activation(x @ weight.T + bias): None, or a name in GELU_ALGORITHMS."""
        if activation is None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.weight, packed.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.weight, packed.bias, "gelu", [],
                                                  GELU_ALGORITHMS[activation])


def bf16_supported() -> bool:
    """Whether oneDNN runs bf16 natively on this CPU (AVX512-BF16 or AMX); elsewhere it emulates it slowly."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_linear() -> OneDnnLinear | None:
    """The kernel where torch was built with oneDNN and registers its linear ops (private ones: a torch without
    them falls back), else None (the tower's projections stay on `matmul`)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        for op in ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported"):
            getattr(torch.ops.mkldnn, op)
    except (AttributeError, RuntimeError):
        return None
    return OneDnnLinear()
