"""Our Qwen3 against transformers' on the same checkpoints: logits of full prefills, chunked prefills
over shuffled pages, and decode rows batched with prefill chunks of other sequences."""

from __future__ import annotations

import pytest
import torch

from model_helpers import CountingStack, PagedSequences, random_tokens

from mili_openai import kernels as kernels_module
from mili_openai.kernels import cpu_supports_kernels
from mili_openai.kernels.cpu_avx2 import load_avx2_kernels
from mili_openai.model.backend_setup import use_cpu_kernels
from mili_openai.model import KVCache, ModelCaches, load_model

FP32_ATOL = 1e-4
BF16_ERROR_RATIO = 1.5  # our bf16 error vs the float32 oracle, relative to transformers' own bf16 error


@torch.inference_mode()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0].float()  # (L, vocab)


@torch.inference_mode()
def run_steps(model, config, pages: PagedSequences, steps, dtype=torch.float32, num_pages=64,
              cache: KVCache | None = None) -> list:
    """Run each (decode, prefill) step; -> [(key, position, logits row)] over all steps."""
    cache = cache or KVCache(model.cache_specs(), num_pages, pages.page_size, dtype, torch.device("cpu"))
    results = []
    for decode, prefill in steps:
        batch, rows = pages.batch(decode, prefill)
        logits = model.compute_logits(model(batch, ModelCaches(cache))[batch.logits_indices])
        assert logits.dtype == torch.float32 and logits.shape == (len(rows), config.vocab_size)
        results.extend((key, position, logits[i]) for i, (key, position) in enumerate(rows))
    return results


def assert_close_to_hf(results, expected: dict[str, torch.Tensor], atol: float) -> None:
    for key, position, row in results:
        torch.testing.assert_close(row, expected[key][position], rtol=0, atol=atol,
                                   msg=lambda m: f"{key} position {position}: {m}")


@pytest.fixture(scope="module", params=["tiny_checkpoint", "tiny_checkpoint_mha_untied"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def models(checkpoint):
    from transformers import Qwen3ForCausalLM as HFQwen3

    model, config = load_model(checkpoint, torch.float32, torch.device("cpu"))
    hf = HFQwen3.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    return model, config, hf


def test_full_prefill_matches_transformers(models):
    model, config, hf = models
    tokens = random_tokens(50, seed=1)
    pages = PagedSequences(num_pages=64, page_size=16)
    pages.add("a", tokens)
    results = run_steps(model, config, pages, [([], [("a", 50)])])
    assert len(results) == 50
    assert_close_to_hf(results, {"a": hf_logits(hf, tokens)}, FP32_ATOL)


@pytest.mark.parametrize("page_size", [4, 16])
def test_chunked_prefill_over_shuffled_pages(models, page_size):
    model, config, hf = models
    tokens = random_tokens(70, seed=2)
    pages = PagedSequences(num_pages=64, page_size=page_size, seed=page_size)
    pages.add("a", tokens)
    chunks = [13, 1, 30, 26]  # chunk boundaries fall inside pages and on them
    results = run_steps(model, config, pages, [([], [("a", n)]) for n in chunks])
    assert [p for _, p, _ in results] == list(range(70))
    assert pages.pages["a"] != sorted(pages.pages["a"])  # the pages really are out of order
    assert_close_to_hf(results, {"a": hf_logits(hf, tokens)}, FP32_ATOL)


def mixed_schedule() -> tuple[dict[str, list[int]], list]:
    """Four sequences of different lengths: prefills in chunks, decodes batched with others' chunks."""
    lengths = {"a": 5 + 8, "b": 17 + 8, "c": 33 + 6, "d": 9 + 4}
    tokens = {key: random_tokens(n, seed=10 + i) for i, (key, n) in enumerate(lengths.items())}
    steps = [
        ([], [("a", 5), ("b", 17)]),  # two whole prompts in one forward
        (["a", "b"], [("c", 20)]),  # decodes + a first chunk
        (["a", "b"], [("c", 13)]),  # decodes + the last chunk (a cached prefix)
        (["a", "b", "c"], [("d", 9)]),
        (["a", "b", "c", "d"], []),  # pure decode, four different context lengths
        (["a", "b", "c", "d"], []),
        (["c", "a", "d", "b"], []),  # row order independent of sequence order
        (["a", "b"], [("c", 2)]),  # a sequence can also take a multi-token chunk after decodes
        (["a", "b", "d"], []),
    ]
    return tokens, steps


def test_decode_rows_batched_with_prefill_chunks(models):
    model, config, hf = models
    tokens, steps = mixed_schedule()
    pages = PagedSequences(num_pages=64, page_size=4, seed=3)
    for key, seq in tokens.items():
        pages.add(key, seq)
    results = run_steps(model, config, pages, steps)
    assert {key: pages.computed[key] for key in tokens} == {key: len(seq) for key, seq in tokens.items()}
    assert_close_to_hf(results, {key: hf_logits(hf, seq) for key, seq in tokens.items()}, FP32_ATOL)


@pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")
def test_prefill_chunks_attend_through_the_compiled_kernel(models):
    """Whole prompts, first chunks and chunks after a cached prefix all attend from the pool in place,
    and stay as close to transformers as the torch path."""
    model, config, hf = models
    kernel = model.backend.attention
    assert kernel is not None
    chunk_lengths = []

    class CountingKernel:  # proves the chunks went through the kernel rather than SDPA
        supports_decode_attention = staticmethod(kernel.supports_decode_attention)
        paged_decode_attention = staticmethod(kernel.paged_decode_attention)
        supports_prefill_attention = staticmethod(kernel.prefill_attention_fits)  # whichever the plan picked

        def paged_prefill_attention(self, q, k_pool, v_pool, page_table, page_size, cu_seqlens, *args, **kwargs):
            chunk_lengths.extend(cu_seqlens.diff().tolist())  # every chunk of the step in one call
            return kernel.paged_prefill_attention(q, k_pool, v_pool, page_table, page_size, cu_seqlens, *args, **kwargs)

    model.backend.attention = CountingKernel()
    try:
        tokens, steps = mixed_schedule()
        pages = PagedSequences(num_pages=64, page_size=4, seed=7)
        for key, seq in tokens.items():
            pages.add(key, seq)
        results = run_steps(model, config, pages, steps)
    finally:
        model.backend.attention = kernel
    expected = [length for _, prefill in steps for _ in range(config.num_hidden_layers) for _, length in prefill]
    assert chunk_lengths == expected  # each layer of each step, its chunks in batch order
    assert_close_to_hf(results, {key: hf_logits(hf, seq) for key, seq in tokens.items()}, FP32_ATOL)


def test_decode_rows_through_torch_ops_without_compiled_kernels(checkpoint, models):
    """The portable path (GPUs, CPUs without AVX512-BF16): context gathered through the page tables, masked SDPA."""
    model, config = load_model(checkpoint, torch.float32, torch.device("cpu"), use_decode_kernel=False)
    assert model.backend.attention is None
    assert all(layer.self_attn.backend is model.backend for layer in model.model.layers)
    hf = models[2]
    tokens, steps = mixed_schedule()
    pages = PagedSequences(num_pages=64, page_size=4, seed=5)
    for key, seq in tokens.items():
        pages.add(key, seq)
    results = run_steps(model, config, pages, steps)
    assert_close_to_hf(results, {key: hf_logits(hf, seq) for key, seq in tokens.items()}, FP32_ATOL)


@pytest.mark.parametrize("matmuls", ["default", "avx2"])
def test_bf16_as_close_to_the_float32_oracle_as_transformers_bf16(tiny_checkpoint, matmuls, monkeypatch):
    from transformers import Qwen3ForCausalLM as HFQwen3

    if matmuls == "default":
        # default load: on an AVX-512 CPU the few-row matmuls go through the decode kernel, on an AVX2 one the
        # AVX2 kernel's
        model, config = load_model(tiny_checkpoint, torch.bfloat16, torch.device("cpu"))
    else:  # the AVX2 kernel's matmuls as a CPU without AVX-512 takes them, on any CPU with AVX2
        avx2 = load_avx2_kernels(plan_cache=False)
        if avx2 is None:
            pytest.skip("this CPU has no AVX2 and FMA")
        model, config = load_model(tiny_checkpoint, torch.bfloat16, torch.device("cpu"), use_decode_kernel=False)
        monkeypatch.setattr(kernels_module, "cpu_supports_kernels", lambda: False)
        use_cpu_kernels(model, None)
        assert model.backend.matmul == avx2.linear
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    hf32 = HFQwen3.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    hf16 = HFQwen3.from_pretrained(str(tiny_checkpoint), dtype=torch.bfloat16).eval()
    tokens, steps = mixed_schedule()
    pages = PagedSequences(num_pages=64, page_size=4, seed=4)
    for key, seq in tokens.items():
        pages.add(key, seq)
    results = run_steps(model, config, pages, steps, dtype=torch.bfloat16)
    oracle = {key: hf_logits(hf32, seq) for key, seq in tokens.items()}
    hf_error = max(float((hf_logits(hf16, seq) - oracle[key]).abs().max()) for key, seq in tokens.items())
    our_error = max(float((row - oracle[key][position]).abs().max()) for key, position, row in results)
    assert our_error <= BF16_ERROR_RATIO * hf_error
    assert float(oracle["c"].std()) > 3 * our_error  # the logits vary far more than the error


@pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")
@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", "tiny_moe_checkpoint"])
def test_compiled_decode_stack_matches_the_modules_bit_for_bit(checkpoint, request):
    """Decode-only steps run every layer in one compiled call, MoE blocks (among dense layers) included;
    logits and the K/V it writes are exactly those of the same kernels called layer by layer from the
    modules."""
    model, config = load_model(request.getfixturevalue(checkpoint), torch.bfloat16, torch.device("cpu"))
    stack = model.model.decode_stack
    assert stack is not None
    tokens, steps = mixed_schedule()
    counting = CountingStack(stack)  # proves the first run went through the stack, not the modules both times

    runs = {}
    for name, decode_stack in (("stack", counting), ("modules", None)):
        model.model.decode_stack = decode_stack
        pages = PagedSequences(num_pages=64, page_size=4, seed=6)
        for key, seq in tokens.items():
            pages.add(key, seq)
        cache = KVCache(model.cache_specs(), 64, 4, torch.bfloat16, torch.device("cpu"))
        runs[name] = run_steps(model, config, pages, steps, cache=cache), cache.pools
    model.model.decode_stack = stack
    assert counting.calls == [len(decode) for decode, prefill in steps if not prefill]  # every pure decode step
    (with_stack, stack_pools), (with_modules, module_pools) = runs["stack"], runs["modules"]
    assert [(k, p) for k, p, _ in with_stack] == [(k, p) for k, p, _ in with_modules]
    for (key, position, got), (_, _, want) in zip(with_stack, with_modules):
        assert torch.equal(got, want), f"{key} position {position}"
    assert torch.equal(stack_pools, module_pools)


@pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")
def test_decode_stack_only_where_its_kernels_run(tiny_checkpoint, tiny_checkpoint_mha_untied):
    """float32 weights, or head_dim 16 (no compiled RoPE), keep the layer-by-layer path."""
    assert load_model(tiny_checkpoint, torch.float32, torch.device("cpu"))[0].model.decode_stack is None
    mha, _ = load_model(tiny_checkpoint_mha_untied, torch.bfloat16, torch.device("cpu"))
    assert mha.model.decode_stack is None


def test_kv_cache_dtype_must_match_weights(tiny_checkpoint):
    model, config = load_model(tiny_checkpoint, torch.float32, torch.device("cpu"))
    pages = PagedSequences(num_pages=8, page_size=4)
    pages.add("a", [1, 2, 3])
    batch, _ = pages.batch([], [("a", 3)])
    with pytest.raises(ValueError, match="dtype"):
        model(batch, ModelCaches(KVCache(model.cache_specs(), 8, 4, torch.bfloat16, torch.device("cpu"))))
