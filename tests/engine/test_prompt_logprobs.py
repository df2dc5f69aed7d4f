"""Scoring the prompt (`SamplingParams.prompt_logprobs`, and `echo` with `logprobs` on /v1/completions):
every prompt token's logprob against HF transformers' log-softmax on the same weights, through chunked
prefill, a prefix another request has cached, n > 1, and a real server driven by the openai SDK."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import LOGPROB_ATOL, load_hf, random_prompts
from helpers_server import served_engine
from mili_openai import LLM, SamplingParams

TOP_K = 3


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, [40, 7, 2], seed=5)


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint, prompts):
    """Per prompt: row i - 1 of HF's log-softmax scores prompt token i."""
    model = load_hf(tiny_checkpoint)
    with torch.inference_mode():
        return [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]


def assert_scores(scored, prompt, rows) -> None:
    assert len(scored) == len(prompt) and scored[0] is None
    for index in range(1, len(prompt)):
        entry, row = scored[index], rows[index - 1]
        assert entry.token_id == prompt[index]
        assert entry.logprob == pytest.approx(float(row[prompt[index]]), abs=LOGPROB_ATOL)
        assert [token for token, _ in entry.top] == row.topk(TOP_K).indices.tolist()
        for token, logprob in entry.top:
            assert logprob == pytest.approx(float(row[token]), abs=LOGPROB_ATOL)


@pytest.mark.parametrize("engine_args", [
    dict(page_size=16, max_num_batched_tokens=4096),  # each prompt in one chunk
    dict(page_size=4, max_num_batched_tokens=12),  # the 40-token prompt over several steps
])
def test_prompt_scores_match_transformers(tiny_checkpoint, prompts, oracle, engine_args):
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=128, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP_K)
    for output, prompt, rows in zip(llm.generate(prompts, params), prompts, oracle):
        assert_scores(output.prompt_logprobs, prompt, rows)
    llm.core.check_integrity()


def test_a_cached_prefix_is_scored_too(tiny_checkpoint, prompts, oracle):
    """A prompt whose prefix another request left in the cache still runs whole, so every position has
    logits; the request after it reuses the pages as usual."""
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=128, page_size=4)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompts[0]], plain)
    scored = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                       prompt_logprobs=TOP_K, n=2))[0]
    assert scored.num_cached_tokens == 0
    assert_scores(scored.prompt_logprobs, prompts[0], oracle[0])
    assert llm.generate([prompts[0]], plain)[0].num_cached_tokens > 0
    llm.core.check_integrity()
    assert llm.core.pages.tree.locked_pages == 0


def test_prompt_logprobs_are_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_echo_with_logprobs_scores_the_prompt_through_a_real_server(tiny_checkpoint, prompts, oracle):
    """OpenAI's legacy shape: `echo` with `logprobs` returns the prompt's tokens first, the first with a
    null logprob, the others with their scores and top alternatives; streamed the same."""
    from openai import OpenAI

    prompt, rows = prompts[0], oracle[0]
    with served_engine(tiny_checkpoint, num_pages=64, page_size=4, max_num_batched_tokens=16) as (live, _):
        client = OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)
        request = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=TOP_K)
        whole = client.completions.create(**request).choices[0].logprobs
        streamed = [chunk.choices[0].logprobs for chunk in client.completions.create(**request, stream=True)
                    if chunk.choices and chunk.choices[0].logprobs is not None]
    assert whole.token_logprobs[0] is None and whole.top_logprobs[0] is None
    for logprobs in (whole.token_logprobs, [v for part in streamed for v in part.token_logprobs]):
        assert len(logprobs) == len(prompt) + 2
        for index in range(1, len(prompt)):
            assert logprobs[index] == pytest.approx(float(rows[index - 1][prompt[index]]), abs=LOGPROB_ATOL)
    assert all(len(top) >= TOP_K for top in whole.top_logprobs[1:])


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(tiny_checkpoint, prompts, oracle):
    """`max_tokens: 0` with `echo`: the prompt and its scores, nothing generated, no completion tokens;
    without `echo` it is a 400."""
    import httpx

    prompt, rows = prompts[0], oracle[0]
    body = dict(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    with served_engine(tiny_checkpoint, num_pages=64, page_size=4) as (live, engine):
        whole = httpx.post(f"{live.api_base}/completions", json=body, timeout=60).json()
        streamed = httpx.post(f"{live.api_base}/completions", json=body | {"stream": True}, timeout=60).text
        refused = httpx.post(f"{live.api_base}/completions", json=body | {"echo": False}, timeout=60)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(logprobs) == len(prompt) and logprobs[0] is None
    assert logprobs[1:] == pytest.approx([float(rows[i - 1][prompt[i]]) for i in range(1, len(prompt))],
                                         abs=LOGPROB_ATOL)
    assert choice["text"] == engine.info.tokenizer.decode(prompt)
    assert '"finish_reason":"length"' in streamed.replace(" ", "") and streamed.rstrip().endswith("[DONE]")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_field_on_completions_and_chat(tiny_checkpoint, prompts, oracle):
    """vLLM's `prompt_logprobs` extra: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} with the prompt's own token (its rank over the vocabulary) and the top k; on each
    completion choice, and on a chat response (over the rendered prompt); refused with stream."""
    from openai import BadRequestError, OpenAI

    prompt, rows = prompts[0], oracle[0]
    with served_engine(tiny_checkpoint, num_pages=64, page_size=4) as (live, _):
        client = OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                               extra_body={"prompt_logprobs": 2})
        chat = client.chat.completions.create(model="tiny", max_tokens=1, extra_body={"prompt_logprobs": 0},
                                              messages=[{"role": "user", "content": "Hello there"}])
        with pytest.raises(BadRequestError, match="prompt_logprobs"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=1, stream=True,
                                      extra_body={"prompt_logprobs": 2})
    scored = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    for index in range(1, len(prompt)):
        row, token = rows[index - 1], prompt[index]
        position = scored[index]
        own = position[str(token)]
        assert own["logprob"] == pytest.approx(float(row[token]), abs=LOGPROB_ATOL)
        assert own["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(2).indices.tolist()
        assert {str(t) for t in top} <= set(position) and len(position) == len({token, *top})
        assert [position[str(t)]["rank"] for t in top] == [1, 2]
    chat_scored = chat.model_extra["prompt_logprobs"]
    assert chat_scored[0] is None and len(chat_scored) == chat.usage.prompt_tokens
    assert all(len(position) == 1 for position in chat_scored[1:])  # k = 0: the prompt's own token only
