"""`mili bench serve`'s workloads: prompts that retokenize to their length, and the random, shared-prefix
and ShareGPT datasets."""

from __future__ import annotations

import pytest
from bench_helpers import SHAREGPT_KEPT, write_sharegpt

from mili_openai.bench.config import BenchConfig, length_range
from mili_openai.bench.datasets import (
    build_random_requests,
    build_shared_prefix_requests,
    build_sharegpt_requests,
    build_workload,
)
from mili_openai.bench.sse_client import request_body
from mili_openai.bench.prompt_tokens import PromptBuilder


@pytest.mark.parametrize("length", [1, 7, 256, 960])
def test_text_prompts_retokenize_to_requested_length(bench_tokenizer, length):
    builder = PromptBuilder(bench_tokenizer, seed=length)
    for _ in range(3):
        prompt = builder.prompt(length)
        retokenized = bench_tokenizer.encode(prompt.text, add_special_tokens=False).ids
        assert abs(len(retokenized) - length) <= 1
        assert list(prompt.token_ids) == retokenized


def test_prompts_use_normal_vocab_only_and_differ(bench_tokenizer):
    builder = PromptBuilder(bench_tokenizer, seed=0)
    normal_size = bench_tokenizer.get_vocab_size(with_added_tokens=False)
    prompts = [builder.id_prompt(64) for _ in range(4)]
    assert all(len(p.token_ids) == 64 and max(p.token_ids) < normal_size for p in prompts)
    assert len({p.token_ids for p in prompts}) == 4


def test_same_seed_same_prompts(bench_tokenizer):
    first = PromptBuilder(bench_tokenizer, seed=3).prompt(32)
    assert PromptBuilder(bench_tokenizer, seed=3).prompt(32) == first
    assert PromptBuilder(bench_tokenizer, seed=4).prompt(32) != first


def test_random_dataset_lengths(bench_tokenizer):
    requests = build_random_requests(PromptBuilder(bench_tokenizer, 0), 5, input_len=100, output_len=9)
    assert len(requests) == 5
    assert all(abs(r.prompt_len - 100) <= 1 and r.output_len == 9 and r.prefix is None for r in requests)


def test_random_range_ratio_draws_lengths_within_bounds(bench_tokenizer):
    requests = build_random_requests(PromptBuilder(bench_tokenizer, 0), 40, input_len=40, output_len=10,
                                     range_ratio=0.5)
    prompt_lens, output_lens = [r.prompt_len for r in requests], [r.output_len for r in requests]
    assert all(20 - 1 <= n <= 60 + 1 for n in prompt_lens) and all(5 <= n <= 15 for n in output_lens)
    assert len(set(prompt_lens)) > 5 and len(set(output_lens)) > 3  # drawn, not fixed
    again = build_random_requests(PromptBuilder(bench_tokenizer, 0), 40, input_len=40, output_len=10, range_ratio=0.5)
    assert again == requests  # seeded
    # at 0 no length is drawn: the prompts are those of a run without the option
    plain = build_random_requests(PromptBuilder(bench_tokenizer, 0), 3, input_len=12, output_len=4)
    assert build_random_requests(PromptBuilder(bench_tokenizer, 0), 3, input_len=12, output_len=4, range_ratio=0) == plain


def test_length_range_bounds():
    assert length_range(100, 0.1) == (90, 110)  # not 111: 100 * 1.1 is not exact in floats
    assert length_range(64, 0.5) == (32, 96)
    assert length_range(1, 0.9) == (1, 2)
    assert length_range(7, 0.0) == (7, 7)


def test_shared_prefix_dataset_groups(bench_tokenizer):
    requests = build_shared_prefix_requests(PromptBuilder(bench_tokenizer, 0), 8, num_groups=2, prefix_len=120,
                                            suffix_len=10, output_len=4)
    assert [r.group for r in requests] == [0, 1] * 4  # round-robin: groups arrive interleaved
    assert all(r.prefix is requests[r.group].prefix for r in requests)
    assert requests[0].prefix != requests[1].prefix
    assert len({r.body for r in requests}) == 8
    config = BenchConfig(dataset="shared-prefix")
    text = request_body(config, "m", requests[0])["prompt"]
    assert text.startswith(requests[0].prefix.text)
    assert abs(len(bench_tokenizer.encode(text, add_special_tokens=False).ids) - 130) <= 1


def test_shared_prefix_rejects_more_groups_than_requests(bench_tokenizer):
    with pytest.raises(ValueError, match="num_groups"):
        build_shared_prefix_requests(PromptBuilder(bench_tokenizer, 0), 2, num_groups=3, prefix_len=4, suffix_len=4,
                                     output_len=1)


def test_warmup_prompts_are_not_measured_prompts(bench_tokenizer):
    config = BenchConfig(num_requests=3, warmup=2, input_len=16)
    warmup, measured = build_workload(config, bench_tokenizer)
    assert len(warmup) == 2 and len(measured) == 3
    assert not {r.body for r in warmup} & {r.body for r in measured}


def test_sharegpt_dataset_reads_conversations_as_vllm_does(bench_tokenizer, tmp_path):
    """First turn = prompt, the reply's token count = max_tokens; entries vLLM skips are skipped; a seed
    gives one order; asking for more than the file holds is an error."""
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path)
    requests = build_sharegpt_requests(PromptBuilder(bench_tokenizer, 0), 4, path)
    assert sorted(r.body.text for r in requests) == sorted(p for p, _ in SHAREGPT_KEPT)
    replies = dict(SHAREGPT_KEPT)
    for request in requests:
        assert request.output_len == len(bench_tokenizer.encode(replies[request.body.text], add_special_tokens=False).ids)
        assert list(request.body.token_ids) == bench_tokenizer.encode(request.body.text, add_special_tokens=False).ids
    again = build_sharegpt_requests(PromptBuilder(bench_tokenizer, 0), 4, path)
    assert [r.body for r in again] == [r.body for r in requests]
    fixed = build_sharegpt_requests(PromptBuilder(bench_tokenizer, 0), 2, path, output_len=7)
    assert [r.output_len for r in fixed] == [7, 7]
    with pytest.raises(ValueError, match="4 usable conversations"):
        build_sharegpt_requests(PromptBuilder(bench_tokenizer, 0), 5, path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        build_sharegpt_requests(PromptBuilder(bench_tokenizer, 0), 1, tmp_path / "bad.json")


def test_sharegpt_warmup_conversations_are_not_measured(bench_tokenizer, tmp_path):
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path)
    config = BenchConfig(dataset="sharegpt", dataset_path=str(path), num_requests=3, warmup=1)
    warmup, measured = build_workload(config, bench_tokenizer)
    assert len(warmup) == 1 and len(measured) == 3
    assert not {r.body for r in warmup} & {r.body for r in measured}
