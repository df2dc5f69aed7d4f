"""The hybrid prefix cache in bf16 serving, on the compiled CPU kernels and on torch's ops: a warm request's greedy
tokens are a cold run's (a fresh engine's), after a full prompt, at a branch point and after a chat's reply.

What is bit-exact and what is not (docs/architecture.md, "State snapshots"): a repeated prompt resumes from the
snapshot its first run saved and runs the rest as that run's last chunk ran, so its logprobs are bit-identical.
At a branch point and after a reply the warm run's numbers can differ from a cold run's in the last bits: the
decodes run beside other sequences (batch invariant on the CPU kernels only with AVX512-BF16), and torch's
chunked delta rule splits its 64-token chunks at the resume point; the tokens agree."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from hybrid_helpers import hybrid_tokens

from mili_openai import LLM, SamplingParams
from mili_openai import kernels as kernels_module
from mili_openai.engine import local_forward as local_forward_module
from mili_openai.kernels import cpu_supports_kernels

PAGE = 16  # the CPU's default page size
MAX_NEW = 12
SHARED = hybrid_tokens(64, seed=7)  # a branch point on a chunk boundary of the chunked delta rule
TAILS = [hybrid_tokens(21, seed=8), hybrid_tokens(27, seed=9)]
PROMPT = hybrid_tokens(53, seed=20)
TURN_MESSAGES = [hybrid_tokens(45, seed=21), hybrid_tokens(11, seed=22)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)


@pytest.fixture(params=["cpu_kernels", "torch_ops"])
def make_llm(request, monkeypatch, hybrid_checkpoint):
    """A function building a fresh bf16 engine on the tiny Qwen3.5, on the CPU kernels or on torch's ops (kernels
    that look unbuilt, with a build that never ends: the runner serves on torch's ops meanwhile)."""
    torch_ops = request.param == "torch_ops"
    if not torch_ops and not cpu_supports_kernels():
        pytest.skip("the CPU kernels need AVX512")
    if torch_ops:
        monkeypatch.setattr(kernels_module, "cpu_kernels_built", lambda: False)
        monkeypatch.setattr(local_forward_module, "build_cpu_kernels_in_background", Future)
    checkpoint = str(hybrid_checkpoint("qwen3_5"))

    def make() -> LLM:
        return LLM(checkpoint, dtype="bfloat16", page_size=PAGE, num_pages=128, max_num_batched_tokens=128,
                   cpu_kernels_in_background=torch_ops)

    return make


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float], int]]:
    """(greedy tokens, their logprobs, cached prompt tokens) per prompt."""
    return [(o.outputs[0].token_ids, [entry.logprob for entry in o.outputs[0].logprobs], o.num_cached_tokens)
            for o in llm.generate(prompts, GREEDY)]


def test_a_repeated_prompt_is_bit_exact(make_llm):
    llm = make_llm()
    cold, warm = outputs(llm, [PROMPT])[0], outputs(llm, [PROMPT])[0]
    assert warm[2] == (len(PROMPT) - 1) // PAGE * PAGE
    assert warm[:2] == cold[:2]  # tokens and logprobs, to the last bit


def test_a_branch_point_gives_the_cold_tokens(make_llm):
    warm = outputs(make_llm(), [SHARED + tail for tail in TAILS])[1]
    cold = outputs(make_llm(), [SHARED + TAILS[1]])[0]
    assert (warm[2], cold[2]) == (len(SHARED), 0)
    assert warm[0] == cold[0]


def test_a_chats_next_turn_gives_the_cold_tokens(make_llm):
    llm = make_llm()
    first = TURN_MESSAGES[0]
    reply = outputs(llm, [first])[0][0]
    turn = first + reply + TURN_MESSAGES[1]
    warm = outputs(llm, [turn])[0]
    cold = outputs(make_llm(), [turn])[0]
    assert warm[2] == (len(first) + MAX_NEW - 1) // PAGE * PAGE  # resumed after the reply
    assert warm[0] == cold[0]
