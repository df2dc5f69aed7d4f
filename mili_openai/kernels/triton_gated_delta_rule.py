"""Gated DeltaNet's ops for CUDA in Triton, varlen over state pools: a `LinearAttentionKernel`.

- decode: one program per (row, value head, block of Dv columns) reads its (Dk, BLOCK_V) slice of the fp32 state
  once, applies decay, delta and readout in registers, and writes it back; slots are read in the kernel, so a
  CUDA graph captured for a batch size serves any slots;
- prefill: the chunked WY form (kernels/gated_delta_rule.py's `chunked_delta_rule`), one program per (segment,
  value head, Dv block) walking its segment in chunks of CHUNK_SIZE tokens: the chunk's unit lower-triangular
  system is inverted by forward substitution in registers, then a few tl.dot's update the state: IEEE fp32
  products for a float32 model (the parity tests' precision), TF32 tensor cores otherwise, as flash-linear-attention's
  kernels (vLLM's) take them (for Hopper, ptxas builds the IEEE form in ~35 s on an H200's host, the TF32 one in
  a few: 69 s and 9 s on a 2-core Zen 3);
- the causal conv: decode shifts each row's window in place; prefill convolves each token from the segment's
  inputs and the window before it, then a second launch leaves the last K-1 inputs in the window.

Outside CUDA it runs only under Triton's CPU interpreter (TRITON_INTERPRET=1, set before Triton is imported), which
is how the tests check it. Semantics and shapes: kernels/gated_delta_rule.py; where Triton cannot be imported,
`TritonLinearAttention` is None.
"""

from __future__ import annotations

import torch

from mili_openai.kernels import gated_delta_rule as reference
from mili_openai.kernels.linear_attention import no_fused_decode

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch reference stays
    triton = None

CHUNK_SIZE = 64  # tokens per chunk of the prefill's WY form, as the reference
BLOCK_V = 32  # state columns per program: a (Dk <= 256, 32) fp32 slice fits a program's registers
CONV_BLOCK_C = 256  # conv channels per program
CONV_BLOCK_T = 16  # conv prefill tokens per program
MAX_HEAD_DIM = 256
# the arguments whose alignment changes between a server's launches: the state slots are a slice of the step's
# staged index buffer (engine/step_inputs.py), at an offset that follows the step's token count; unspecialised, a
# server meets only the variants the load-time warm-up compiled (model/kernel_warmup.py)
RUNTIME_ARGS = ("slots", "cu_seqlens")


if triton is not None:
    L2NORM_EPS = tl.constexpr(reference.L2NORM_EPS)  # a kernel reads only constexpr globals

    @triton.jit
    def _normalized(ptr, offsets, mask, scale):
        x = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        return x * (scale / tl.sqrt(tl.sum(x * x, axis=0) + L2NORM_EPS))

    @triton.jit(do_not_specialize=["slots"])
    def delta_rule_decode_kernel(q, k, v, g, beta, state_pool, slots, out, stride_qt, stride_qh, stride_vt,
                                 stride_vh, stride_gt, num_v_heads, group, scale, DK: tl.constexpr,
                                 DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        row, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        k_offsets, v_offsets = tl.arange(0, BLOCK_K), block * BLOCK_V + tl.arange(0, BLOCK_V)
        k_mask, v_mask = k_offsets < DK, v_offsets < DV
        key_head = head // group
        q_row = _normalized(q + row * stride_qt + key_head * stride_qh, k_offsets, k_mask, scale)
        k_row = _normalized(k + row * stride_qt + key_head * stride_qh, k_offsets, k_mask, 1.0)
        v_row = tl.load(v + row * stride_vt + head * stride_vh + v_offsets, mask=v_mask, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g + row * stride_gt + head).to(tl.float32))
        write = tl.load(beta + row * stride_gt + head).to(tl.float32)
        slot = tl.load(slots + row).to(tl.int64)
        state_ptrs = (state_pool + (slot * num_v_heads + head) * DK * DV + k_offsets[:, None] * DV
                      + v_offsets[None, :])
        state_mask = k_mask[:, None] & v_mask[None, :]
        state = tl.load(state_ptrs, mask=state_mask, other=0.0) * decay  # (BLOCK_K, BLOCK_V)
        delta = (v_row - tl.sum(state * k_row[:, None], axis=0)) * write
        state += k_row[:, None] * delta[None, :]
        tl.store(state_ptrs, state, mask=state_mask)
        readout = tl.sum(state * q_row[:, None], axis=0)
        tl.store(out + (row * num_v_heads + head) * DV + v_offsets, readout.to(out.dtype.element_ty), mask=v_mask)

    @triton.jit
    def _lower_inverse(lower, CHUNK: tl.constexpr):
        """(I + strict_lower(lower))^-1 by forward substitution: row i = e_i - sum_{j<i} lower[i, j] row j."""
        rows = tl.arange(0, CHUNK)
        inverse = (rows[:, None] == rows[None, :]).to(tl.float32)
        strict = tl.where(rows[:, None] > rows[None, :], lower, 0.0)
        for i in range(1, CHUNK):
            coefficients = tl.sum(tl.where(rows[:, None] == i, strict, 0.0), axis=0)  # lower[i, :i], zero beyond
            row = tl.where(rows == i, 1.0, 0.0) - tl.sum(coefficients[:, None] * inverse, axis=0)
            inverse = tl.where(rows[:, None] == i, row[None, :], inverse)
        return inverse

    @triton.jit(do_not_specialize=RUNTIME_ARGS)
    def delta_rule_prefill_kernel(q, k, v, g, beta, cu_seqlens, state_pool, slots, out, stride_qt, stride_qh,
                                  stride_vt, stride_vh, stride_gt, num_v_heads, group, scale, DK: tl.constexpr,
                                  DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                                  CHUNK: tl.constexpr, PRECISION: tl.constexpr):
        segment, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, end = tl.load(cu_seqlens + segment), tl.load(cu_seqlens + segment + 1)
        key_head = head // group
        k_offsets, v_offsets, rows = tl.arange(0, BLOCK_K), block * BLOCK_V + tl.arange(0, BLOCK_V), tl.arange(0, CHUNK)
        k_mask, v_mask = k_offsets < DK, v_offsets < DV
        slot = tl.load(slots + segment).to(tl.int64)
        state_ptrs = (state_pool + (slot * num_v_heads + head) * DK * DV + k_offsets[:, None] * DV
                      + v_offsets[None, :])
        state_mask = k_mask[:, None] & v_mask[None, :]
        state = tl.load(state_ptrs, mask=state_mask, other=0.0)  # (BLOCK_K, BLOCK_V) fp32
        causal = rows[:, None] >= rows[None, :]
        for chunk_start in range(start, end, CHUNK):
            tokens = chunk_start + rows
            valid = tokens < end  # zero padding past the end: beta = 0 writes nothing, g = 0 decays nothing
            qk_offsets = tokens[:, None] * stride_qt + key_head * stride_qh + k_offsets[None, :]
            qk_mask = valid[:, None] & k_mask[None, :]
            q_chunk = tl.load(q + qk_offsets, mask=qk_mask, other=0.0).to(tl.float32)
            k_chunk = tl.load(k + qk_offsets, mask=qk_mask, other=0.0).to(tl.float32)
            q_chunk = q_chunk * (scale / tl.sqrt(tl.sum(q_chunk * q_chunk, axis=1) + L2NORM_EPS))[:, None]
            k_chunk = k_chunk * (1.0 / tl.sqrt(tl.sum(k_chunk * k_chunk, axis=1) + L2NORM_EPS))[:, None]
            v_chunk = tl.load(v + tokens[:, None] * stride_vt + head * stride_vh + v_offsets[None, :],
                              mask=valid[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
            log_decay = tl.load(g + tokens * stride_gt + head, mask=valid, other=0.0).to(tl.float32)
            write = tl.load(beta + tokens * stride_gt + head, mask=valid, other=0.0).to(tl.float32)
            cum_decay = tl.cumsum(log_decay, axis=0)  # (CHUNK,) log decay from the chunk start
            last_decay = tl.sum(tl.where(rows == CHUNK - 1, cum_decay, 0.0), axis=0)
            pair_decay = tl.exp(tl.where(causal, cum_decay[:, None] - cum_decay[None, :], float("-inf")))
            key_products = tl.dot(k_chunk, tl.trans(k_chunk), input_precision=PRECISION)  # (CHUNK, CHUNK)
            inverse = _lower_inverse(key_products * write[:, None] * pair_decay, CHUNK)
            new_values = tl.dot(inverse, v_chunk * write[:, None], input_precision=PRECISION)
            decayed_keys = tl.dot(inverse, k_chunk * (write * tl.exp(cum_decay))[:, None],
                                  input_precision=PRECISION)
            v_new = new_values - tl.dot(decayed_keys, state, input_precision=PRECISION)  # (CHUNK, BLOCK_V)
            intra = tl.dot(q_chunk, tl.trans(k_chunk), input_precision=PRECISION) * pair_decay
            readout = (tl.dot(q_chunk * tl.exp(cum_decay)[:, None], state, input_precision=PRECISION)
                       + tl.dot(intra, v_new, input_precision=PRECISION))
            tl.store(out + (tokens[:, None] * num_v_heads + head) * DV + v_offsets[None, :],
                     readout.to(out.dtype.element_ty), mask=valid[:, None] & v_mask[None, :])
            carried_keys = k_chunk * tl.exp(last_decay - cum_decay)[:, None]
            state = state * tl.exp(last_decay) + tl.dot(tl.trans(carried_keys), v_new, input_precision=PRECISION)
        tl.store(state_ptrs, state, mask=state_mask)

    @triton.jit(do_not_specialize=["slots"])
    def conv_decode_kernel(x, conv_pool, weight, bias, slots, out, stride_x, channels, HAS_BIAS: tl.constexpr,
                           WIDTH: tl.constexpr, BLOCK_C: tl.constexpr):
        row, block = tl.program_id(0), tl.program_id(1)
        c = block * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = c < channels
        window = conv_pool + tl.load(slots + row).to(tl.int64) * channels * (WIDTH - 1) + c * (WIDTH - 1)
        newest = tl.load(x + row * stride_x + c, mask=mask, other=0.0)
        acc = tl.load(weight + c * WIDTH + WIDTH - 1, mask=mask, other=0.0).to(tl.float32) * newest.to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(WIDTH - 1):
            tap = tl.load(window + j, mask=mask, other=0.0)
            acc += tl.load(weight + c * WIDTH + j, mask=mask, other=0.0).to(tl.float32) * tap.to(tl.float32)
            if j > 0:
                tl.store(window + j - 1, tap, mask=mask)
        tl.store(window + WIDTH - 2, newest.to(conv_pool.dtype.element_ty), mask=mask)
        tl.store(out + row * channels + c, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=RUNTIME_ARGS)
    def conv_prefill_kernel(x, cu_seqlens, conv_pool, weight, bias, slots, out, stride_x, channels,
                            HAS_BIAS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_C: tl.constexpr):
        segment, token_block, channel_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, end = tl.load(cu_seqlens + segment), tl.load(cu_seqlens + segment + 1)
        t = token_block * BLOCK_T + tl.arange(0, BLOCK_T)  # positions within the segment
        c = channel_block * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < channels
        window = conv_pool + tl.load(slots + segment).to(tl.int64) * channels * (WIDTH - 1) + c * (WIDTH - 1)
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(WIDTH):
            source = t + j - (WIDTH - 1)  # the input this tap reads: before the segment, from the window
            from_x = tl.load(x + (start + source)[:, None] * stride_x + c[None, :],
                             mask=(source >= 0)[:, None] & (source < end - start)[:, None] & c_mask[None, :],
                             other=0.0)
            from_window = tl.load(window[None, :] + (source + WIDTH - 1)[:, None],
                                  mask=(source < 0)[:, None] & c_mask[None, :], other=0.0)
            tap = tl.load(weight + c * WIDTH + j, mask=c_mask, other=0.0).to(tl.float32)
            acc += tap[None, :] * (from_x.to(tl.float32) + from_window.to(tl.float32))
        tl.store(out + (start + t)[:, None] * channels + c[None, :], (acc * tl.sigmoid(acc)).to(out.dtype.element_ty),
                 mask=(t < end - start)[:, None] & c_mask[None, :])

    @triton.jit(do_not_specialize=RUNTIME_ARGS)
    def conv_window_kernel(x, cu_seqlens, conv_pool, slots, stride_x, channels, WIDTH: tl.constexpr,
                           BLOCK_C: tl.constexpr):
        """After conv_prefill_kernel: the window keeps the last K-1 of (old window, segment inputs)."""
        segment, block = tl.program_id(0), tl.program_id(1)
        length = tl.load(cu_seqlens + segment + 1) - tl.load(cu_seqlens + segment)
        start = tl.load(cu_seqlens + segment)
        c = block * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = c < channels
        window = conv_pool + tl.load(slots + segment).to(tl.int64) * channels * (WIDTH - 1) + c * (WIDTH - 1)
        # in place, oldest first: entry j is read from j + length > every entry already written
        for j in tl.static_range(WIDTH - 1):
            back = WIDTH - 1 - j  # counted back from the segment's end
            in_segment = tl.full((BLOCK_C,), back, tl.int64) <= length
            from_x = tl.load(x + (start + length - back) * stride_x + c, mask=mask & in_segment, other=0.0)
            from_window = tl.load(window + j + length, mask=mask & ~in_segment, other=0.0)
            tl.store(window + j, tl.where(in_segment, from_x.to(conv_pool.dtype.element_ty), from_window), mask=mask)


def _ready(*tensors: torch.Tensor) -> bool:
    return all(x.stride(-1) == 1 for x in tensors)


class _TritonLinearAttention:
    """The four linear-attention ops as Triton launches (CUDA tensors, or CPU ones under the interpreter)."""

    deltanet_decode = staticmethod(no_fused_decode)  # no fused layer step: the layer launches the four

    @staticmethod
    def _delta_rule_launch(q, k, v, g, beta, state_pool):
        reference.check_heads(q, k, v, state_pool)
        if not state_pool.is_contiguous() or max(k.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
            return None
        if q.stride() != k.stride() or not _ready(q, v):  # one set of strides for q and k
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        num_v_heads, k_dim, v_dim = v.shape[1], k.shape[-1], v.shape[-1]
        block_v = max(16, min(BLOCK_V, triton.next_power_of_2(v_dim)))
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        arguments = (q, k, v, g.float().contiguous(), beta.float().contiguous())
        strides = (q.stride(0), q.stride(1), v.stride(0), v.stride(1), num_v_heads)
        shape = dict(DK=k_dim, DV=v_dim, BLOCK_K=max(16, triton.next_power_of_2(k_dim)), BLOCK_V=block_v)
        return arguments, out, strides, shape, (num_v_heads, triton.cdiv(v_dim, block_v))

    def gated_delta_rule_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, state_pool: torch.Tensor,
                                state_slots: torch.Tensor) -> torch.Tensor:
        launch = self._delta_rule_launch(q, k, v, g, beta, state_pool)
        if launch is None:
            return reference.gated_delta_rule_decode(q, k, v, g, beta, state_pool, state_slots)
        (q, k, v, g, beta), out, (stride_qt, stride_qh, stride_vt, stride_vh, heads), shape, grid = launch
        delta_rule_decode_kernel[(v.shape[0], *grid)](
            q, k, v, g, beta, state_pool, state_slots, out, stride_qt, stride_qh, stride_vt, stride_vh, g.stride(0),
            heads, heads // k.shape[1], k.shape[-1] ** -0.5, **shape)
        return out

    def gated_delta_rule_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                                 state_slots: torch.Tensor) -> torch.Tensor:
        launch = self._delta_rule_launch(q, k, v, g, beta, state_pool)
        if launch is None:
            return reference.gated_delta_rule_prefill(q, k, v, g, beta, cu_seqlens, state_pool, state_slots)
        (q, k, v, g, beta), out, (stride_qt, stride_qh, stride_vt, stride_vh, heads), shape, grid = launch
        delta_rule_prefill_kernel[(state_slots.shape[0], *grid)](
            q, k, v, g, beta, cu_seqlens, state_pool, state_slots, out, stride_qt, stride_qh, stride_vt, stride_vh,
            g.stride(0), heads, heads // k.shape[1], k.shape[-1] ** -0.5, CHUNK=CHUNK_SIZE,
            PRECISION="ieee" if v.dtype == torch.float32 else "tf32", **shape)
        return out

    def causal_conv1d_decode(self, x: torch.Tensor, conv_pool: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        if not (_ready(x) and conv_pool.is_contiguous()):
            return reference.causal_conv1d_decode(x, conv_pool, weight, bias, slots)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        channels = x.shape[1]
        conv_decode_kernel[(x.shape[0], triton.cdiv(channels, CONV_BLOCK_C))](
            x, conv_pool, weight.contiguous(), weight if bias is None else bias, slots, out, x.stride(0), channels,
            HAS_BIAS=bias is not None, WIDTH=weight.shape[1], BLOCK_C=CONV_BLOCK_C)
        return out

    def causal_conv1d_prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, conv_pool: torch.Tensor,
                              weight: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor,
                              longest: int | None = None) -> torch.Tensor:
        if not (_ready(x) and conv_pool.is_contiguous()):
            return reference.causal_conv1d_prefill(x, cu_seqlens, conv_pool, weight, bias, slots)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        channels, segments = x.shape[1], slots.shape[0]
        if longest is None:  # a device sync: the engine's steps pass it (StateRows.longest_prefill)
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if segments else 0
        channel_blocks = triton.cdiv(channels, CONV_BLOCK_C)
        weight = weight.contiguous()
        if longest:
            conv_prefill_kernel[(segments, triton.cdiv(longest, CONV_BLOCK_T), channel_blocks)](
                x, cu_seqlens, conv_pool, weight, weight if bias is None else bias, slots, out, x.stride(0), channels,
                HAS_BIAS=bias is not None, WIDTH=weight.shape[1], BLOCK_T=CONV_BLOCK_T, BLOCK_C=CONV_BLOCK_C)
            conv_window_kernel[(segments, channel_blocks)](x, cu_seqlens, conv_pool, slots, x.stride(0), channels,
                                                           WIDTH=weight.shape[1], BLOCK_C=CONV_BLOCK_C)
        return out


TritonLinearAttention = _TritonLinearAttention if triton is not None else None
