"""The Triton gated delta rule and causal conv against the torch reference, and (marked slow: run this file directly)
the hybrid prefix cache's state snapshots in an engine on them.

Not collected by the suite itself (no `test_` prefix): tests/kernels/test_triton_interpreted.py runs this file in a
subprocess with TRITON_INTERPRET=1, where Triton runs the kernels on CPU tensors (the variable must be set before
Triton is imported and stays for the process). On a GPU machine run it directly: the same cases on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from linear_attention_helpers import check_causal_conv, check_delta_rule

pytest.importorskip("triton")

from mili_openai.kernels.linear_attention import LinearAttentionKernel  # noqa: E402
from mili_openai.kernels.triton_gated_delta_rule import TritonLinearAttention  # noqa: E402

KERNEL = TritonLinearAttention()
DEVICE = torch.device("cpu") if __import__("os").environ.get("TRITON_INTERPRET") == "1" else torch.device("cuda")
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton compiles for CUDA here and torch sees no GPU (set TRITON_INTERPRET=1 to run on the CPU)",
                allow_module_level=True)

SEGMENTS = {torch.float32: [1, 5, 64, 65, 130],  # either side of the 64-token chunk, and several chunks
            torch.bfloat16: [5, 70]}  # the roundings only: fewer programs (the interpreter is slow)


def test_triton_kernels_are_a_linear_attention_kernel():
    assert isinstance(KERNEL, LinearAttentionKernel)


# GVA 2 key heads over 4 value heads; Dv 48: a full 32-column block and a masked one; Dk 24: masked lanes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_matches_reference(dtype):
    check_delta_rule(KERNEL, SEGMENTS[dtype], (2, 4), (24, 48), dtype, DEVICE)


@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv_matches_reference(with_bias):
    # 300 channels: a whole 256-channel block and a masked one; segments shorter than the window and longer
    check_causal_conv(KERNEL, [1, 2, 5, 40], 300, torch.float32, DEVICE, with_bias)


@pytest.mark.slow  # ~5 min under the interpreter (2026-11-29: passed in 323 s); run this file directly for it
def test_the_hybrid_prefix_cache_resumes_from_snapshots_on_the_triton_kernels(hybrid_checkpoint):
    """A chat's next turn on the Triton kernels (attention and Gated DeltaNet) resumes from the state snapshot at the
    reply's end and decodes what a cold run of the same turn decodes."""
    from engine_helpers import greedy
    from hybrid_helpers import hybrid_tokens

    from mili_openai import LLM

    def engine(**args) -> LLM:
        llm = LLM(str(hybrid_checkpoint("qwen3_5")), dtype="float32", device=DEVICE.type, attention_backend="triton",
                  page_size=4, num_pages=128, max_num_batched_tokens=24, **args)
        llm.core.runner.forward.model.backend.linear_attention = KERNEL  # on CUDA set at load; here by hand
        return llm

    llm = engine()
    prompt = hybrid_tokens(29, seed=20)
    reply = llm.generate([prompt], greedy(6))[0].outputs[0].token_ids
    turn = prompt + list(reply) + hybrid_tokens(11, seed=21)
    warm = llm.generate([turn], greedy(6))[0]
    cold = engine(enable_prefix_caching=False).generate([turn], greedy(6))[0]
    assert warm.num_cached_tokens >= len(prompt) // 4 * 4 and cold.num_cached_tokens == 0
    assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    llm.core.check_integrity()
