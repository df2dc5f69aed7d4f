"""The offline batch API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceABC

from mili_openai.config import EngineConfig
from mili_openai.engine.core import EngineCore
from mili_openai.engine.outputs import CompletionOutput, RequestOutput
from mili_openai.engine.sampling_params import SamplingParams

PromptInput = str | list[int]


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: same settings, its own seed so samples differ yet stay reproducible."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        self.core = EngineCore.from_config(self.config)
        self.tokenizer = self.core.tokenizer

    def expert_load(self) -> dict[int, list[int]]:
        """For a Qwen3-MoE model, {sparse layer index: how many (token, expert) pairs each expert has received
        since load}, to debug routing balance; empty for a dense model. Counted in the forward (prefill and
        decode tokens, recomputed ones included). Under CUDA graphs the decode steps' counts also include the
        padding rows of each step's graph bucket (--enforce-eager counts exactly)."""
        return self.core.runner.expert_load()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's generation_config.json
        defaults (see engine/sampling_defaults.py), as vLLM's method of this name returns."""
        return self.core.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | SequenceABC[PromptInput],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = self._normalise_prompts(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("give one SamplingParams, or exactly one per prompt")

        results: list[RequestOutput] = []
        owners: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        for prompt_index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            result = RequestOutput(request_id=str(prompt_index), prompt=text, prompt_token_ids=ids, finished=False)
            results.append(result)
            for sample in range(params.n):
                seq = self.core.add(ids, _sample_params(params, sample), f"llm-{id(self)}-{prompt_index}-{sample}")
                completion = CompletionOutput(index=sample, text="", token_ids=[], finish_reason=None)
                result.outputs.append(completion)
                owners[seq.request_id] = (result, completion)

        try:
            self._run_to_completion(owners)
        finally:
            for request_id in list(owners):
                self.core.abort(request_id)
        return results

    def _run_to_completion(self, owners: dict[str, tuple[RequestOutput, CompletionOutput]]) -> None:
        while self.core.has_work():
            scheduled = self.core.schedule()
            if scheduled is None:
                continue
            batch, step = scheduled
            output = self.core.runner.execute(step)
            for delta in self.core.postprocess(batch, output):
                result, completion = owners[delta.request_id]
                completion.text += delta.text
                completion.token_ids.extend(delta.token_ids)
                if delta.logprobs is not None:
                    completion.logprobs = (completion.logprobs or []) + delta.logprobs
                if delta.prompt_logprobs is not None:  # the same for every sample of the prompt
                    result.prompt_logprobs = delta.prompt_logprobs
                result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
                if delta.finish_reason is not None:
                    completion.finish_reason = delta.finish_reason
                    completion.stop_reason = delta.stop_reason
                    del owners[delta.request_id]
                    result.finished = all(c.finish_reason is not None for c in result.outputs)

    @staticmethod
    def _normalise_prompts(prompts) -> list[PromptInput]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts
