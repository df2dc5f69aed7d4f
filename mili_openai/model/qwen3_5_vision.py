"""Qwen3.5 / Qwen3.6's vision tower (transformers' `Qwen3_5VisionModel`): images' patches -> one embedding per
2 x 2 block of patches, the width of the language model's hidden states.

A patch is temporal_patch_size x patch_size x patch_size pixels of each channel, flattened as the image processor
writes it (`pixel_values` rows, in 2 x 2 merge-block order). Steps, per transformers:
- patch embedding: a Conv3d whose stride is its kernel, i.e. one matmul per patch (the backend's, on the
  flattened kernel);
- a learned (side x side) position table, bilinearly resampled (align_corners) to each image's patch grid;
- `depth` pre-norm blocks (LayerNorm, attention with a 2-D rotary of each patch's (row, column), LayerNorm, GELU
  MLP); attention runs over each image's (each frame's) own patches only, bidirectionally;
- the merger: LayerNorm, each 2 x 2 block's four patches concatenated, a GELU MLP out to the text hidden size;
- Qwen3-VL's DeepStack (transformers' `Qwen3VLVisionModel`): the output of each block in
  `deepstack_visual_indexes` goes through a merger of its own, which norms after concatenating the four patches.
Module names are the checkpoint's (`model.visual.` stripped): `patch_embed.proj`, `pos_embed`, `blocks.N.attn.qkv`,
`blocks.N.attn.proj`, `blocks.N.mlp.linear_fc1/2`, `blocks.N.norm1/2`, `merger.norm`, `merger.linear_fc1/2`,
`deepstack_merger_list.N.*`.
The projections (and the patch embedding) run through the language model's `KernelBackend`: its `biased_linear`
where set (CPU: oneDNN on packed weights, the bias and the blocks' and mergers' GELU fused), else `matmul`, then
the bias and the GELU. Attention runs over each image's own patches, the frames of one size in one call: the
backend's `image_attention` where it takes them (CPU, bf16: the prefill kernel), else torch's SDPA (4-D: its
flash kernel).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mili_openai.kernels.onednn_linear import weight_key
from mili_openai.model.kernel_backend import ImageAttentionKernel, KernelBackend, require_backend
from mili_openai.model.layers import embedding_table
from mili_openai.model.vision_config import VisionTowerConfig

LAYER_NORM_EPS = 1e-6
GRID_TABLES_CACHED = 16  # image grid sizes whose position embeddings and rotary tables the tower keeps
MERGER_ACTIVATION = "gelu"  # the mergers' GELU is the exact (erf) one, whatever the blocks' hidden_act
GridTHW = tuple[int, int, int]  # an image's (frames / temporal_patch_size, patch rows, patch columns)


def _gelu(name: str):
    return (lambda x: F.gelu(x, approximate="tanh")) if name == "gelu_pytorch_tanh" else F.gelu


def merge_block_coordinates(grid: GridTHW, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each patch of one image, in the order its pixel_values rows come: 2 x 2 merge blocks in
    raster order, each block's patches in raster order, frame after frame. -> two (t * h * w,) int64."""
    frames, height, width = grid
    rows = torch.arange(height).view(height // merge, merge, 1, 1).expand(-1, -1, width // merge, merge)
    cols = torch.arange(width).view(1, 1, width // merge, merge).expand(height // merge, merge, -1, -1)
    rows, cols = rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)
    return rows.repeat(frames), cols.repeat(frames)


def biased_linear(backend: KernelBackend, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  packs: dict[str, Any], activation: str | None = None) -> torch.Tensor:
    """activation(x @ weight.T + bias): through the backend's `biased_linear` where it takes x (the weight packed
    on first use and kept in `packs` while the weight is that tensor and the kernel that one), else its `matmul`,
    then the bias and the activation (None or a name `_gelu` knows)."""
    kernel = backend.biased_linear
    if kernel is not None and kernel.supports(x, weight):
        packed = packs.get("packed")
        if packed is None or packed.source != weight_key(weight) or packs.get("kernel") is not kernel:
            packs.clear()  # the old layout's memory goes before the new one is made
            packed = packs["packed"] = kernel.pack(weight, bias)
            packs["kernel"] = kernel
        return kernel.linear(x, packed, activation)
    out = backend.matmul(x, weight).add_(bias)  # in place on the matmul's fresh output
    return out if activation is None else _gelu(activation)(out)


class BiasedLinear(nn.Module):
    """y = x @ weight.T + bias, an activation fused where asked (the tower's projections all have a bias)."""

    def __init__(self, in_features: int, out_features: int, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        self.backend = require_backend(backend)
        self.packs: dict[str, Any] = {}  # the weight in the backend kernel's layout (see `biased_linear`)

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        return biased_linear(self.backend, x, self.weight, self.bias, self.packs, activation)


class VisionPatchEmbed(nn.Module):
    def __init__(self, config: VisionTowerConfig, backend: KernelBackend) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)
        self.backend = require_backend(backend)
        self.packs: dict[str, Any] = {}

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches (N, patch_dim) -> (N, hidden): the conv over one kernel-sized patch is a dot product."""
        weight = self.proj.weight
        flat = weight.reshape(weight.shape[0], -1)  # (hidden, patch_dim), a view of the contiguous conv weight
        return biased_linear(self.backend, patches.to(weight.dtype), flat, self.proj.bias, self.packs)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionTowerConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = BiasedLinear(config.hidden_size, 3 * config.hidden_size, backend)
        self.proj = BiasedLinear(config.hidden_size, config.hidden_size, backend)
        self.backend = require_backend(backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x (N, hidden), cos/sin (N, head_dim) float32, lengths: patches per image frame (sum N)."""
        count = x.shape[0]
        qkv = self.qkv(x).view(count, 3, self.num_heads, self.head_dim)
        q, k = rotate_pairs(qkv[:, :2].transpose(0, 1), cos, sin)
        out = attention_per_image(q, k, qkv[:, 2], lengths, self.backend.image_attention)
        return self.proj(out.reshape(count, -1))


def rotate_pairs(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q and k (2, N, heads, head_dim) rotated in float32, then back to their dtype, rounded as transformers'
    apply_rotary_pos_emb_vision (x * cos + rotate_half(x) * sin) rounds: cos and sin repeat their first half, so
    each half is two products and a difference or sum, in place on the float32 copy, without rotate_half's copies
    (a quarter of the time). The result is contiguous, q and k each too, as the attention kernel takes K."""
    x = qk.to(torch.float32, copy=True)  # a copy even in float32: the rotation runs in place on it
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :half], sin[:, None, :half]  # (N, 1, half)
    first_sin, second_sin = first * sin, second * sin
    first.mul_(cos).sub_(second_sin)
    second.mul_(cos).add_(first_sin)
    return x.to(qk.dtype)


def attention_per_image(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                        kernel: ImageAttentionKernel | None = None) -> torch.Tensor:
    """Bidirectional attention of each image frame's patches over its own: q, k, v (N, heads, head_dim), the
    frames' `lengths` in order -> (N, heads, head_dim). Consecutive frames of one length run as one call: the
    backend's `kernel` where it takes them, else torch's SDPA, 4-D: its CPU flash kernel takes only 4-D inputs
    (3-D ones fall to the math path, several times slower, which materialises every score)."""
    heads, head_dim = q.shape[1:]
    outputs, start = [], 0
    for length, run in itertools.groupby(lengths):
        frames = len(list(run))
        end = start + frames * length
        out = None if kernel is None else kernel.attend(q[start:end], k[start:end], v[start:end], frames)
        if out is None:
            def heads_first(t: torch.Tensor) -> torch.Tensor:  # (frames, heads, length, head_dim), a view
                return t[start:end].view(frames, length, heads, head_dim).transpose(1, 2)

            out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v))
            out = out.transpose(1, 2).reshape(frames * length, heads, head_dim)
        outputs.append(out)
        start = end
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionTowerConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.linear_fc1 = BiasedLinear(config.hidden_size, config.intermediate_size, backend)
        self.linear_fc2 = BiasedLinear(config.intermediate_size, config.hidden_size, backend)
        self.hidden_act = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.linear_fc1(x, self.hidden_act))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionTowerConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(config, backend)
        self.mlp = VisionMLP(config, backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class VisionPatchMerger(nn.Module):
    def __init__(self, config: VisionTowerConfig, backend: KernelBackend, norm_after_merge: bool = False) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size ** 2
        self.norm_after_merge = norm_after_merge  # DeepStack's mergers norm the four patches together
        self.norm = nn.LayerNorm(self.merged_size if norm_after_merge else config.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = BiasedLinear(self.merged_size, self.merged_size, backend)
        self.linear_fc2 = BiasedLinear(self.merged_size, config.out_hidden_size, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, hidden) in merge-block order -> (N / merge^2, out_hidden)."""
        if self.norm_after_merge:
            merged = self.norm(x.view(-1, self.merged_size))
        else:
            merged = self.norm(x).view(-1, self.merged_size)
        return self.linear_fc2(self.linear_fc1(merged, MERGER_ACTIVATION))


class Qwen3_5VisionTower(nn.Module):
    def __init__(self, config: VisionTowerConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.config = config
        self.side = round(config.num_position_embeddings ** 0.5)
        self.patch_embed = VisionPatchEmbed(config, backend)
        self.pos_embed = embedding_table(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config, backend) for _ in range(config.depth))
        self.merger = VisionPatchMerger(config, backend)
        self.deepstack_merger_list = nn.ModuleList(VisionPatchMerger(config, backend, norm_after_merge=True)
                                                   for _ in config.deepstack_visual_indexes)
        with torch.device("cpu"):  # float32 whatever the weights' dtype, as transformers keeps it
            spatial = config.head_dim // 2
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # grid -> (position embeddings, cos, sin) of its patches: images of one size (most of them) share them
        self._grid_tables: OrderedDict[GridTHW, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
        self.output_dtype: torch.dtype | None = None  # `encode`'s, where the tower computes in another (compute_in)

    def _apply(self, fn, recurse=True):
        inv_freq = self.inv_freq  # keep the rotary frequencies float32 through .to(dtype)
        result = super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=torch.float32)
        self._drop_derived()  # made from the weights as they were
        return result

    def load_state_dict(self, *args, **kwargs):
        self._drop_derived()  # made from the weights as they were
        return super().load_state_dict(*args, **kwargs)

    def _drop_derived(self) -> None:
        """Forget what was made from the weights: the grid tables and the packed projections."""
        self._grid_tables.clear()
        for module in self.modules():
            if isinstance(module, (BiasedLinear, VisionPatchEmbed)):
                module.packs.clear()

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def _position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor, grid: GridTHW) -> torch.Tensor:
        """The learned table resampled bilinearly (align_corners) to the image's grid, at each patch."""
        device, side = self.pos_embed.weight.device, self.side
        taps, weights = [], []
        for index, size in ((rows, grid[1]), (cols, grid[2])):
            source = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
            floor = source.floor()
            axis_taps = (floor.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
            taps.append(axis_taps)
            weights.append((1 - (source[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0))
        indices = (taps[0][:, :, None] * side + taps[1][:, None, :]).reshape(-1, 4).to(device)
        tap_weights = (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4).to(device)
        return (self.pos_embed(indices) * tap_weights[:, :, None]).sum(1)

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, head_dim) float32: the first half of each head's pairs turn with the row, the rest with
        the column, as transformers' axial rotary."""
        inv_freq = self.inv_freq
        positions = torch.stack((rows, cols), dim=1).to(device=inv_freq.device, dtype=torch.float32)
        freqs = (positions[..., None] * inv_freq).reshape(positions.shape[0], -1)  # (N, [rows' | cols'])
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos(), freqs.sin()

    def grid_tables(self, grid: GridTHW) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(position embeddings (t*h*w, hidden) in the weights' dtype, cos, sin (t*h*w, head_dim) float32) of the
        patches of an image of `grid`, in pixel_values order; made once per grid size while it is among the
        GRID_TABLES_CACHED most recent."""
        tables = self._grid_tables.get(grid)
        if tables is None:
            rows, cols = merge_block_coordinates(grid, self.config.spatial_merge_size)
            tables = (self._position_embeddings(rows, cols, grid).to(self.dtype), *self._rotary(rows, cols))
            self._grid_tables[grid] = tables
            while len(self._grid_tables) > GRID_TABLES_CACHED:
                self._grid_tables.popitem(last=False)
        self._grid_tables.move_to_end(grid)
        return tables

    def forward(self, pixel_values: torch.Tensor, grids: list[GridTHW]) -> torch.Tensor:
        """pixel_values (sum of t*h*w, patch_dim) for `grids`' images, in order -> (sum of t*h*w / merge^2,
        1 + DeepStack layers, out_hidden): each image's embeddings, in order; [:, 0] the merger's (the decoder's
        input), [:, 1 + i] the i-th DeepStack feature (added after decoder layer i)."""
        tables = [self.grid_tables(grid) for grid in grids]
        position, cos, sin = (torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*tables))
        hidden = self.patch_embed(pixel_values.to(self.pos_embed.weight.device)) + position
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # each frame attends to itself
        deepstack = []
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin, lengths)
            if index in self.config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(hidden))
        return torch.stack([self.merger(hidden), *deepstack], dim=1)

    def compute_in(self, dtype: torch.dtype) -> None:
        """Compute in `dtype` (the weights converted), `encode` still handing out the dtype loaded: where the CPU
        has no bf16 arithmetic a bf16 tower runs in fp32, on oneDNN's packed fp32 linears with the bias and GELU
        fused and on fp32 SDPA (a bf16 operand is widened at every op there anyway)."""
        if self.output_dtype is None:
            self.output_dtype = self.dtype
        self.to(dtype)

    def encode(self, pixel_values: list[torch.Tensor], grids: list[GridTHW]) -> list[torch.Tensor]:
        """Each image's (tokens, 1 + DeepStack layers, out_hidden) embeddings, through the tower in one call."""
        merge = self.config.spatial_merge_size
        embeddings = self(torch.cat(pixel_values), grids)
        if self.output_dtype is not None:
            embeddings = embeddings.to(self.output_dtype)
        return list(embeddings.split([t * h * w // merge ** 2 for t, h, w in grids]))
