"""The engine against HF transformers on the same random checkpoints: greedy tokens identical and
log-probabilities close, through batching, chunked prefill, prefix reuse, n>1 and preemption."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_matches, greedy, hf_greedy, load_hf, random_prompts
from mili_openai import LLM, SamplingParams
from mili_openai.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from mili_openai.engine.contract import check_request
from mili_openai.model.checkpoint import ModelShape, build_random_checkpoint

PROMPT_LENGTHS = [1, 2, 7, 16, 17, 33, 64, 100, 150, 211, 256, 300]
MAX_NEW = 8


@pytest.fixture(scope="module", params=["tiny_checkpoint", "tiny_checkpoint_mha_untied"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    model = load_hf(checkpoint)
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=1)
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return prompts, expected


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(page_size=16, max_num_batched_tokens=4096),  # whole prompts in one step, all batched
        dict(page_size=4, max_num_batched_tokens=48),  # chunked prefill mixed with decodes
        dict(page_size=16, max_num_batched_tokens=100, enable_prefix_caching=False),
    ],
    ids=["batched", "chunked", "no-prefix-cache"],
)
def test_greedy_matches_transformers(checkpoint, oracle, engine_args):
    prompts, expected = oracle
    llm = LLM(str(checkpoint), dtype="float32", num_pages=512, **engine_args)
    outputs = llm.generate(prompts, greedy(MAX_NEW))
    assert_matches(outputs, expected)
    llm.core.check_integrity()
    assert llm.core.pages.tree.locked_pages == 0


def test_prefix_cache_hits_give_same_tokens(tiny_checkpoint):
    model = load_hf(tiny_checkpoint)
    system = random_prompts(1, [70], seed=7)[0]
    prompts = [system + tail for tail in random_prompts(4, [5, 9, 16, 23], seed=8)]
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=256, page_size=8, max_num_batched_tokens=64)
    first = llm.generate(prompts, greedy(MAX_NEW))
    second = llm.generate(prompts, greedy(MAX_NEW))
    assert_matches(first, expected)
    assert_matches(second, expected)
    # the shared system prompt was computed once and reused; the repeat hits nearly everything
    assert sum(o.num_cached_tokens for o in first) >= 3 * (70 // 8) * 8
    assert all(o.num_cached_tokens >= (len(p) - 1) // 8 * 8 for o, p in zip(second, prompts))
    llm.core.check_integrity()


def test_n_samples_share_prompt_pages(tiny_checkpoint):
    model = load_hf(tiny_checkpoint)
    prompt = random_prompts(1, [120], seed=3)[0]
    expected = hf_greedy(model, prompt, MAX_NEW)
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=128, page_size=16)
    (output,) = llm.generate([prompt], greedy(MAX_NEW, n=4))
    assert len(output.outputs) == 4
    assert_matches([output], [expected])
    stats = llm.core.stats()
    # one sample computed the prompt; the other three found its full pages cached
    assert stats.prefix_cache_hits_total >= 3 * (119 // 16) * 16


def test_preemption_keeps_outputs_exact(tiny_checkpoint):
    model = load_hf(tiny_checkpoint)
    prompts = random_prompts(6, [20, 33, 41], seed=5)
    expected = [hf_greedy(model, p, 24) for p in prompts]
    # 6 sequences of ~60 tokens need ~90 pages of 4; 30 pages force preemption and recomputation
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=30, page_size=4, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, greedy(max_tokens=24))
    assert llm.core.stats().num_preemptions_total > 0
    assert_matches(outputs, expected)
    llm.core.check_integrity()
    pages = llm.core.pages
    assert pages.tree.locked_pages == 0
    assert pages.pool.num_free + pages.tree.cached_pages == pages.num_pages


def test_request_too_big_for_the_pool_is_a_clear_error(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="context length|pages"):
        llm.generate([[1] * 10], greedy(max_tokens=20))


def test_seeded_sampling_does_not_depend_on_batch(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=256)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True)
    prompt = random_prompts(1, [30], seed=11)[0]
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    mixed = llm.generate(
        [random_prompts(1, [9], seed=12)[0], prompt, random_prompts(1, [50], seed=13)[0]], [other, seeded, other]
    )
    assert mixed[1].outputs[0].token_ids == alone
    unseeded = llm.generate([prompt] * 2, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_bf16_greedy_close_to_transformers(tiny_checkpoint):
    model = load_hf(tiny_checkpoint, dtype=torch.bfloat16)
    prompts = random_prompts(4, [10, 40, 90, 130], seed=21)
    llm = LLM(str(tiny_checkpoint), dtype="bfloat16", num_pages=256, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, greedy(max_tokens=1))
    for output, prompt in zip(outputs, prompts):
        _, rows = hf_greedy(model, prompt, 1)
        got = output.outputs[0].logprobs[0]
        assert got.logprob == pytest.approx(float(rows[0][got.token_id]), abs=0.1)


@torch.inference_mode()
def test_samples_sharing_a_prompt_decode_close_to_transformers_in_bf16(tmp_path):
    """n=4 samples decode against the prompt pages they share: in bf16 at head_dim 64, where a CPU with AMX
    tiles attends the shared prefix once for all four (cascade attention). Each sample's log-probabilities
    match HF's on the same tokens (teacher-forced), step by step."""
    shape = ModelShape(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64)
    checkpoint = build_random_checkpoint(tmp_path, shape, seed=5, dtype=torch.bfloat16)
    model = load_hf(checkpoint, dtype=torch.bfloat16)
    prompt = random_prompts(1, [150], seed=4)[0]
    llm = LLM(str(checkpoint), dtype="bfloat16", num_pages=128, page_size=16)
    (output,) = llm.generate([prompt], greedy(MAX_NEW, n=4))
    for sample in output.outputs:
        rows = torch.log_softmax(model(torch.tensor([prompt + sample.token_ids])).logits[0].float(), dim=-1)
        for step, got in enumerate(sample.logprobs):
            assert got.logprob == pytest.approx(float(rows[len(prompt) - 1 + step, got.token_id]), abs=0.1)


@torch.inference_mode()
def test_chunked_prefill_scores_close_to_transformers_in_bf16(tmp_path):
    """A prompt prefilled in chunks of 48 tokens, each attending to the chunks before it: in bf16 at
    head_dim 128, where a CPU with AMX tiles runs prefill attention on them. Every prompt token's
    log-probability matches HF's on the same prompt."""
    shape = ModelShape(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=128)
    checkpoint = build_random_checkpoint(tmp_path, shape, seed=6, dtype=torch.bfloat16)
    model = load_hf(checkpoint, dtype=torch.bfloat16)
    prompt = random_prompts(1, [230], seed=7)[0]
    llm = LLM(str(checkpoint), dtype="bfloat16", num_pages=64, page_size=16, max_num_batched_tokens=48)
    (output,) = llm.generate([prompt], greedy(max_tokens=1, prompt_logprobs=0))
    rows = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    scored = output.prompt_logprobs[1:]  # the first token has no score
    assert len(scored) == len(prompt) - 1
    for position, got in enumerate(scored):
        assert got.token_id == prompt[position + 1]
        assert got.logprob == pytest.approx(float(rows[position, got.token_id]), abs=0.1)


def test_token_budget_defaults_to_the_devices(tiny_checkpoint):
    """No budget given: the CPU's default (a short step), resolved once the device is known."""
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=64, device="cpu")
    assert llm.core.config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    prompt = list(range(1, 1 + DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"] + 40))  # longer than one step's budget
    llm.core.add(check_request(prompt, SamplingParams(max_tokens=1), llm.core.info))
    batch, _ = llm.core.schedule()
    assert batch.num_new_tokens == [DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]]
