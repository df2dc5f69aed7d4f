"""The Triton fused-MoE kernel (kernels/triton_moe.py) run by Triton's interpreter on CPU tensors, against
the grouped torch path (model/moe.py) it replaces on CUDA; and the sorted, block-padded pair layout it
reads. Small shapes: the interpreter runs each program in numpy.

Triton decides between compiling and interpreting when it is imported (its own library functions too), so
the kernel runs in a process started with TRITON_INTERPRET=1, and only there."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from mili_openai.model.moe import Router, grouped_swiglu

pytest.importorskip("triton")


def _fused_experts(*args):
    from mili_openai.kernels.triton_moe import TritonMoe

    return TritonMoe.fused_experts(*args)


def _align_to_blocks(*args):
    from mili_openai.kernels.triton_moe import align_to_blocks

    return align_to_blocks(*args)


def routed(tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, intermediate, generator=generator) / intermediate ** 0.5
    router = Router(hidden, num_experts, top_k, normalize=True)
    router.weight.data = torch.randn(num_experts, hidden, generator=generator)
    with torch.inference_mode():
        weights, ids = router(x)
    return x, gate_up, down, ids, weights


def reference(x, gate_up, down, ids, weights):
    intermediate = down.shape[2]

    def swiglu(gate_up_rows):
        gate, up = gate_up_rows.split(intermediate, dim=-1)
        return F.silu(gate) * up

    return grouped_swiglu(x, gate_up, down, ids, weights, F.linear, swiglu)


@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "hidden", "intermediate"), [
    (1, 8, 2, 64, 32),  # a decode row: most experts idle, one block each for two
    (5, 4, 2, 32, 16),  # K and N below one block
    (70, 4, 3, 48, 40),  # prefill-sized: the larger block rows, N and K not multiples of the blocks
])
def test_fused_experts_match_the_grouped_torch_path(interpreter, tokens, num_experts, top_k, hidden, intermediate):
    x, gate_up, down, ids, weights = routed(tokens, num_experts, top_k, hidden, intermediate, seed=tokens)
    got = interpreter.submit(_fused_experts, x, gate_up, down, ids, weights).result()
    torch.testing.assert_close(got, reference(x, gate_up, down, ids, weights), rtol=0, atol=2e-6)


@pytest.mark.parametrize("block_m", [16, 64])
def test_pairs_are_grouped_by_expert_in_whole_blocks(interpreter, block_m):
    num_experts, top_k, tokens = 5, 2, 23
    ids = torch.stack([torch.randperm(num_experts, generator=torch.Generator().manual_seed(t))[:top_k]
                       for t in range(tokens)])
    sorted_pairs, block_experts, padded_length = interpreter.submit(_align_to_blocks, ids, num_experts,
                                                                   block_m).result()
    num_pairs, padded = tokens * top_k, int(padded_length)
    assert padded % block_m == 0 and sorted_pairs.numel() % block_m == 0 and padded <= sorted_pairs.numel()
    used = sorted_pairs[:padded]
    real = used[used < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (sorted_pairs[padded:] == num_pairs).all()  # the rest is padding
    flat = ids.reshape(-1)
    for block in range(padded // block_m):
        rows = used[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_pairs]
        assert (flat[rows] == block_experts[block]).all()  # one expert per block
        assert rows.tolist() == sorted(rows.tolist())  # token order within an expert
