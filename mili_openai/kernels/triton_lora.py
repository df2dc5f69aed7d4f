"""Many LoRA adapters over one batch on CUDA, in Triton: Punica's segmented gather-matmul (SGMV) as two launches
per projection, over the step's rows cut into blocks of one slot each (`LoraRows.blocks`, kernels/lora.py).

- `_lora_shrink`: a program per (block, tile of the slot's W rank columns) gathers its rows of x and takes
  `x @ A[slot].T` over the input features, tl.dot in float32, rounded to x's dtype as torch's first matmul is.
- `_lora_expand`: a program per (block, tile of output columns) takes that (rows, W) product times its slot's
  B^T (held transposed, (W, out): kernels/lora.py's `LoraSlotTable`) and adds the delta, rounded to the output's
  dtype, into its rows of `out` (torch's `out += delta` rounding). It reads only the rank rows of the modules its
  columns belong to (B^T is block-diagonal over a fused projection's modules). Blocks hold distinct rows: no two
  programs write one element.
Rows on the base alone are in no block and are not touched. The work is the two small matmuls per row that run an
adapter, whichever adapters the step mixes; blocks of `BLOCK_ROWS` rows keep tl.dot's tiles full for prefill
chunks, and decode rows of one adapter share a block.

`triton_add_lora` is a `LoraFn` (model/kernel_backend.py), None where Triton cannot be imported. Tests run it under
Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors against kernels/lora.py's `add_lora`; there the dots run
in float32 on the same values (the interpreter's bf16 dot is not the GPU's).
"""

from __future__ import annotations

import torch

from mili_openai.kernels.lora import SGMV_BLOCK_ROWS, LoraRows, LoraSlotTable

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: torch's segmented matmul stays
    triton = None

BLOCK_ROWS = SGMV_BLOCK_ROWS  # rows of one slot a program takes
BLOCK_RANK = 16  # rank columns per tile (W = modules x max rank: 8..192)
BLOCK_FEATURES = 64  # input features per reduction step of the shrink
BLOCK_OUT = 64  # output columns a program of the expand writes
MAX_MODULES = 4  # stacked modules the expand tells apart (Gated DeltaNet's in_proj: q/k/v, z, b, a)


if triton is not None:

    @triton.jit
    def _slot_block(order_ptr, first_ptr, count_ptr, slot_ptr, BLOCK_M: tl.constexpr):
        """This program's block of rows, all on one slot: (its first position in `order`, the slot, the block's
        lanes, which of them hold a row, those rows)."""
        block = tl.program_id(0)
        first, count = tl.load(first_ptr + block), tl.load(count_ptr + block)
        slot = tl.load(slot_ptr + block).to(tl.int64)
        m = tl.arange(0, BLOCK_M)
        m_ok = m < count
        rows = tl.load(order_ptr + first + m, mask=m_ok, other=0)  # (BM,)
        return first, slot, m, m_ok, rows

    @triton.jit
    def _module_of(col, bound1, bound2, bound3):
        """Which stacked module an output column belongs to (0-3), from the first columns of modules 1-3."""
        return (col >= bound1).to(tl.int32) + (col >= bound2).to(tl.int32) + (col >= bound3).to(tl.int32)

    # the block count varies from step to step, the slot width from projection to projection (modules x max rank,
    # 8 or 24 as well as 16): one compiled variant for every value, the one the load-time probe builds
    @triton.jit(do_not_specialize=["blocks", "rank"])
    def _lora_shrink(x_ptr, a_ptr, v_ptr, order_ptr, first_ptr, count_ptr, slot_ptr, blocks, in_features, rank,
                     x_stride, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_FP32: tl.constexpr):
        first, slot, m, m_ok, rows = _slot_block(order_ptr, first_ptr, count_ptr, slot_ptr, BLOCK_M)  # rows of x
        ws = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)  # (BW,) rows of A[slot]
        w_ok = ws < rank
        a_rows = a_ptr + slot * rank * in_features + ws[:, None] * in_features  # (BW, 1)
        acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_rows + ks[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_FP32:  # float32 activations, or the interpreter: exact products of the same values
                acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(a))
        positions = first + m  # v is laid out as `order`: a block's rows are its own
        tl.store(v_ptr + positions[:, None] * rank + ws[None, :], acc.to(v_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & w_ok[None, :])

    @triton.jit(do_not_specialize=["blocks", "rank", "module_rank", "bound1", "bound2", "bound3"])
    def _lora_expand(v_ptr, b_ptr, out_ptr, order_ptr, first_ptr, count_ptr, slot_ptr, blocks, rank, out_features,
                     out_stride, module_rank, bound1, bound2, bound3, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
        first, slot, m, m_ok, rows = _slot_block(order_ptr, first_ptr, count_ptr, slot_ptr, BLOCK_M)  # rows of out
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        col_ok = cols < out_features
        b_slot = b_ptr + slot * rank * out_features
        # B^T is block-diagonal: the tile's columns read only the rank rows of the modules they belong to
        first_col = tl.program_id(1) * BLOCK_N
        last_col = tl.minimum(first_col + BLOCK_N, out_features) - 1
        w_start = module_rank * _module_of(first_col, bound1, bound2, bound3)
        w_end = tl.minimum(rank, module_rank * (_module_of(last_col, bound1, bound2, bound3) + 1))
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for w0 in range(w_start, w_end, BLOCK_W):
            ws = w0 + tl.arange(0, BLOCK_W)
            w_ok = ws < w_end
            v = tl.load(v_ptr + (first + m)[:, None] * rank + ws[None, :], mask=m_ok[:, None] & w_ok[None, :],
                        other=0.0)
            b = tl.load(b_slot + ws[:, None] * out_features + cols[None, :], mask=w_ok[:, None] & col_ok[None, :],
                        other=0.0)
            if DOT_FP32:
                acc += tl.dot(v.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(v, b)
        targets = out_ptr + rows[:, None] * out_stride + cols[None, :]
        mask = m_ok[:, None] & col_ok[None, :]
        delta = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as torch's second matmul rounds
        out = tl.load(targets, mask=mask, other=0.0).to(tl.float32)
        tl.store(targets, (out + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _module_bounds(table: LoraSlotTable, rank: int, out_features: int) -> tuple[int, int, int, int]:
    """(each module's rank rows, the first output column of modules 1, 2 and 3; out_features past the last): the
    expand's block-diagonal bounds. More modules than that: one module of every rank row (all of B^T read)."""
    modules = len(table.offsets) - 1
    if modules > MAX_MODULES:
        return rank, out_features, out_features, out_features
    bounds = (*table.offsets[1:-1], *[out_features] * (MAX_MODULES - modules))
    return rank // modules, *bounds


def _triton_add_lora(out: torch.Tensor, x: torch.Tensor, table: LoraSlotTable, step_rows: LoraRows) -> torch.Tensor:
    """out (T, O) += x (T, I) @ A[slot].T @ B^T[slot] for each row's slot, in place (a `LoraFn`)."""
    if step_rows.empty:
        return out
    lora_a, lora_b = table.lora_a, table.lora_b  # (S, W, I), (S, W, O), contiguous buffers
    rank, in_features, out_features = lora_a.shape[1], lora_a.shape[2], lora_b.shape[2]
    if x.stride(-1) != 1:
        x = x.contiguous()
    target = out if out.stride(-1) == 1 else out.contiguous()
    blocks = step_rows.blocks(x.shape[0], BLOCK_ROWS, x.device)
    num_blocks = blocks.slot.shape[0]
    if num_blocks == 0:  # an empty batch
        return out
    dot_fp32 = x.dtype == torch.float32 or x.device.type == "cpu"
    v = torch.empty(blocks.order.shape[0], rank, dtype=x.dtype, device=x.device)  # (N, W): each row's x @ A.T
    _lora_shrink[(num_blocks, triton.cdiv(rank, BLOCK_RANK))](
        x, lora_a, v, blocks.order, blocks.first, blocks.count, blocks.slot, num_blocks, in_features, rank,
        x.stride(0), BLOCK_M=BLOCK_ROWS, BLOCK_W=BLOCK_RANK, BLOCK_K=BLOCK_FEATURES, DOT_FP32=dot_fp32)
    _lora_expand[(num_blocks, triton.cdiv(out_features, BLOCK_OUT))](
        v, lora_b, target, blocks.order, blocks.first, blocks.count, blocks.slot, num_blocks, rank, out_features,
        target.stride(0), *_module_bounds(table, rank, out_features), BLOCK_M=BLOCK_ROWS, BLOCK_W=BLOCK_RANK,
        BLOCK_N=BLOCK_OUT, DOT_FP32=dot_fp32)
    if target is not out:
        out.copy_(target)
    return out


triton_add_lora = _triton_add_lora if triton is not None else None
