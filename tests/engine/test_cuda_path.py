"""The engine and server on a CUDA device, against HF transformers: skipped where torch sees no GPU (CI
has none; run it on a GPU machine with `pytest tests/engine/test_cuda_path.py`).

The CPU tests cover the same logic through the compiled CPU kernels (and the Triton kernels under its
interpreter); here the GPU path runs: the Triton page-table attention kernels (and torch's SDPA over
gathered pages with `attention_backend="torch"`), cuBLAS matmuls, sampling on device, step inputs copied
over from pinned memory, decode steps replayed from CUDA graphs, the KV pool sized from GPU memory. The
float32 oracle stays on the CPU: a token that differs is then the GPU path's.
"""

from __future__ import annotations

import openai
import pytest
import torch

from engine_helpers import LOGPROB_ATOL, assert_matches, greedy, hf_greedy, load_hf, random_prompts
from helpers_server import served_engine
from mili_openai import LLM, SamplingParams
from mili_openai.engine.cuda_graphs import CAPTURE_SIZES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

PROMPT_LENGTHS = [1, 7, 17, 64, 150, 300]
MAX_NEW = 12
BF16_LOGPROB_ATOL = 0.1  # bf16 rounds differently in each implementation's kernels; the CPU test's bound


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint):
    model = load_hf(tiny_checkpoint)
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=31)
    return prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(page_size=16, max_num_batched_tokens=4096),  # whole prompts in one step, all batched
        dict(page_size=4, max_num_batched_tokens=48),  # chunked prefill mixed with decodes
        dict(page_size=4, max_num_batched_tokens=64, num_pages=100),  # too few pages: preemption
        dict(page_size=16, max_num_batched_tokens=4096, enforce_eager=True),  # decode op by op, no graphs
        dict(page_size=4, max_num_batched_tokens=48, attention_backend="torch"),  # SDPA over gathered pages, eager
    ],
    ids=["batched", "chunked", "preempting", "eager", "torch-attention"],
)
def test_greedy_on_cuda_matches_transformers(tiny_checkpoint, oracle, engine_args):
    prompts, expected = oracle
    llm = LLM(str(tiny_checkpoint), dtype="float32", device="cuda", **{"num_pages": 512, **engine_args})
    assert llm.core.runner.device.type == "cuda" and llm.core.runner.forward.kv_cache.device.type == "cuda"
    first = llm.generate(prompts, greedy(MAX_NEW))
    assert_matches(first, expected)
    graphs = llm.core.runner.forward.decode_graphs
    torch_attention = engine_args.get("attention_backend") == "torch"
    assert (llm.core.runner.forward.model.backend.attention is None) == torch_attention
    # graphs need an attention kernel (torch's SDPA would gather every row's whole page table)
    assert (graphs is None) == (engine_args.get("enforce_eager", False) or torch_attention)
    assert graphs is None or graphs.steps_run > 0  # decode steps ran from captured graphs
    # again: the prompts' pages are cached now, and reusing them must not change a token
    second = llm.generate(prompts, greedy(MAX_NEW))
    assert_matches(second, expected)
    if "num_pages" in engine_args:
        assert llm.core.stats().num_preemptions_total > 0
    else:
        assert sum(o.num_cached_tokens for o in second) > 0
    llm.core.check_integrity()
    assert llm.core.pages.tree.locked_pages == 0


def test_bf16_on_cuda_close_to_transformers_on_cuda(tiny_checkpoint):
    model = load_hf(tiny_checkpoint, dtype=torch.bfloat16).to("cuda")
    prompts = random_prompts(4, [10, 40, 90, 130], seed=32)
    llm = LLM(str(tiny_checkpoint), dtype="bfloat16", device="cuda", num_pages=256, max_num_batched_tokens=64)
    for output, prompt in zip(llm.generate(prompts, greedy(max_tokens=1)), prompts):
        _, rows = hf_greedy(model, prompt, 1)
        got = output.outputs[0].logprobs[0]
        assert got.logprob == pytest.approx(float(rows[0][got.token_id]), abs=BF16_LOGPROB_ATOL)


def test_seeded_sampling_on_cuda_is_reproducible_and_batch_independent(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), dtype="float32", device="cuda", num_pages=256)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True)
    prompt = random_prompts(1, [30], seed=33)[0]
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    mixed = llm.generate([random_prompts(1, [9], seed=34)[0], prompt], [other, seeded])
    assert mixed[1].outputs[0].token_ids == alone and len(alone) == 12


def test_served_on_cuda_through_the_sdk(tiny_checkpoint, oracle):
    """A real server on the GPU engine: a plain and a streamed completion carry the oracle's tokens, and the
    plain one its log-probabilities."""
    prompts, expected = oracle
    prompt, (tokens, rows) = prompts[3], expected[3]
    with served_engine(tiny_checkpoint, device="cuda", num_pages=64, page_size=16) as (live, engine):
        assert engine.core.runner.device.type == "cuda"
        client = openai.OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)
        request = dict(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=1,
                       extra_body={"ignore_eos": True})
        whole = client.completions.create(**request)
        streamed = [chunk for chunk in client.completions.create(**request, stream=True) if chunk.choices]
        expected_text = engine.info.tokenizer.decode(tokens)
    assert whole.usage.completion_tokens == MAX_NEW
    assert whole.choices[0].text == expected_text
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected_text
    for got, token, row in zip(whole.choices[0].logprobs.token_logprobs, tokens, rows, strict=True):
        assert got == pytest.approx(float(row[token]), abs=LOGPROB_ATOL)


def test_cuda_defaults_size_the_pool_from_gpu_memory_and_graph_every_batch_size(tiny_checkpoint):
    """Plain `LLM(..., device="cuda")`: vLLM's batch sizes, a KV pool within the memory share, one page-table
    graph per capture size up to 256 rows, and a context past the graphs' old 2048-slot buckets still
    decodes from them, token for token as transformers."""
    llm = LLM(str(tiny_checkpoint), dtype="float32", device="cuda", gpu_memory_utilization=0.5)
    runner, config = llm.core.runner, llm.core.config
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 8192)
    total = torch.cuda.get_device_properties(0).total_memory
    assert runner.num_pages > 0 and runner.forward.kv_cache.nbytes <= 0.5 * total
    graphs = runner.forward.decode_graphs
    assert set(graphs.graphs) == set(CAPTURE_SIZES)
    prompt = random_prompts(1, [2100], seed=35)[0]
    expected = hf_greedy(load_hf(tiny_checkpoint), prompt, MAX_NEW)
    before = graphs.steps_run
    assert_matches(llm.generate([prompt], greedy(MAX_NEW)), [expected])
    assert graphs.steps_run > before and len(graphs.graphs) == len(CAPTURE_SIZES)  # no capture for the long one
