"""Triton kernels for paged attention: decode (split-K over the context, then a reduce) and varlen
extend (every prefill chunk of a step in one launch). Launchers and shape rules: triton_attention.py.

Shared conventions:
- K/V are read in place from a pool (slots, kv_heads, head_dim) through a page table: position p of a
  sequence lives at slot `table[p // page_size] * page_size + p % page_size` (a slot table is a page table
  with page_size 1).
- Softmax runs online in float32, in base 2: scores are scaled by `scale * log2(e)` (inside each exponent,
  and in the running max), so every exponential is an exp2, and a split's log-sum-exp is in base 2 too.
- Launch-varying arguments are not specialised (`RUNTIME_ARGS`): Triton compiles a variant of a kernel for
  each pattern of integer values (equal to 1, divisible by 16, other) and pointer alignment (16 bytes) it
  meets, and a page table's width, or an index tensor's offset in the step's one staged buffer, changes
  from step to step; each new pattern would compile under load. Those index tensors are only gathered
  from, so an unknown alignment costs nothing; q, K/V, the output and their strides stay specialised
  (16-byte vector loads). The page size is left unspecialised too, so that one warm-up at load serves any
  (model/kernel_warmup.py).
- GQA: a program owns one KV head and every query head of its group, so each K/V row is read once for
  the whole group; the group's heads (padded to a power of two) are rows of the score matrix.
- WIDEN multiplies half-precision tiles as float32 (after the same rounding). Only for Triton's CPU
  interpreter (TRITON_INTERPRET=1, set for the whole process before Triton is imported), whose tl.dot
  gives wrong products for bfloat16 tiles; on the GPU it is off.
"""

from __future__ import annotations

import triton
import triton.language as tl

# per kernel: the arguments whose value or alignment changes between launches of one server (see above)
DECODE_RUNTIME_ARGS = ("page_table", "ctx_lens", "page_size", "stride_table_row")
REDUCE_RUNTIME_ARGS = ("ctx_lens",)
EXTEND_RUNTIME_ARGS = ("page_table", "cu_seqlens", "ctx_lens", "page_size", "stride_table_row")


@triton.jit
def _scores(q_block, k, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """q_block (M, D) against k (N, D) -> unscaled scores (M, N) in float32."""
    if WIDEN:
        k = k.to(tl.float32)
    return tl.dot(q_block, tl.trans(k), input_precision=PRECISION)


@triton.jit
def _softmax_step(scores, v, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """One block of unscaled scores (M, N) and its values v (N, D) into the running softmax of M rows (its
    max m_i in scaled units) -> the new (row max, row sum, unnormalised output). A row must have seen a key
    by now (finite max). The scale is applied to the row max once and inside each exponent, where it fuses
    with the subtraction (one FMA an element, as FlashAttention-2 does)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores * scale_log2 - m_new[:, None])
    weights = p.to(v.dtype)  # rounded as the half-precision product on the GPU takes it
    if WIDEN:
        weights, v = weights.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(weights, v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_block(q_block, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """One block of keys, of which each row sees `visible` (M or 1, N), into the running softmax."""
    scores = tl.where(visible, _scores(q_block, k, PRECISION, WIDEN), float("-inf"))
    return _softmax_step(scores, v, m_i, l_i, acc, scale_log2, PRECISION, WIDEN)


@triton.jit
def _load_keys(k_pool, v_pool, table_row, pos, pos_ok, page_size, kv_head, stride_k_slot, stride_k_head,
               stride_v_slot, stride_v_head, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               WHOLE: tl.constexpr):
    """The K and V rows (N, BLOCK_D) of context positions `pos` (N,), through the page table. WHOLE: every
    position is in the context (pos_ok unused), so only a padded head_dim needs a mask."""
    if WHOLE:
        page = tl.load(table_row + pos // page_size)
    else:
        page = tl.load(table_row + pos // page_size, mask=pos_ok, other=0)
    slot = page * page_size + pos % page_size
    k_ptrs = k_pool + slot[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :]
    v_ptrs = v_pool + slot[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :]
    if WHOLE and HEAD_DIM == BLOCK_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        mask = offs_d[None, :] < HEAD_DIM
        if not WHOLE:
            mask = mask & pos_ok[:, None]
        k = tl.load(k_ptrs, mask=mask, other=0.0)
        v = tl.load(v_ptrs, mask=mask, other=0.0)
    return k, v


@triton.jit(do_not_specialize=DECODE_RUNTIME_ARGS)
def decode_partial_kernel(
    q, k_pool, v_pool, page_table, ctx_lens, out, part_acc, part_lse,
    scale_log2, page_size, num_heads,
    stride_q_row, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_table_row, stride_out_row, stride_out_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Grid (rows, kv_heads, NUM_SPLITS): one query row's group of heads over one split of its context.

    The context [0, ctx) is cut into NUM_SPLITS pieces of equal length rounded up to BLOCK_N; trailing
    splits may be empty and write nothing (the reduce recomputes which ones hold work). With one split
    the normalised output goes straight to `out`; otherwise each split writes its normalised partial
    (rows, heads, splits, head_dim) and its base-2 log-sum-exp (rows, heads, splits).
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_lens + row).to(tl.int32)  # positions in 32 bits: their division by the page size is cheaper
    split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    head_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_mask = head_ok[:, None] & d_ok[None, :]
    q_block = tl.load(q + row * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :], mask=q_mask,
                      other=0.0)  # (BLOCK_H, BLOCK_D)
    if WIDEN:
        q_block = q_block.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = page_table + row * stride_table_row
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        k, v = _load_keys(k_pool, v_pool, table_row, pos, pos_ok, page_size, kv_head, stride_k_slot, stride_k_head,
                          stride_v_slot, stride_v_head, offs_d, HEAD_DIM, BLOCK_D, False)  # (BLOCK_N, BLOCK_D)
        m_i, l_i, acc = _attend_block(q_block, k, v, pos_ok[None, :], m_i, l_i, acc, scale_log2, PRECISION, WIDEN)

    if NUM_SPLITS == 1:
        out_ptrs = out + row * stride_out_row + heads[:, None] * stride_out_head + offs_d[None, :]
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=q_mask)
    elif end > start:
        index = (row * num_heads + heads) * NUM_SPLITS + split  # (BLOCK_H,)
        tl.store(part_acc + index[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=q_mask)
        tl.store(part_lse + index, m_i + tl.log2(l_i), mask=head_ok)


@triton.jit(do_not_specialize=REDUCE_RUNTIME_ARGS)
def decode_reduce_kernel(
    part_acc, part_lse, ctx_lens, out, num_heads, stride_out_row, stride_out_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Grid (rows, heads): merge a row's split partials, each weighted by its share of the softmax mass."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_lens + row).to(tl.int32)  # as decode_partial_kernel reads it
    split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    used = tl.cdiv(ctx, split_len)  # the splits that held work (as decode_partial_kernel cut them)
    offs_s = tl.arange(0, NUM_SPLITS)
    s_ok = offs_s < used
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    base = (row * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse + base + offs_s, mask=s_ok, other=float("-inf"))  # (NUM_SPLITS,)
    weight = tl.exp2(lse - tl.max(lse, 0))
    partial = tl.load(part_acc + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (NUM_SPLITS, BLOCK_D)
    merged = tl.sum(weight[:, None] * partial, 0) / tl.sum(weight, 0)
    tl.store(out + row * stride_out_row + head * stride_out_head + offs_d, merged.to(out.dtype.element_ty),
             mask=d_ok)


@triton.jit(do_not_specialize=EXTEND_RUNTIME_ARGS)
def extend_kernel(
    q, k_pool, v_pool, out, page_table, cu_seqlens, ctx_lens,
    scale_log2, page_size,
    stride_q_row, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_table_row, stride_out_row, stride_out_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    WIDEN: tl.constexpr, LONGEST_FIRST: tl.constexpr,
):
    """Grid (segments, kv_heads, token blocks of the longest segment): BLOCK_T new tokens of one segment
    times the GROUP query heads of one KV head (BLOCK_M = BLOCK_T * GROUP_PAD score rows), causally over
    the segment's whole context: its cached prefix and its own new tokens, all already in the pool.

    Segment s owns query rows [cu_seqlens[s], cu_seqlens[s + 1]) and a context of ctx_lens[s] positions
    whose last rows are those new tokens, so new token i sits at position ctx - length + i.

    The key loop runs in two parts, as FlashAttention-2 does: the whole BLOCK_N blocks before the block's
    first query position, which every row sees (no mask, no bounds), then the blocks up to its last query
    position, masked causally. LONGEST_FIRST: the GPU starts programs in grid order, so the last token
    blocks (the longest loops) take the first grid indices and the short ones fill in behind them.
    """
    segment = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.program_id(2)
    if LONGEST_FIRST:
        block = tl.num_programs(2) - 1 - block
    q_start = tl.load(cu_seqlens + segment)
    # positions in 32 bits: their division by the page size is cheaper (rows stay 64-bit: row * stride)
    length = (tl.load(cu_seqlens + segment + 1) - q_start).to(tl.int32)
    ctx = tl.load(ctx_lens + segment).to(tl.int32)
    prefix = ctx - length

    offs_m = tl.arange(0, BLOCK_M)
    token = block * BLOCK_T + offs_m // GROUP_PAD  # (BLOCK_M,) index of the row's token in the segment
    group_index = offs_m % GROUP_PAD
    row_ok = (token < length) & (group_index < GROUP)
    heads = kv_head * GROUP + group_index
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q_rows = q_start + token
    q_block = tl.load(q + q_rows[:, None] * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :],
                      mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    if WIDEN:
        q_block = q_block.to(tl.float32)
    q_pos = prefix + token  # (BLOCK_M,)
    # the keys this block's first token sees, in whole blocks, and those its last token sees; none for a
    # block past the segment's end
    has_tokens = block * BLOCK_T < length
    unmasked_end = tl.where(has_tokens, (prefix + block * BLOCK_T) // BLOCK_N * BLOCK_N, 0)
    kv_end = tl.where(has_tokens, tl.minimum(ctx, prefix + (block + 1) * BLOCK_T), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = page_table + segment * stride_table_row
    for block_start in range(0, unmasked_end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        k, v = _load_keys(k_pool, v_pool, table_row, pos, pos, page_size, kv_head, stride_k_slot, stride_k_head,
                          stride_v_slot, stride_v_head, offs_d, HEAD_DIM, BLOCK_D, True)  # (BLOCK_N, BLOCK_D)
        scores = _scores(q_block, k, PRECISION, WIDEN)
        m_i, l_i, acc = _softmax_step(scores, v, m_i, l_i, acc, scale_log2, PRECISION, WIDEN)
    for block_start in range(unmasked_end, kv_end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        k, v = _load_keys(k_pool, v_pool, table_row, pos, pos_ok, page_size, kv_head, stride_k_slot, stride_k_head,
                          stride_v_slot, stride_v_head, offs_d, HEAD_DIM, BLOCK_D, False)
        # causal: a row sees the keys up to its own position (every row sees the first position of the first
        # of these blocks, which is at or before the block's first query position). No bounds term: a real
        # row's position is before kv_end; rows past the segment's end see the zeros loaded there, unstored.
        visible = pos[None, :] <= q_pos[:, None]
        m_i, l_i, acc = _attend_block(q_block, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION, WIDEN)

    out_ptrs = out + q_rows[:, None] * stride_out_row + heads[:, None] * stride_out_head + offs_d[None, :]
    tl.store(out_ptrs, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=q_mask)
